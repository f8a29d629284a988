"""A tensor-parallel rank that dies: which rank, and its own error, instead of another rank's echo.

SGLang 0.5.23 learns of a dead scheduler in two ways, both ending in SIGQUIT to the engine's
process (this worker): the scheduler's own exception handler (srt/managers/scheduler.py::
run_scheduler_process logs "Scheduler hit an exception: <traceback>" under its "TP<r>" log prefix and
signals its parent), or, for a process killed outright, srt/utils/watchdog.py::
SubprocessWatchdog._check_processes ("Subprocess scheduler_<i> (pid=<p>) crashed with exit code
<c>"; scheduler_<i> is TP rank i while dp and pp are 1: entrypoints/engine.py::
_launch_scheduler_processes starts them in rank order). Its running-phase handler (srt/managers/
tokenizer_manager.py::SignalHandler.running_phase_sigquit_handler) then kills the whole process tree,
this worker with it, and the surviving ranks' errors (a gloo peer that vanished) are the last lines in
the log: the harness would report one of those, naming the wrong rank.

A rank killed outright writes nothing, and the watchdog names the first dead scheduler in rank order,
which may be a survivor that died of the lost peer. So `snapshot` records each rank's scheduler
process when the engine starts (its title, srt/managers/scheduler.py::run_scheduler_process:
"sglang::scheduler_TP<r>"), and the cause is chosen in this order: a rank that died of a signal; a
rank whose own exception is not a lost-peer echo (gloo/NCCL "Connection reset/closed by peer"); the
first rank that logged an exception; the watchdog's line.

`install` takes over from SGLang's handler for a tensor-parallel engine: it names the rank and its
own error, which the request that was running raises as EngineSpent, so that only SGLang's items
fail and the worker ends after answering (its close kills every process of every rank).
"""

from __future__ import annotations

import re
import signal

from difftest.api import EngineSpent

_EXCEPTION = re.compile(r"TP(\d+)\] Scheduler hit an exception")
_WATCHDOG = re.compile(r"Subprocess scheduler_(\d+) \(pid=(\d+)\) crashed with exit code (-?\d+)")
_ERROR_LINE = re.compile(r"^([A-Za-z_.]*(?:Error|Exception|Interrupt)): (.*)$")
_ECHO = re.compile(r"gloo|nccl|Connection (reset|closed) by peer|Broken pipe", re.IGNORECASE)
_TITLE = re.compile(r"^sglang::scheduler_TP(\d+)$")


def _how(code: int) -> str:
    if code < 0 and -code in {s.value for s in signal.Signals}:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _rank_errors(lines: list[str]) -> dict[int, str]:
    """Each rank's own exception (the first error line after its "Scheduler hit an exception")."""
    errors: dict[int, str] = {}
    for i, line in enumerate(lines):
        m = _EXCEPTION.search(line)
        if m and int(m.group(1)) not in errors:
            errors[int(m.group(1))] = next((ln.strip() for ln in lines[i + 1 :] if _ERROR_LINE.match(ln.strip())), "")
    return errors


def crash_cause(log_text: str, exits: dict[int, tuple[int, int | None]] | None = None) -> str:
    """The rank that failed first, and how. `exits`: rank -> (scheduler pid, exit code or None)."""
    exits = exits or {}
    errors = _rank_errors(log_text.splitlines())
    signalled = [r for r, (_, code) in sorted(exits.items()) if code is not None and code < 0]
    if signalled:
        r = signalled[0]
        pid, code = exits[r]
        own = f"; its last error: {errors[r]}" if errors.get(r) else ""
        return f"SGLang's tensor-parallel rank {r} (scheduler pid {pid}) died: {_how(code)}{own}"
    own = [r for r, e in sorted(errors.items()) if e and not _ECHO.search(e)]
    for r in own or sorted(errors):
        return f"SGLang's tensor-parallel rank {r} (its scheduler) failed: {errors[r] or 'see the log'}"
    m = _WATCHDOG.search(log_text)
    if m:
        return f"SGLang's tensor-parallel rank {m.group(1)} (scheduler pid {m.group(2)}) died: {_how(int(m.group(3)))}"
    return "an SGLang process sent SIGQUIT (one of its processes failed) and named no rank"


def snapshot() -> dict[int, tuple[int, object]]:
    """Right after the engine started: rank -> (scheduler pid, its multiprocessing.Process, whose exit
    code the forkserver reports to this process)."""
    import multiprocessing

    import psutil

    procs = {p.pid: p for p in multiprocessing.active_children()}
    ranks = {}
    for child in psutil.Process().children(recursive=True):
        try:
            m = _TITLE.match((child.cmdline() or [""])[0])
        except psutil.Error:
            continue
        if m:
            ranks[int(m.group(1))] = (child.pid, procs.get(child.pid))
    return ranks


class Watch:
    """The adapter's SIGQUIT handler for one tensor-parallel engine (see the module doc)."""

    def __init__(self) -> None:
        self.cause: str | None = None
        self.stopped = False  # the adapter shuts the engine down: its ranks exit by design

    def stop(self) -> None:
        self.stopped = True

    def check(self) -> None:
        """After a request to SGLang returned or raised: the dead rank's error, if one died."""
        if self.cause is not None:
            raise EngineSpent(self.cause)


def install(engine, read_log) -> Watch:
    """Take over from SGLang's running-phase SIGQUIT handler for a tensor-parallel engine.
    `read_log()` returns what SGLang's processes wrote to the log since the engine started.

    SGLang's running-phase handler (TokenizerManager's SignalHandler, registered on the engine's
    loop at its first request) would kill this worker; it is made a no-op, and a thread watches the
    ranks' scheduler processes itself: when one has
    exited, it names the rank and stops the loop from outside (`call_soon_threadsafe`); the request
    waiting on it (`run_until_complete`: "Event loop stopped before Future completed") ends, and
    `Watch.check` raises the cause in its place."""
    import sys
    import threading
    import time

    ranks = snapshot()
    loop = engine.loop  # the loop Engine.generate runs its requests on (srt/entrypoints/engine.py)
    manager = engine.tokenizer_manager
    base = manager.signal_handler_class

    class Quiet(base):  # type: ignore[misc, valid-type]
        def running_phase_sigquit_handler(self, signum=None, frame=None):
            pass  # the watcher below answers a dead rank, and names it

    # registered on the loop at the first request (TokenizerManager.auto_create_handle_loop)
    manager.signal_handler_class = Quiet
    signal.signal(signal.SIGQUIT, lambda signum, frame: None)  # until then, the launch-phase handler's place
    watch = Watch()

    def exits() -> dict:
        return {r: (pid, getattr(p, "exitcode", None)) for r, (pid, p) in ranks.items()}

    def watcher() -> None:
        while watch.cause is None:
            time.sleep(0.5)
            if watch.stopped or loop.is_closed():
                return
            if any(code is not None for _, code in exits().values()):
                time.sleep(1.5)  # the other ranks' exit codes and the log's last lines arrive
                if watch.stopped:
                    return
                watch.cause = crash_cause(read_log(), exits())
                print(f"[sglang adapter] {watch.cause}; stopping the engine's event loop", file=sys.stderr, flush=True)
                loop.call_soon_threadsafe(loop.stop)

    if ranks:
        threading.Thread(target=watcher, name="difftest-rank-watch", daemon=True).start()
    return watch
