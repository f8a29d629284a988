"""How the SGLang adapter starts SGLang's processes (difftest_engines/sglang/process_start.py): SGLang asks for
"spawn" and kills every descendant at shutdown; the adapter turns the first into a forkserver that has
SGLang imported and spares that server from the second, so each case's engine start skips the imports.

These specify the redirection on multiprocessing itself and on a stand-in for SGLang's engine module;
tests/test_engine_sglang.py checks on the real engine that every start in one worker used one server."""

from __future__ import annotations

import multiprocessing
import sys
import types

import pytest

from difftest.base.errors import EngineUnavailable
from difftest_engines.sglang import process_start


def test_sglangs_request_for_spawn_becomes_forkserver_while_an_engine_starts(monkeypatch):
    asked = []
    monkeypatch.setattr(multiprocessing, "set_start_method", lambda name, force=False: asked.append((name, force)))
    monkeypatch.setattr(
        multiprocessing, "set_forkserver_preload", lambda modules: asked.append(("preload", tuple(modules)))
    )
    with process_start.engine_start():
        multiprocessing.set_start_method("spawn", force=True)
    assert asked == [("preload", tuple(process_start.PRELOAD)), ("forkserver", True)]


def test_the_start_method_function_is_restored_after_the_engine_starts():
    before = multiprocessing.set_start_method
    with pytest.raises(RuntimeError, match="engine failed"):
        with process_start.engine_start():
            assert multiprocessing.set_start_method is not before
            raise RuntimeError("engine failed")
    assert multiprocessing.set_start_method is before


def test_spawn_setting_leaves_sglangs_own_start_method(monkeypatch):
    monkeypatch.setenv(process_start.ENV, "spawn")
    before = multiprocessing.set_start_method
    with process_start.engine_start():
        assert multiprocessing.set_start_method is before
    assert process_start.describe() == "spawn (SGLang's own)"


def test_an_unknown_start_setting_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv(process_start.ENV, "fork")
    with pytest.raises(EngineUnavailable, match=r"DIFFTEST_SGLANG_START='fork': expected one of forkserver, spawn"):
        process_start.method()


def _fake_sglang_engine_module(monkeypatch, calls: list) -> None:
    def kill_process_tree(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
        calls.append({"parent": parent_pid, "include_parent": include_parent, "skip_pid": skip_pid})

    module = types.ModuleType("sglang.srt.entrypoints.engine")
    module.kill_process_tree = kill_process_tree
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.engine", module)


def test_shutdown_spares_the_forkserver_and_kills_the_rest(monkeypatch):
    calls: list = []
    _fake_sglang_engine_module(monkeypatch, calls)
    monkeypatch.setattr(process_start, "_forkserver_pid", lambda: 4242)
    with process_start.keeping_forkserver():
        sys.modules["sglang.srt.entrypoints.engine"].kill_process_tree(100, include_parent=False, wait_timeout=60)
    assert calls == [{"parent": 100, "include_parent": False, "skip_pid": 4242}]
    real = sys.modules["sglang.srt.entrypoints.engine"].kill_process_tree
    real(1)  # restored: the unwrapped function skips nothing
    assert calls[-1]["skip_pid"] is None


def test_shutdown_without_a_forkserver_kills_as_sglang_does(monkeypatch):
    calls: list = []
    _fake_sglang_engine_module(monkeypatch, calls)
    monkeypatch.setattr(process_start, "_forkserver_pid", lambda: None)
    with process_start.keeping_forkserver():
        sys.modules["sglang.srt.entrypoints.engine"].kill_process_tree(100, include_parent=False)
    assert calls == [{"parent": 100, "include_parent": False, "skip_pid": None}]


def _write_parent_pid(path: str) -> None:
    import os

    with open(path, "w") as f:
        f.write(str(os.getppid()))


def test_the_forkserver_found_is_the_parent_of_the_processes_it_starts(tmp_path):
    out = tmp_path / "ppid"
    p = multiprocessing.get_context("forkserver").Process(target=_write_parent_pid, args=(str(out),))
    p.start()
    p.join()
    assert process_start._forkserver_pid() == int(out.read_text())
