"""The vLLM adapter on a DeepSeek-V3 target (MLA + MoE, the Kimi-K2 architecture) with an EAGLE-3 draft.

One `pytest cases/ --engines=ref,vllm` session over tiny random pairs built here
(tests/deepseek_helpers.py): a random pair (ids [2, 4, 5]), an always-right pair, and the random
pair with ids [0, 2, 4], which vLLM's DeepSeek model cannot run. Needs vLLM's environment
(`scripts/setup-engine vllm`): skipped with that command without it, failed under
DIFFTEST_REQUIRE_ENGINES=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepseek_helpers import hf_greedy, make_deepseek_pair
from helpers import COUNTERS_CASE, run_pytest
from test_engine_vllm import vllm_python

K = 3
PROMPTS = [[1, 5, 9, 33, 77, 101, 7], [4, 8, 15, 16, 23, 42]]
MAX_NEW = 24
ID0 = "engines:\n  vllm:\n    draft_config_overrides:\n      eagle_aux_hidden_state_layer_ids: [0, 2, 4]\n      eagle_config: {eagle_aux_hidden_state_layer_ids: [0, 2, 4]}\n"


@pytest.fixture(scope="module")
def vllm_deepseek_run(tmp_path_factory):
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm_deepseek")
    (root / "cases").mkdir()
    rand_t, rand_d = make_deepseek_pair(root / "models" / "random", [2, 4, 5])
    right_t, right_d = make_deepseek_pair(root / "models" / "right", [2, 4, 5], degenerate="right")
    for name, (t, d, extra) in {
        "random": (rand_t, rand_d, ""),
        "always_right": (right_t, right_d, ""),
        "id0": (rand_t, rand_d, ID0),
    }.items():
        (root / "cases" / f"{name}.yaml").write_text(COUNTERS_CASE.format(target=t, draft=d, k=K, extra=extra))
    cache = tmp_path_factory.mktemp("cache")  # captures (with their meta) land here
    result = run_pytest(
        root,
        "cases/",
        f"--engine-python=vllm={python}",
        "--engines=ref,vllm",
        "--no-capture-cache",
        "--engine-timeout=300",
        env={"DIFFTEST_CACHE": str(cache)},
        timeout=900,
    )
    result.cache = cache
    result.models = {"random": rand_t}
    return result


def _vllm_metas(cache: Path) -> list[dict]:
    metas = [json.loads(p.read_text())["meta"] for p in (cache / "captures").rglob("manifest.json")]
    return [m for m in metas if m.get("engine") == "vllm" and not m.get("golden_fc_in")]


def test_deepseek_greedy_tokens_match_hf(vllm_deepseek_run):
    engine = vllm_deepseek_run.outcome("random", "vllm", "accept_length").data.engine
    assert engine.outputs == hf_greedy(vllm_deepseek_run.models["random"], PROMPTS, MAX_NEW), vllm_deepseek_run.output[
        -3000:
    ]


def test_deepseek_target_layers_and_fc_in_match_the_reference_by_value(vllm_deepseek_run):
    for check in ("fc_inputs", "draft_logits"):
        result = vllm_deepseek_run.outcome("random", "vllm", check)
        assert result.outcome == "passed", f"{check}: {result.message}"
    for prompt in vllm_deepseek_run.report("random").comparisons["vllm"]:
        by_name = {t.name: t for t in prompt.tensors}
        # eager vLLM records every layer's residual stream: h0 (embedding) .. h6 (pre-norm output)
        assert sorted(n for n in by_name if n.startswith("target.h.")) == [f"target.h.{k}" for k in range(7)]
        for name in [f"target.h.{k}" for k in range(7)] + ["draft.fc_in", "draft.fc_in.0", "draft.fc_in.2"]:
            assert by_name[name].status == "ok", by_name[name]
            assert by_name[name].max_abs < 1e-4, by_name[name]


def test_deepseek_always_right_draft_accepts_k_plus_1(vllm_deepseek_run):
    result = vllm_deepseek_run.outcome("always_right", "vllm", "accept_length")
    engine = result.data.engine
    assert engine.num_verify > 0
    assert engine.accept_length == pytest.approx(K + 1), engine
    assert engine.acceptance_rate_per_pos == [1.0] * K
    assert result.outcome == "passed", result.message


def test_deepseek_compat_measures_are_recorded_in_capture_meta(vllm_deepseek_run):
    from difftest_engines.vllm import compat

    metas = _vllm_metas(vllm_deepseek_run.cache)
    golden = [json.loads(p.read_text())["meta"] for p in (vllm_deepseek_run.cache / "captures").rglob("manifest.json")]
    assert any(m.get("golden_fc_in") for m in golden)  # the passing draft_logits' golden re-runs, told apart
    assert len(metas) == 2  # one capture prompt x (random, always_right); id0 never started
    measures = ([compat.CPU_MLA] if torch.cpu._is_amx_tile_supported() else []) + [compat.BLOCK_16]
    for meta in metas:
        assert meta["compat"] == [compat.DESCRIPTIONS[m] for m in measures]


def test_deepseek_aux_id_0_is_refused_naming_vllms_convention(vllm_deepseek_run):
    result = vllm_deepseek_run.outcome("id0", "vllm", "fc_inputs")
    assert result.outcome == "error"
    message = result.message
    assert "cannot feed aux layer id 0" in message and "eagle_aux_hidden_state_layer_ids [0, 2, 4]" in message
    assert "vLLM reads id k as target.h.k, and id 0 is the embedding (target.h.0)" in message
    assert "\n" not in message
