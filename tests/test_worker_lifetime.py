"""Engine workers die with the harness: a harness killed mid-capture (SIGKILL or SIGTERM) leaves
no worker, and no process the engine started, running on (difftest.run.worker: die_with_parent)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import ROOT, TESTS

# A harness in miniature: start a fake-engine worker, send it a capture that never ends, wait.
HARNESS = textwrap.dedent("""
    import sys
    from pathlib import Path
    from difftest.case.case import Case
    from difftest.run.engine import EngineSpec
    from difftest.run.protocol import CaptureRequest
    from difftest.run.worker import WorkerClient

    client = WorkerClient(EngineSpec("fake", params=(("mode", "spawn_hang"),)), "fake_engine:FakeEngine",
                          sys.argv[3], Path(sys.argv[1]), timeout=3600)
    client.start()
    print(client.proc.pid, flush=True)
    case = Case(name="x", path="x.yaml", target="t", draft="d")
    client.request(CaptureRequest(case, [1, 2], sys.argv[2]))
""")


def alive(pid: int) -> bool:
    """Running (a zombie that no init reaps counts as gone: it holds nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    return True


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def forking_wrapper(directory: Path) -> Path:
    """An --engine-python that runs Python as its child instead of exec'ing it: the worker's
    parent is then the wrapper, so only the watchdog on the reply pipe can tell the harness died."""
    wrapper = directory / "python-wrapper"
    wrapper.write_text(f'#!/bin/sh\n"{sys.executable}" "$@"\nexit $?\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.parametrize(
    "sig,wrapped",
    [(signal.SIGKILL, False), (signal.SIGTERM, False), (signal.SIGKILL, True)],
    ids=["SIGKILL", "SIGTERM", "SIGKILL-through-a-forking-wrapper"],
)
def test_worker_and_its_children_exit_when_the_harness_is_killed_mid_capture(tmp_path, sig, wrapped):
    log = tmp_path / "worker.log"
    python = str(forking_wrapper(tmp_path)) if wrapped else sys.executable
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    harness = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(log), str(tmp_path / "out"), python],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = child = None
    try:
        worker = int(harness.stdout.readline())
        assert wait_for(lambda: "child pid" in (log.read_text() if log.exists() else ""), 120), log.read_text()
        child = int(re.search(r"child pid (\d+)", log.read_text()).group(1))
        assert alive(worker) and alive(child)
        harness.send_signal(sig)
        harness.wait(timeout=30)
        assert wait_for(lambda: not alive(worker), 5), f"worker {worker} outlived the harness ({sig.name})"
        assert wait_for(lambda: not alive(child), 5), f"the engine's child {child} outlived the harness ({sig.name})"
    finally:
        for pid in (child, worker):  # never leave them behind, whatever the assertion said
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
        if harness.poll() is None:
            harness.kill()
        harness.wait()


def test_the_reply_pipe_tells_the_worker_once_its_reader_is_gone():
    from difftest.run.worker import harness_gone

    r, w = os.pipe()
    try:
        assert not harness_gone(w, os.getppid())
        os.close(r)
        assert harness_gone(w, os.getppid())
    finally:
        os.close(w)


def test_a_changed_parent_pid_tells_the_worker_the_harness_is_gone():
    from difftest.run.worker import harness_gone

    r, w = os.pipe()
    try:
        assert harness_gone(w, os.getppid() + 1)
    finally:
        os.close(r), os.close(w)
