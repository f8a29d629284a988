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

`install` puts the adapter's handler in its place for a tensor-parallel engine: it names the rank and
its own error, and raises EngineSpent in the request that was running, so that only SGLang's items
fail and the worker ends after answering (its close kills every process of every rank).
"""

from __future__ import annotations

import re
import signal

from difftest.errors import EngineSpent

_EXCEPTION = re.compile(r"TP(\d+)\] Scheduler hit an exception")
_WATCHDOG = re.compile(r"Subprocess scheduler_(\d+) \(pid=(\d+)\) crashed with exit code (-?\d+)")
_ERROR_LINE = re.compile(r"^([A-Za-z_.]*(?:Error|Exception|Interrupt)): (.*)$")


def crash_cause(log_text: str) -> str:
    """The first rank that died, and how, from the log SGLang's processes wrote (see the module doc)."""
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        m = _EXCEPTION.search(line)
        if m:
            error = next((ln.strip() for ln in lines[i + 1 :] if _ERROR_LINE.match(ln.strip())), "")
            return f"SGLang's tensor-parallel rank {m.group(1)} (its scheduler) failed: {error or 'see the log'}"
    m = _WATCHDOG.search(log_text)
    if m:
        rank, pid, code = m.group(1), m.group(2), int(m.group(3))
        how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else f"exit code {code}"
        return f"SGLang's tensor-parallel rank {rank} (scheduler pid {pid}) died: {how}"
    return "an SGLang process sent SIGQUIT (one of its processes failed) and named no rank"


def install(read_log) -> None:
    """Replace SGLang's running-phase SIGQUIT handler (on the engine's event loop) with ours.
    `read_log()` returns what SGLang's processes wrote to the log since the engine started."""
    import asyncio

    from sglang.srt.utils import get_or_create_event_loop  # the loop the tokenizer manager registered on

    loop = get_or_create_event_loop()
    try:
        loop.remove_signal_handler(signal.SIGQUIT)
    except (RuntimeError, ValueError, asyncio.InvalidStateError):
        pass

    def on_quit(signum, frame):
        import time

        time.sleep(1.5)  # the watchdog's line (it polls every second) or the traceback reaches the log
        raise EngineSpent(crash_cause(read_log()))

    signal.signal(signal.SIGQUIT, on_quit)
