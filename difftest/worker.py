"""The process boundary between the harness and an engine.

Every engine runs in its own worker process, possibly under another interpreter (its
own environment), because real engines crash whole process trees and two versions of
one engine cannot share an environment. Protocol: JSON lines over two dedicated pipes
(request in, reply out); the worker's stdout/stderr go to a log file, so engine chatter
never corrupts the protocol. Captures travel as directories (difftest.capture).

    {"op": "hello", "spec": {...}, "target": "module:attr"} -> {"ok": true, "info": {...}}
    {"op": "capture", "case": {...}, "prompt_ids": [...], "out": DIR} -> {"ok": true}
    {"op": "speculate", "case": {...}, "prompts": [[...]], "num_steps": k, "max_new_tokens": n}
                                                   -> {"ok": true, "stats": {...}}
    {"op": "capture_draft_from", "case": {...}, "prompt_ids": [...], "fc_in": FILE, "out": DIR}
                                                   -> {"ok": true}   (golden inputs: FILE is a
                                                      safetensors file holding "draft.fc_in")
    {"op": "replay", "case": {...}, "requests": [[prompt, output], ...], "num_steps": k, "topk": t,
     "num_draft_tokens": n}                        -> {"ok": true, "replays": [...]}  (Engine.replay)
    {"op": "close"}                                -> {"ok": true}
Errors: {"ok": false, "kind": "unavailable" | "config" | "unsupported" | "engine" | "crash", "error": "one line"}.
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
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from difftest.errors import ConfigError, DifftestError, EngineError, EngineUnavailable, Unsupported

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def last_error_line(log_path: Path, max_bytes: int = 65536) -> str:
    """The most telling line of a log: the last exception line, else the last non-empty line."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - max_bytes))
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
        self.info: dict | None = None

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> dict:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        env = dict(os.environ, **self.extra_env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} start {self.spec.id} with {self.python}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(
                    [self.python, "-m", "difftest.worker", "--in-fd", str(req_r), "--out-fd", str(rep_w)],
                    pass_fds=(req_r, rep_w),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # its own process group: killed as a whole
                )
            except OSError as e:
                os.close(req_r), os.close(req_w), os.close(rep_r), os.close(rep_w)
                raise EngineUnavailable(f"{self.spec.id}: cannot start interpreter {self.python}: {e.strerror}") from None
        os.close(req_r)
        os.close(rep_w)
        self._w = os.fdopen(req_w, "w")
        self._r = os.fdopen(rep_r, "r")
        reply = self.request({"op": "hello", "spec": self.spec.to_dict(), "target": self.target})
        self.info = reply["info"]
        return self.info

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                self.request({"op": "close"}, timeout=30)
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
    def request(self, msg: dict, timeout: float | None = None) -> dict:
        assert self.proc is not None, "worker not started"
        timeout = self.timeout if timeout is None else timeout
        try:
            self._w.write(json.dumps(msg) + "\n")
            self._w.flush()
        except BrokenPipeError:
            raise self._died() from None
        ready, _, _ = select.select([self._r], [], [], timeout)
        if not ready:
            self.kill()
            raise EngineError(f"{self.spec.id}: no answer to {msg['op']!r} within {timeout:.0f}s; worker killed; log: {self.log_path}")
        line = self._r.readline()
        if not line:
            raise self._died()
        reply = json.loads(line)
        if reply.get("ok"):
            return reply
        kind, error = reply.get("kind"), reply.get("error", "unknown error")
        if kind == "unavailable":
            raise EngineUnavailable(error)
        if kind == "config":
            raise ConfigError(error)
        if kind == "unsupported":
            raise Unsupported(error)
        raise EngineError(f"{self.spec.id}: {error} (log: {self.log_path})")

    def _died(self) -> EngineError:
        rc = self.proc.wait()
        why = last_error_line(self.log_path)
        return EngineError(f"{self.spec.id}: worker died (exit {rc}){': ' + why if why else ''}; log: {self.log_path}")


# ---------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------


def _load_engine(target: str, spec_dict: dict):
    from difftest.engine import EngineSpec

    module, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise EngineUnavailable(f"{spec_dict['name']}: adapter {target} cannot be imported here ({e})") from None
    return cls(EngineSpec.from_dict(spec_dict))


def _handle(engine, msg: dict) -> dict:
    from difftest.case import Case

    op = msg["op"]
    if op == "capture":
        capture = engine.capture(Case.from_dict(msg["case"]), list(msg["prompt_ids"]))
        capture.save(msg["out"])
        return {}
    if op == "speculate":
        stats = engine.speculate(Case.from_dict(msg["case"]), msg["prompts"], msg["num_steps"], msg["max_new_tokens"])
        return {"stats": stats.to_dict()}
    if op == "capture_draft_from":
        from safetensors.torch import load_file

        fc_in = load_file(msg["fc_in"])["draft.fc_in"]
        capture = engine.capture_draft_from(Case.from_dict(msg["case"]), list(msg["prompt_ids"]), fc_in)
        capture.save(msg["out"])
        return {}
    if op == "replay":
        pairs = [(list(p), list(o)) for p, o in msg["requests"]]
        return {"replays": engine.replay(Case.from_dict(msg["case"]), pairs, msg["num_steps"], msg["topk"],
                                         msg["num_draft_tokens"])}  # fmt: skip
    raise ConfigError(f"worker: unknown op {op!r}")


def serve(in_fd: int, out_fd: int) -> int:
    rfile, wfile = os.fdopen(in_fd, "r"), os.fdopen(out_fd, "w")
    engine = None

    def reply(obj: dict) -> None:
        wfile.write(json.dumps(obj) + "\n")
        wfile.flush()

    for line in rfile:
        msg = json.loads(line)
        print(f"[difftest.worker] {time.strftime('%H:%M:%S')} request {msg['op']}", file=sys.stderr, flush=True)
        try:
            if msg["op"] == "hello":
                engine = _load_engine(msg["target"], msg["spec"])
                reply({"ok": True, "info": asdict(engine.info())})
            elif msg["op"] == "close":
                if engine is not None:
                    engine.close()
                reply({"ok": True})
                return 0
            else:
                reply({"ok": True, **_handle(engine, msg)})
        except EngineUnavailable as e:
            reply({"ok": False, "kind": "unavailable", "error": str(e)})
        except NotImplementedError as e:
            reply({"ok": False, "kind": "unsupported", "error": str(e) or f"{msg['op']} is not supported"})
        except ConfigError as e:
            reply({"ok": False, "kind": "config", "error": str(e)})
        except DifftestError as e:
            reply({"ok": False, "kind": "engine", "error": str(e)})
        except Exception as e:  # an engine bug: full traceback to the log, one line to the harness
            traceback.print_exc()
            sys.stderr.flush()
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            reply({"ok": False, "kind": "crash", "error": f"{type(e).__name__}: {first}"})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="difftest engine worker (started by the harness)")
    ap.add_argument("--in-fd", type=int, required=True)
    ap.add_argument("--out-fd", type=int, required=True)
    args = ap.parse_args(argv)
    return serve(args.in_fd, args.out_fd)


if __name__ == "__main__":
    sys.exit(main())
