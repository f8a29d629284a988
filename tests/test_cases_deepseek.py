"""The DeepSeek-V3 layer-id convention cases (cases/tiny_deepseek_v3_*.yaml): one draft trained on
[h2, h4, h5], three configs, and what each engine makes of them, with the exact diagnosis.

Only the fc_inputs items run (`-k fc_inputs`): the diagnosis is there, and the speculative
simulations of the other items are not needed for it. The engine conventions come from the
reference's wiring presets (no engine needed); the two refusals that only a real adapter
makes (vLLM's DeepSeek model and id 0; SGLang's default-layer fallback) are read from the one
real run of the user's command over every shipped case, and skip without the engines' environments.
"""

from __future__ import annotations

import shutil

import pytest
from helpers import ROOT, run_pytest
from shipped_run import shipped_or_skip

CASES = ("tiny_deepseek_v3_first_id_1", "tiny_deepseek_v3_id0", "tiny_deepseek_v3_toplevel_ids")


def _project(tmp_path_factory, names):
    root = tmp_path_factory.mktemp("project")
    (root / "cases").mkdir()
    for name in names:
        shutil.copy(ROOT / "cases" / f"{name}.yaml", root / "cases" / f"{name}.yaml")
    return root


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    root = _project(tmp_path_factory, CASES[:2])
    return run_pytest(root, "cases/", "--engines=ref,ref[wiring=vllm],ref[wiring=sglang-deepseek]", "-k", "fc_inputs")


@pytest.fixture(scope="module")
def refusals():
    """The real adapters' refusals, from the one real run of the user's command over every shipped
    case (tests/shipped_run.py)."""
    return shipped_or_skip()


def test_first_id_1_vllm_feeds_h1_h3_h4_named_off_by_one_and_sglang_deepseek_feeds_training(presets):
    result = presets.outcome("tiny_deepseek_v3_first_id_1", "ref[wiring=vllm]", "fc_inputs")
    assert result.outcome == "failed"
    assert "engine's fc chunk 0 matches reference target.h.1 (cos 1.0000); expected target.h.2" in result.message
    assert "engine fed fc [h1, h3, h4]; reference fed [h2, h4, h5]; pattern: off-by-one -1" in result.message
    sglang = presets.outcome("tiny_deepseek_v3_first_id_1", "ref[wiring=sglang-deepseek]", "fc_inputs")
    assert sglang.outcome == "passed", sglang.message


def test_id0_sglang_deepseek_feeds_the_embedding_named_and_vllm_refuses_it(presets, refusals):
    result = presets.outcome("tiny_deepseek_v3_id0", "ref[wiring=sglang-deepseek]", "fc_inputs")
    assert result.outcome == "failed"
    assert (
        "engine's fc chunk 0 matches reference target.h.0 (the embedding) (cos 1.0000); expected target.h.2"
        in result.message
    )
    assert (
        "engine fed fc [h0, h2, h4]; reference fed [h2, h4, h5]; pattern: embedding fed but not trained on"
        in result.message
    )
    vllm = refusals.outcome("tiny_deepseek_v3_id0", "vllm", "fc_inputs")
    assert vllm.outcome == "xfailed"  # the refusal the case declares
    assert "vllm 0.32.0 cannot feed aux layer id 0 of " in vllm.message
    assert (
        "(eagle_aux_hidden_state_layer_ids [0, 2, 4]): vLLM reads id k as target.h.k, and id 0 is the embedding "
        "(target.h.0), which its DeepseekV3ForCausalLM cannot capture"
    ) in vllm.message
    assert "(hidden_states + residual with no residual yet: TypeError at the first forward)" in vllm.message


def test_toplevel_ids_sglang_falls_back_to_default_layers_named(refusals):
    result = refusals.outcome("tiny_deepseek_v3_toplevel_ids", "sglang", "fc_inputs")
    assert result.outcome == "xfailed"  # the refusal the case declares
    assert "SGLang would feed layers_to_capture [2, 3, 3] (default-layer fallback) for " in result.message
    assert (
        "finds no ids (eagle_config) and falls back to [2, L//2, L-3] = [2, 3, 3], feeding [h2, h3]; top-level "
        "eagle_aux_hidden_state_layer_ids [2, 4, 5] ignored), captures only 2 of 3 aux hidden states (a repeated "
        "layer is captured once) and its scheduler dies"
    ) in result.message
