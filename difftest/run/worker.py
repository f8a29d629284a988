"""The process boundary between the harness and an engine.

Every engine runs in its own worker process, possibly under another interpreter (its
own environment), because real engines crash whole process trees and two versions of
one engine cannot share an environment. Protocol: JSON lines over two dedicated pipes
(request in, reply out); the worker's stdout/stderr go to a log file, so engine chatter
never corrupts the protocol. Captures travel as directories (difftest.records.capture).
The messages are typed records (difftest.run.protocol: Hello, CaptureRequest, SpeculateRequest,
CaptureDraftFromRequest, ReplayRequest, Close, and their replies), each with its wire form:

    {"op": "hello", "spec": {...}, "target": "module:attr"} -> {"ok": true, "info": {...}}
    {"op": "capture", "case": {...}, "prompt_ids": [...], "out": DIR} -> {"ok": true, "timings": [...]}
    {"op": "speculate", "case": {...}, "prompts": [[...]], "num_steps": k, "max_new_tokens": n}
                                                   -> {"ok": true, "stats": {...}}
    {"op": "capture_draft_from", "case": {...}, "prompt_ids": [...], "fc_in": FILE, "out": DIR}
                                                   -> {"ok": true}   (golden inputs: FILE is a
                                                      safetensors file holding "draft.fc_in")
    {"op": "replay", "case": {...}, "requests": [[prompt, output], ...], "num_steps": k, "topk": t,
     "num_draft_tokens": n}                        -> {"ok": true, "replays": [...]}  (Engine.replay)
    {"op": "close"}                                -> {"ok": true}
Replies to the requests after hello carry "timings": the phases the worker measured
(difftest.records.timings.WorkerPhase: the engine's work, the capture file's writing).
Errors: {"ok": false, "kind": "unavailable" | "config" | "unsupported" | "engine" | "crash", "error": "one line"},
with "ends": true when the worker exits after that reply (errors.EngineSpent).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, TypeVar
import ctypes

from difftest.base.errors import ConfigError, DifftestError, EngineError, EngineSpent, EngineUnavailable, Unsupported
from difftest.base.names import FC_IN
from difftest.records.engine_info import EngineInfo
from difftest.run.engine import EngineSpec
from difftest.run.protocol import (
    CaptureDraftFromRequest,
    CaptureReply,
    CaptureRequest,
    Close,
    CloseReply,
    Failure,
    Hello,
    HelloReply,
    ReplayReply,
    ReplayRequest,
    Reply,
    Request,
    SpeculateReply,
    SpeculateRequest,
)
from difftest.records.timings import WorkerPhase
from difftest.records.acceptance import AcceptStats
from difftest.records.capture import Capture
from difftest.base import tensorfile
from difftest.base.paths import import_root

# Starting a worker (a fresh interpreter importing torch and the engine) takes tens of seconds on
# a busy machine; a short --engine-timeout, meant for requests, must not fail the start.
MIN_START_TIMEOUT_S = 120.0
R = TypeVar("R")


def last_error_line(log_path: Path, max_bytes: int = 65536, start: int = 0) -> str:
    """The most telling line of a log from byte `start` on: the last exception line, else the last
    non-empty line."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(start, f.seek(0, 2) - max_bytes))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln or ln.startswith("error"):
            return ln[:500]
    return lines[-1][:500] if lines else ""


class WorkerClient:
    """Parent side: owns the worker process, its log, and every timeout."""

    def __init__(self, spec, target: str, python: str, log_path: Path, timeout: float, env: dict | None = None):
        self.spec, self.target, self.python, self.log_path, self.timeout = spec, target, python, Path(log_path), timeout
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None
        self.info: EngineInfo | None = None
        self.busy = False  # a request is in flight (an interrupted wait leaves it so)
        self.ended_with: str | None = None  # the error after which the worker ended itself (EngineSpent)
        self._log_start = 0

    # -- lifecycle -------------------------------------------------------------------
    def environment(self) -> dict[str, str]:
        """The worker process's environment: ours, its extra variables, the project importable."""
        env = dict(os.environ, **self.extra_env)
        # engine environments do not have difftest installed: the worker imports it from the import root
        # (a checkout, or links to the installed packages), found here, never in the worker itself
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(import_root()), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self) -> EngineInfo:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        env = self.environment()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} start {self.spec.id} with {self.python}\n".encode())
            log.flush()
            self._log_start = log.tell()  # this worker's own lines begin here (an earlier one's come before)
            try:
                self.proc = subprocess.Popen(
                    [
                        self.python,
                        "-m",
                        "difftest.run.worker",
                        "--in-fd",
                        str(req_r),
                        "--out-fd",
                        str(rep_w),
                        "--parent-pid",
                        str(os.getpid()),
                    ],
                    pass_fds=(req_r, rep_w),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # its own process group: killed as a whole
                )
            except OSError as e:
                for fd in (req_r, req_w, rep_r, rep_w):
                    os.close(fd)
                raise EngineUnavailable(
                    f"{self.spec.id}: cannot start interpreter {self.python}: {e.strerror}"
                ) from None
        os.close(req_r)
        os.close(rep_w)
        self._w = os.fdopen(req_w, "w")
        self._r = os.fdopen(rep_r, "r")
        reply = self.request(Hello(self.spec, self.target), timeout=max(self.timeout, MIN_START_TIMEOUT_S))
        self.info = reply.info
        return self.info

    @property
    def started_info(self) -> EngineInfo:
        """The engine's info once the worker has said hello."""
        if self.info is None:
            raise EngineError(f"{self.spec.id}: the engine worker has not started (log: {self.log_path})")
        return self.info

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None and not self.busy:  # a busy worker cannot answer a close
                self.request(Close(), timeout=30)
                self.proc.wait(timeout=10)
        except (DifftestError, OSError, subprocess.TimeoutExpired):
            pass  # falling through to the kill below is the fallback
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        for f in (getattr(self, "_w", None), getattr(self, "_r", None)):
            try:
                f and f.close()
            except OSError:
                pass

    # -- requests --------------------------------------------------------------------
    def request(self, msg: Request[R], timeout: float | None = None) -> R:
        """Send a typed request and return its typed reply (difftest.run.protocol); a failed request
        raises the error its reply names."""
        assert self.proc is not None, "worker not started"
        timeout = self.timeout if timeout is None else timeout
        if self.ended_with is not None:  # later items of the same case carry the cause, not "worker gone"
            raise EngineError(f"{self.ended_with} (earlier in this case; the worker ended after it)")
        if self.proc.poll() is not None and self.info is None:  # exited before hello: no earlier failure
            raise self._died()
        if self.proc.poll() is not None or self._w.closed:  # killed after a timeout, or crashed, earlier
            raise EngineError(
                f"{self.spec.id}: worker is no longer running (exit {self.proc.returncode}) after an "
                f"earlier failure; log: {self.log_path}"
            )
        self.busy = True
        try:
            self._w.write(json.dumps(msg.to_wire()) + "\n")
            self._w.flush()
        except BrokenPipeError:
            raise self._died() from None
        ready, _, _ = select.select([self._r], [], [], timeout)
        if not ready:
            self.kill()
            raise EngineError(
                f"{self.spec.id}: no answer to {msg.OP!r} within {timeout:.0f}s; worker killed; log: {self.log_path}"
            )
        line = self._r.readline()
        self.busy = False
        if not line:
            raise self._died()
        reply = msg.reply_from_wire(json.loads(line), self.spec.id)
        if not isinstance(reply, Failure):
            return reply
        kind, error = reply.kind, reply.error
        if reply.ends:
            self.ended_with = f"{self.spec.id}: {error} (log: {self.log_path})"
            self.kill()
        if kind == "unavailable":
            raise EngineUnavailable(error)
        if kind == "config":
            raise ConfigError(error)
        if kind == "unsupported":
            raise Unsupported(error)
        raise EngineError(f"{self.spec.id}: {error} (log: {self.log_path})")

    def _died(self) -> EngineError:
        if self.proc is None:
            return EngineError(f"{self.spec.id}: the engine worker never started (log: {self.log_path})")
        rc = self.proc.wait()
        why = last_error_line(self.log_path, start=self._log_start)
        if self.info is None:
            # it never answered hello: the interpreter itself (a wrong --engine-python, a broken
            # environment) is at fault, not an engine failure
            return EngineError(
                f"{self.spec.id}: the engine interpreter {self.python} exited (code {rc}) before "
                f"answering{': ' + why if why else ''}; log: {self.log_path}"
            )
        return EngineError(f"{self.spec.id}: worker died (exit {rc}){': ' + why if why else ''}; log: {self.log_path}")


# ---------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------


def _load_engine(target: str, spec: EngineSpec):
    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise EngineUnavailable(f"{spec.name}: adapter {target} cannot be imported here ({e})") from None
    return cls(spec)


def _returned(engine, method: str, value, expected: type):
    """An adapter's answer, checked: the wrong type is named in one line (the adapter's bug), not an
    AttributeError from deep inside the worker."""
    if not isinstance(value, expected):
        cls = type(engine)
        raise EngineError(
            f"adapter {cls.__module__}.{cls.__name__}.{method}() returned {type(value).__name__} "
            f"instead of a {expected.__name__}"
        )
    return value


def _timed(phases: list, name: str, fn, *args):
    """fn(*args), its time appended to `phases` (sent back in the reply: difftest.run.phase_clock)."""
    t = time.perf_counter()
    try:
        return fn(*args)
    finally:
        phases.append(WorkerPhase(name, time.perf_counter() - t))


def _save(phases: list, capture, out: str) -> None:
    _timed(phases, "transfer.write", capture.save, out)
    phases[-1].bytes = capture.nbytes


def _handle(engine, request: Request[Any]) -> Reply:
    """Run `request` on the engine: its typed fields become the adapter's arguments."""
    phases: list = []  # difftest.records.timings.WorkerPhase, measured here
    if isinstance(request, CaptureRequest):
        capture = _timed(phases, "engine.capture", engine.capture, request.case, list(request.prompt_ids))
        _save(phases, _returned(engine, "capture", capture, Capture), request.out)
        return CaptureReply(phases)
    if isinstance(request, SpeculateRequest):
        stats = _timed(
            phases,
            "engine.speculate",
            engine.speculate,
            request.case,
            request.prompts,
            request.num_steps,
            request.max_new_tokens,
        )
        return SpeculateReply(_returned(engine, "speculate", stats, AcceptStats), phases)
    if isinstance(request, CaptureDraftFromRequest):
        fc_in = _timed(phases, "transfer.read", tensorfile.read, request.fc_in)[FC_IN]
        capture = _timed(
            phases, "engine.capture", engine.capture_draft_from, request.case, list(request.prompt_ids), fc_in
        )
        capture = _returned(engine, "capture_draft_from", capture, Capture)
        # the draft tensors follow the given fc_in, not the engine's own hidden states: say so on disk
        capture.meta.golden_fc_in = True
        _save(phases, capture, request.out)
        return CaptureReply(phases)
    if isinstance(request, ReplayRequest):
        pairs = [(list(p), list(o)) for p, o in request.requests]
        replays = _timed(
            phases,
            "engine.replay",
            engine.replay,
            request.case,
            pairs,
            request.num_steps,
            request.topk,
            request.num_draft_tokens,
        )
        return ReplayReply(replays, phases)
    raise ConfigError(f"worker: unknown op {request.OP!r}")


def serve(in_fd: int, out_fd: int) -> int:
    rfile, wfile = os.fdopen(in_fd, "r"), os.fdopen(out_fd, "w")
    engine = None

    def reply(answer: Reply | Failure) -> None:
        wfile.write(json.dumps(answer.to_wire()) + "\n")
        wfile.flush()

    for line in rfile:
        msg = json.loads(line)
        op = msg.get("op") if isinstance(msg, dict) else None
        print(f"[difftest.run.worker] {time.strftime('%H:%M:%S')} request {op}", file=sys.stderr, flush=True)
        try:
            request = Request.from_wire(msg)
            if isinstance(request, Hello):
                engine = _load_engine(request.target, request.spec)
                reply(HelloReply(_returned(engine, "info", engine.info(), EngineInfo)))
            elif isinstance(request, Close):
                if engine is not None:
                    engine.close()
                reply(CloseReply())
                return 0
            else:
                reply(_handle(engine, request))
        except EngineUnavailable as e:
            reply(Failure("unavailable", str(e)))
        except NotImplementedError as e:
            reply(Failure("unsupported", str(e) or f"{op} is not supported"))
        except ConfigError as e:
            reply(Failure("config", str(e)))
        except EngineSpent as e:  # nothing more can run in this process: answer, then end it
            reply(Failure("engine", str(e), ends=True))
            if engine is not None:
                engine.close()
            return 1
        except DifftestError as e:
            reply(Failure("engine", str(e)))
        except Exception as e:  # an engine bug: full traceback to the log, one line to the harness
            traceback.print_exc()
            sys.stderr.flush()
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            reply(Failure("crash", f"{type(e).__name__}: {first}"))
    return 0


# -- dying with the harness ------------------------------------------------------------
# A worker must not outlive the harness that started it: a harness killed mid-capture
# (SIGTERM, SIGKILL, a closed terminal) would otherwise leave the worker, and the engine's own
# child processes, running until the request ends (up to --engine-timeout). Two mechanisms,
# because neither covers every case alone: the kernel's parent-death signal (Linux, immediate,
# but tied to the parent *process id*, which a wrapper script in --engine-python may change) and
# a watchdog thread on the reply pipe, whose reader is the harness: once nobody can read our
# replies there is nobody to work for (portable, and independent of who our parent is).

WATCH_INTERVAL_S = 0.2
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _kill_own_group() -> None:
    """End this worker and every process it started (the engine's schedulers, compilers...).
    The harness starts a worker in a session of its own (start_new_session), whose process group
    holds the worker, any wrapper script around its interpreter, and the engine's children; a
    worker run any other way (by hand, in a test) kills only itself, never a group it shares."""
    sys.stderr.flush()
    if os.getpgrp() == os.getsid(0):
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` when our parent exits (Linux prctl); False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def harness_gone(out_fd: int, parent_pid: int | None, timeout_s: float = 0.0) -> bool:
    """True once the reply pipe has no reader (the harness closed it or died), or our parent
    changed from the harness's pid (we were re-parented to init or a subreaper)."""
    if parent_pid is not None and os.getppid() != parent_pid:
        return True
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(out_fd, 0)  # no events asked: poll reports only POLLERR / POLLHUP
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(int(timeout_s * 1000)))
    time.sleep(timeout_s)
    return False


def die_with_parent(out_fd: int, parent_pid: int | None) -> None:
    """Install the parent-death signal, a SIGTERM handler and the pipe watchdog (see above)."""
    if parent_pid is not None and os.getppid() != parent_pid:
        parent_pid = None  # started through a wrapper that forked: only the pipe tells
    signal.signal(signal.SIGTERM, lambda *_: _kill_own_group())
    if parent_pid is not None:
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent_pid:  # the harness died before the prctl took effect
            _kill_own_group()

    def watch() -> None:
        while not harness_gone(out_fd, parent_pid, WATCH_INTERVAL_S):
            pass
        print(f"[difftest.run.worker] {time.strftime('%H:%M:%S')} harness gone; exiting", file=sys.stderr, flush=True)
        _kill_own_group()

    threading.Thread(target=watch, name="difftest-parent-watchdog", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="difftest engine worker (started by the harness)")
    ap.add_argument("--in-fd", type=int, required=True)
    ap.add_argument("--out-fd", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, default=None, help="the harness's pid: exit when it exits")
    args = ap.parse_args(argv)
    die_with_parent(args.out_fd, args.parent_pid)
    return serve(args.in_fd, args.out_fd)


if __name__ == "__main__":
    sys.exit(main())
