"""How SGLang's scheduler and detokenizer processes start: from a forkserver that has SGLang imported.

`sglang.Engine` (srt/entrypoints/engine.py::_set_envs_and_config, verified on 0.5.16-0.5.23) forces
multiprocessing's "spawn" start method, so every engine start, one per case, runs two fresh
interpreters that import SGLang, torch and transformers before loading a tiny model: about 10 s of
CPU each on the CI machines, most of an engine start and the largest single cost of the suite's SGLang
runs (20 starts in one run of the shipped cases).

"forkserver" keeps spawn's semantics for what matters here: each child is a fresh fork of a clean,
single-threaded server process (never of this worker, whose torch thread pools and platform override
it must not inherit), it receives its arguments pickled, and `sys.path`/the working directory are
sent with every start. The server is started on first use, with this worker's environment at that
moment (the adapter sets every variable it needs before its first engine: caches, TMPDIR, the CPU shim
on PYTHONPATH; SGLang sets the same ones again before every start), and it imports SGLang's scheduler
and detokenizer modules once. An import that fails there is skipped by multiprocessing and simply
happens in the child, as under spawn.

`Engine.shutdown` (same file) kills every descendant of this process with
srt/utils/common.py::kill_process_tree, the forkserver too, which would make the next case import
everything again; `keeping_forkserver` passes the server's pid as that function's own `skip_pid`, so
the engine's processes (the server's children) still go and the server stays for the next case. It
ends with this worker: it exits when the worker's end of its pipe closes.

`DIFFTEST_SGLANG_START=spawn` keeps SGLang's own start method.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Iterator

from difftest.api import EngineUnavailable

ENV = "DIFFTEST_SGLANG_START"
METHODS = ("forkserver", "spawn")
# what the scheduler and detokenizer processes import first (their process entry points' modules), then
# frozen_heap, last: it freezes what the server then holds, so that no child's collector walks it (measured on
# a tiny Llama case: the engine's rebuild 3.2-3.8 -> 1.7-1.9 s, each later capture 0.55-0.8 -> 0.11-0.15 s)
PRELOAD = [
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "difftest_engines.sglang.frozen_heap",
]


def method() -> str:
    chosen = os.environ.get(ENV, "forkserver")
    if chosen not in METHODS:
        raise EngineUnavailable(f"{ENV}={chosen!r}: expected one of {', '.join(METHODS)}")
    return chosen


@contextlib.contextmanager
def engine_start() -> Iterator[None]:
    """Around `sglang.Engine(...)`: SGLang's request for "spawn" becomes "forkserver"."""
    if method() == "spawn":
        yield
        return
    multiprocessing.set_forkserver_preload(PRELOAD)
    real = multiprocessing.set_start_method

    def redirected(name: str | None, force: bool = False) -> None:
        real("forkserver" if name == "spawn" else name, force=force)

    multiprocessing.set_start_method = redirected
    try:
        yield
    finally:
        multiprocessing.set_start_method = real


def describe() -> str:
    """For a capture's metadata: how this engine's processes started."""
    if method() == "spawn":
        return "spawn (SGLang's own)"
    pid = _forkserver_pid()
    return f"forkserver pid {pid}" if pid is not None else "forkserver (not started)"


def _forkserver_pid() -> int | None:
    # multiprocessing keeps the running server's pid on its module-level ForkServer (CPython 3.11)
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_pid", None)


@contextlib.contextmanager
def keeping_forkserver() -> Iterator[None]:
    """Around `engine.shutdown()`: SGLang's kill of this process's descendants spares the forkserver."""
    pid = _forkserver_pid()
    engine_module = importlib.import_module("sglang.srt.entrypoints.engine")
    real = getattr(engine_module, "kill_process_tree", None)
    if pid is None or real is None:
        yield
        return

    def sparing(parent_pid, include_parent=True, skip_pid=None, **kwargs):
        return real(parent_pid, include_parent=include_parent, skip_pid=pid if skip_pid is None else skip_pid, **kwargs)

    engine_module.kill_process_tree = sparing
    try:
        yield
    finally:
        engine_module.kill_process_tree = real


def restart_forkserver() -> None:
    """Stop a running forkserver: the next engine start brings up a fresh one with this worker's
    environment as it is now (a forkserver's children inherit the server's environment, not ours)."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if _forkserver_pid() is not None and hasattr(server, "_stop"):
        server._stop()  # CPython 3.8+: closes its pipe and waits for it
