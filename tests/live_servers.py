"""Real SGLang and vLLM HTTP servers for the live-server tests, on 127.0.0.1 with a free port.

Each server runs in its own process group (its scheduler, detokenizer and engine-core children
included), waits for /health with a bounded timeout, and is stopped by signalling the whole
group: SIGTERM, then SIGKILL; `stop` returns only once no process of the group is left.
"""

from __future__ import annotations

import ctypes  # noqa: F401  (imported now, not after fork: set_parent_death_signal needs it in the child)
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from difftest.base.paths import cache_root
from difftest.run.worker import set_parent_death_signal

ROOT = Path(__file__).resolve().parent.parent
HEALTH_TIMEOUT = 600.0  # seconds: a server start on a loaded 2-core machine takes 60-90 s, more under load
SETUP = {"sglang": "scripts/setup-engine sglang", "vllm": "scripts/setup-engine vllm"}


def engine_python(kind: str) -> str:
    """The engine environment's interpreter; skip (fail under DIFFTEST_REQUIRE_ENGINES=1) when absent."""
    python = os.environ.get(f"DIFFTEST_PYTHON_{kind.upper()}") or str(cache_root() / "envs" / kind / "bin" / "python")
    if not Path(python).exists():
        why = f"{kind}'s environment is not set up ({python} missing); set it up with: {SETUP[kind]}"
        if os.environ.get("DIFFTEST_REQUIRE_ENGINES") == "1":
            pytest.fail(f"DIFFTEST_REQUIRE_ENGINES=1: {why}")
        pytest.skip(why)
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if fields[0] != "Z" and int(fields[2]) == pgid:
            out.append(int(entry.name))
    return out


@dataclass
class LiveServer:
    kind: str
    url: str
    proc: subprocess.Popen
    log: Path
    started_s: float  # seconds from launch to healthy

    def stop(self) -> list[int]:
        """Stop the whole process group; returns the processes left (none expected)."""
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 20.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and group_members(pgid):
                try:
                    self.proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
            if not group_members(pgid):
                break
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        return group_members(pgid)


def _die_with_the_tests() -> None:
    """In the server's process before exec: SIGTERM when the test process that started it dies (a killed
    test run must not leave servers behind; the server's own shutdown then ends its children)."""
    set_parent_death_signal(signal.SIGTERM)


def start(kind: str, args: list[str], log: Path, env: dict | None = None) -> LiveServer:
    """`python -m difftest_engines.KIND.serve ARGS --host 127.0.0.1 --port P` in the engine's environment."""
    python = engine_python(kind)
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env or {}))
    t0 = time.monotonic()
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [python, "-m", f"difftest_engines.{kind}.serve", *args, "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            preexec_fn=_die_with_the_tests,
        )
    server = LiveServer(kind, f"http://127.0.0.1:{port}", proc, log, 0.0)
    deadline = t0 + HEALTH_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            server.stop()
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            pytest.fail(
                f"{kind} server exited with {proc.returncode} before it was healthy; log {log}: " + " | ".join(tail)
            )
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
                if r.status == 200:
                    server.started_s = time.monotonic() - t0
                    with open(log, "a") as f:  # the start-up cost, for whoever sizes CI
                        f.write(f"\n[live_servers] {kind} healthy at {server.url} after {server.started_s:.1f}s\n")
                    return server
        except OSError:
            pass
        time.sleep(2)
    left = server.stop()
    pytest.fail(f"{kind} server not healthy within {HEALTH_TIMEOUT:.0f}s (log {log}); processes left: {left}")
