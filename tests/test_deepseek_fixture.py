"""The built-in tiny DeepSeek-V3 target and its EAGLE-3 draft (difftest_fixtures/deepseek.py), the
reference engine's capture of it, and cases/tiny_deepseek_v3.yaml run as a user runs it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from difftest.case.case import load_case
from difftest.run.engine import parse_spec
from difftest_fixtures import drafts, targets
from difftest_fixtures import deepseek as ds
from difftest_engines.ref.engine import RefEngine
from difftest_engines.ref.target import load_target
from helpers import ROOT, run_pytest

PROMPT = [891, 70, 110, 661, 839, 922, 208, 804, 661, 662, 267]  # the case's first prompt
L = ds.LAYERS


@pytest.fixture(scope="module")
def paths() -> dict[str, Path]:
    return ds.ensure_fixtures()


@pytest.fixture(scope="module")
def target(paths):
    return load_target(paths[ds.TARGET])


@pytest.fixture(scope="module")
def quality(paths) -> dict:
    return json.loads((paths[ds.DRAFT] / "quality.json").read_text())


def raw_config(paths, name: str) -> dict:
    return json.loads((paths[name] / "config.json").read_text())


# -- the checkpoints carry what the engines read --------------------------------------------------


def test_target_config_has_the_mla_head_size_vllm_cpu_supports(paths):
    c = raw_config(paths, ds.TARGET)
    assert c["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (c["kv_lora_rank"], c["qk_rope_head_dim"], c["q_lora_rank"]) == (512, 64, 64)
    assert c["kv_lora_rank"] + c["qk_rope_head_dim"] == 576
    assert (c["qk_nope_head_dim"], c["v_head_dim"], c["num_attention_heads"], c["num_hidden_layers"]) == (32, 32, 4, 6)


def test_target_config_has_kimi_style_moe_routing_and_moe_layer_freq(paths):
    c = raw_config(paths, ds.TARGET)
    assert c["moe_layer_freq"] == 1
    assert (c["n_routed_experts"], c["num_experts_per_tok"], c["n_shared_experts"], c["first_k_dense_replace"]) == (
        8,
        2,
        1,
        1,
    )
    assert (c["topk_method"], c["scoring_func"], c["n_group"], c["topk_group"]) == ("noaux_tc", "sigmoid", 2, 1)
    assert c["routed_scaling_factor"] == 2.5
    assert c["num_nextn_predict_layers"] == 0


def test_target_config_has_yarn_rope(paths):
    assert raw_config(paths, ds.TARGET)["rope_parameters"] == {  # DeepSeek-V3's YaRN, scaled down
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


def test_target_checkpoint_has_per_expert_weights_and_the_correction_bias(paths):
    with safe_open(str(paths[ds.TARGET] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for e in range(8):
        assert f"model.layers.1.mlp.experts.{e}.gate_proj.weight" in keys
        assert f"model.layers.5.mlp.experts.{e}.down_proj.weight" in keys
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys  # layer 0 is dense


def test_target_directory_has_a_tokenizer_with_the_fixture_vocab(paths):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(paths[ds.TARGET], local_files_only=True)
    assert len(tok) == 1024
    assert tok.decode(tok("<s> " + targets.make_words(3)[2])["input_ids"]) == "<s> " + targets.make_words(3)[2]


def test_draft_config_has_ids_2_4_5_at_top_level_and_in_eagle_config(paths):
    c = raw_config(paths, ds.DRAFT)
    assert c["architectures"] == ["LlamaForCausalLMEagle3"]
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert (c["draft_vocab_size"], c["vocab_size"], c["target_hidden_size"]) == (512, 1024, 128)
    with safe_open(str(paths[ds.DRAFT] / "model.safetensors"), "pt") as f:
        assert tuple(f.get_tensor("d2t").shape) == (512,)
        assert tuple(f.get_tensor("t2d").shape) == (1024,)
        assert tuple(f.get_tensor("fc.weight").shape) == (128, 3 * 128)


# -- the reference engine's capture is HF's residual stream, by value -------------------------------


@pytest.fixture(scope="module")
def captured(paths, tmp_path_factory):
    d = tmp_path_factory.mktemp("case")
    path = d / "ds.yaml"
    path.write_text(
        f"target: {paths[ds.TARGET]}\ndraft: {paths[ds.DRAFT]}\ndtype: float32\nwiring: vllm\n"
        f"prompts: [{{ids: {PROMPT}}}]\nspeculative: {{num_steps: 3, max_new_tokens: 8}}\n"
    )
    return RefEngine(parse_spec("ref")).capture(load_case(path), PROMPT)


@pytest.fixture(scope="module")
def hf(target):
    """An independent HF forward: output_hidden_states plus hooks on every decoder layer's input and
    the last layer's output."""
    inputs: dict[int, torch.Tensor] = {}
    handles = [
        layer.register_forward_pre_hook(
            lambda _m, args, kwargs, k=k: inputs.__setitem__(
                k, (kwargs.get("hidden_states", args[0] if args else None))
            ),
            with_kwargs=True,
        )
        for k, layer in enumerate(target.model.layers)
    ]
    handles.append(
        target.model.layers[-1].register_forward_hook(
            lambda _m, _a, out: inputs.__setitem__(L, out[0] if isinstance(out, tuple) else out)
        )
    )
    try:
        with torch.no_grad():
            out = target(input_ids=torch.tensor([PROMPT]), output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return out, inputs


def test_ref_capture_h_k_equals_hf_hidden_states_k_for_k_below_L(captured, hf):
    out, _ = hf
    assert len(out.hidden_states) == L + 1
    for k in range(L):
        assert torch.equal(captured.tensors[f"target.h.{k}"], out.hidden_states[k][0]), k


def test_ref_capture_h_k_is_the_residual_entering_decoder_layer_k(captured, hf):
    _, entering = hf
    for k in range(L):
        assert torch.equal(captured.tensors[f"target.h.{k}"], entering[k][0]), k


def test_ref_capture_h_L_is_the_last_layer_output_before_the_final_norm(captured, hf):
    out, entering = hf
    assert torch.equal(captured.tensors[f"target.h.{L}"], entering[L][0])
    assert not torch.allclose(captured.tensors[f"target.h.{L}"], out.hidden_states[L][0])


def test_ref_capture_final_norm_equals_hf_hidden_states_L(captured, hf):
    out, _ = hf
    assert torch.equal(captured.tensors["target.final_norm"], out.hidden_states[L][0])


def test_final_norm_is_rmsnorm_of_h_L_with_the_final_norm_weight(captured, target):
    h = captured.tensors[f"target.h.{L}"].double()
    norm = target.model.norm
    expected = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.double()
    torch.testing.assert_close(captured.tensors["target.final_norm"].double(), expected, atol=1e-6, rtol=1e-6)


def test_ref_capture_logits_equal_hf_logits(captured, hf):
    out, _ = hf
    assert torch.equal(captured.tensors["target.logits"], out.logits[0])


def test_ref_capture_feeds_fc_with_h2_h4_h5(captured):
    fc = captured.tensors["draft.fc_in"]
    expected = torch.cat([captured.tensors[f"target.h.{k}"] for k in (2, 4, 5)], dim=-1)
    assert torch.equal(fc, expected)


# -- the target is a meaningful one ---------------------------------------------------------------


def test_residual_norms_grow_with_depth_from_the_unit_embedding(captured):
    norms = [float(captured.tensors[f"target.h.{k}"].norm(dim=-1).mean()) for k in range(L + 1)]
    assert norms[0] == pytest.approx(2**0.5, rel=1e-5)  # a unit token vector plus the constant coordinate
    assert all(b > a * 1.2 for a, b in zip(norms, norms[1:]))


def test_router_picks_different_experts_for_different_tokens(target):
    picked: list[torch.Tensor] = []
    gate = target.model.layers[1].mlp.gate
    handle = gate.register_forward_hook(lambda _m, _a, out: picked.append(out[2]))
    try:
        with torch.no_grad():
            target(input_ids=torch.tensor([PROMPT]))
    finally:
        handle.remove()
    chosen = {tuple(sorted(row.tolist())) for row in picked[0]}
    assert len(chosen) >= 3


def test_quality_json_target_context_dependence_is_above_0_9(quality):
    assert quality["target_context_dependence"] > 0.9


# -- the draft: good under its wiring, collapsed when shifted ----------------------------------------


def test_quality_json_step0_agreement_under_h2_h4_h5_is_above_0_8(quality):
    assert quality["train_wiring"] == ds.GOOD_WIRING
    assert quality["config_layer_ids"] == [2, 4, 5]
    assert quality["step0_agreement"] > 0.8


def test_quality_json_accept_length_with_4_draft_steps_is_above_3(quality):
    assert quality["simulation"]["num_draft_steps"] == 4
    assert quality["accept_length"] > 3.0


def test_quality_json_shows_collapse_under_h3_h5_h6(quality):
    shifted = quality["served_off_by_one"]
    assert shifted["wiring"] == ["target.h.3", "target.h.5", "target.h.6"]
    assert shifted["step0_agreement"] < 0.2
    assert shifted["accept_length"] < 1.5


def test_step0_agreement_recomputed_on_heldout_matches_quality_json(paths, target, quality):
    from difftest_engines.ref.draft_loading import load_draft
    from difftest_engines.ref.train import prepare_data, step0_agreement

    draft = load_draft(paths[ds.DRAFT]).model
    heldout = drafts.heldout_sequences(target)
    agreement = step0_agreement(draft, prepare_data(target, ds.GOOD_WIRING, heldout))
    assert agreement == pytest.approx(quality["step0_agreement"], abs=0.01)


# -- determinism ----------------------------------------------------------------------------------


def test_rebuilt_target_has_the_checksum_recorded_at_build(paths):
    recorded = json.loads((paths[ds.TARGET] / "fixture.json").read_text())["weights_sha256"]
    assert ds.weights_checksum(ds.build_deepseek_target()) == recorded


def test_saved_target_loads_to_the_recorded_weights(paths, target):
    recorded = json.loads((paths[ds.TARGET] / "fixture.json").read_text())["weights_sha256"]
    assert ds.weights_checksum(target) == recorded


def test_unknown_fixture_names_are_not_resolved_by_this_provider():
    assert ds.resolve_fixture("tiny-llama") is None
    with pytest.raises(KeyError, match="unknown fixture 'tiny-gpt'"):
        ds.fixture_path("tiny-gpt")


# -- cases/tiny_deepseek_v3.yaml ----------------------------------------------------------------------


CASE = "tiny_deepseek_v3"
CHECKS = ("fc_inputs", "draft_logits", "top1_agreement", "accept_length")


def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("project")
    (root / "cases").mkdir()
    shutil.copy(ROOT / "cases" / f"{CASE}.yaml", root / "cases")
    return root


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    return run_pytest(project(tmp_path_factory), f"cases/{CASE}.yaml", "--engines=ref,ref[wiring=vllm]")


@pytest.fixture(scope="module")
def sglang_deepseek_run(tmp_path_factory):
    return run_pytest(project(tmp_path_factory), f"cases/{CASE}.yaml", "--engines=ref,ref[wiring=sglang-deepseek]")


@pytest.fixture(scope="module")
def sglang_llama_run(tmp_path_factory):
    # SGLang's Llama rule and what it would feed if h6 were reachable, in one run.
    return run_pytest(
        project(tmp_path_factory), f"cases/{CASE}.yaml", "--engines=ref,ref[wiring=sglang],ref[wiring=h3+h5+h6]"
    )


def test_case_passes_every_check_with_vllm_wiring(vllm_run):
    assert vllm_run.returncode == 0, vllm_run.output[-3000:]
    for check in CHECKS:
        assert vllm_run.outcome(CASE, "ref[wiring=vllm]", check).outcome == "passed", check


def test_case_passes_every_check_with_sglang_deepseek_wiring(sglang_deepseek_run):
    assert sglang_deepseek_run.returncode == 0, sglang_deepseek_run.output[-3000:]
    for check in CHECKS:
        assert sglang_deepseek_run.outcome(CASE, "ref[wiring=sglang-deepseek]", check).outcome == "passed", check


def test_case_with_sglang_llama_wiring_names_the_unreachable_last_layer(sglang_llama_run):
    # the draft config names a layer this engine's rule cannot reach: a configuration error (exit 6), which
    # outranks the shifted wiring's regression (exit 1) in the same run (difftest/base/exit_codes.py)
    assert sglang_llama_run.returncode == 6
    for check in CHECKS:
        result = sglang_llama_run.outcome(CASE, "ref[wiring=sglang]", check)
        assert result.outcome == "error", check
        assert result.message == (
            "sglang convention: SGLang 0.5.23 (Llama rule: ids from eagle_config, layer order, "
            "k -> h[k+1]) turns [2, 4, 5] (eagle_config) into [h3, h5]; [h6] cannot be captured "
            "and are dropped: fewer fc chunks than ids, a shape error in the engine"
        )


def test_case_with_shifted_wiring_names_off_by_one_and_the_collapse(sglang_llama_run):
    fc = sglang_llama_run.outcome(CASE, "ref[wiring=h3+h5+h6]", "fc_inputs")
    assert fc.outcome == "failed"
    assert "engine fed fc [h3, h5, h6]; reference fed [h2, h4, h5]; pattern: off-by-one +1" in fc.message
    accept = sglang_llama_run.outcome(CASE, "ref[wiring=h3+h5+h6]", "accept_length")
    assert accept.outcome == "failed"
    assert accept.message.startswith("accept length collapsed")
    assert accept.data.engine.accept_length < 1.5
