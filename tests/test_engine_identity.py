"""A run whose every result is cached starts no engine: the version its cache keys name is what the
engine's worker said when it last started in the same environment (difftest.run.engine_identity), and
anything the worker's answer follows from (what is installed, the harness's code, the engines'
environment variables) names another environment."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import TINY_CASE, make_tiny_pair

from difftest.run import engine_identity
from difftest.records.capture import Capture
from difftest.case.case import load_case
from difftest.run.engine import EngineSpec
from difftest.base.errors import EngineError
from difftest.records.engine_info import EngineInfo
from difftest.run.case_run import CaseRun
from difftest.run.pool import EnginePool, Options
from difftest.base.paths import import_root

PROJECT_ROOT = import_root()

REF = EngineSpec("ref")


@pytest.fixture(scope="module")
def case_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("identity")
    target, draft = make_tiny_pair(root / "models")
    path = root / "tiny.yaml"
    path.write_text(TINY_CASE.format(target=target, draft=draft))
    return path


@pytest.fixture
def private_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@dataclass
class Run:
    started: bool  # a worker started
    info: EngineInfo | None
    capture: Capture
    pool: EnginePool


def run_capture(case_path: Path, log_dir: Path, use_cache: bool = True, index: int = 0) -> Run:
    pool = EnginePool(Options(engines=[REF], reference=REF, log_dir=log_dir, use_cache=use_cache))
    try:
        capture = CaseRun(pool, load_case(str(case_path))).capture(REF, index)
        return Run(pool.started(REF), pool.engine_info(REF), capture, pool)
    finally:
        pool.close()


def ident(env: dict[str, str], root: Path = PROJECT_ROOT) -> str | None:
    return engine_identity.identity(REF.to_dict(), "difftest_engines.ref.engine:RefEngine", sys.executable, env, root)


def test_a_fully_cached_run_starts_no_worker_and_reads_the_same_capture(case_path, private_cache, tmp_path):
    first, second = run_capture(case_path, tmp_path / "logs"), run_capture(case_path, tmp_path / "logs")
    assert first.started and not second.started
    assert second.info == first.info
    captured, cached = first.capture.tensors, second.capture.tensors
    assert sorted(cached) == sorted(captured) and all((cached[n] == captured[n]).all() for n in captured)


def test_a_result_not_cached_starts_the_worker(case_path, private_cache, tmp_path):
    run_capture(case_path, tmp_path / "logs")
    assert run_capture(case_path, tmp_path / "logs", index=1).started  # another prompt: not captured yet


def test_without_the_capture_cache_the_worker_starts(case_path, private_cache, tmp_path):
    run_capture(case_path, tmp_path / "logs")
    assert run_capture(case_path, tmp_path / "logs", use_cache=False).started


def test_a_remembered_info_the_worker_contradicts_is_refused_naming_both_versions(case_path, private_cache, tmp_path):
    first = run_capture(case_path, tmp_path / "logs")
    ident_ = first.pool.identity(REF)
    stale = EngineInfo(name="ref", version="difftest-0.0.0-c0", versions={"torch": "0"}, kernels="torch")
    first.pool.infos.put(ident_, stale)
    with pytest.raises(EngineError, match=r"difftest-0\.0\.0-c0.*run again"):
        run_capture(case_path, tmp_path / "logs")  # keyed on the stale version: a miss, the worker starts
    assert first.pool.infos.get(ident_) == first.info  # the record is corrected


def test_another_installed_distribution_names_another_environment(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    env = {"PYTHONPATH": str(site)}
    before = ident(env)
    (site / "somepkg-1.0.dist-info").mkdir()
    after = ident(env)
    (site / "somepkg-1.0.dist-info").rename(site / "somepkg-1.1.dist-info")
    assert before is not None and len({before, after, ident(env)}) == 3


def test_an_engine_variable_names_another_environment_and_an_unrelated_one_does_not():
    base = {"PATH": "/usr/bin"}
    assert ident({**base, "DIFFTEST_SGLANG_KERNELS": "cpu-shim"}) != ident(base)
    assert ident({**base, "PYTEST_XDIST_WORKER": "gw1"}) == ident(base)


def test_the_harness_code_is_part_of_the_identity(tmp_path):
    for folder in ("difftest", "difftest_engines"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.py").write_text("x = 1\n")
    before = engine_identity.code_digest(tmp_path)
    engine_identity.code_digest.cache_clear()
    (tmp_path / "difftest_engines" / "a.py").write_text("x = 2\n")
    assert engine_identity.code_digest(tmp_path) != before
    engine_identity.code_digest.cache_clear()


def test_an_interpreter_that_does_not_answer_has_no_identity(tmp_path):
    env = {"PATH": "/usr/bin"}
    missing = engine_identity.identity(REF.to_dict(), "t", str(tmp_path / "no-python"), env, PROJECT_ROOT)
    assert missing is None


def test_a_live_servers_info_is_never_remembered(tmp_path):
    memo = engine_identity.InfoMemo(tmp_path)
    memo.put("a", EngineInfo(name="server", version="sglang 0.5", live=True))
    memo.put("b", EngineInfo(name="ref", version="1"))
    assert memo.get("a") is None and memo.get("b") == EngineInfo(name="ref", version="1")


def test_an_unreadable_record_is_not_remembered(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"name": "ref", "version": 3}))
    assert engine_identity.InfoMemo(tmp_path).get("a") is None
