"""Config lint: each finding on a copy of a tiny draft checkpoint edited to show it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from difftest.checks.lint import lint_draft as _lint_draft
from helpers import edited_copy, edited_draft

TRAINED = ["target.h.1", "target.h.2", "target.h.3"]  # the tiny draft's config ids [1, 2, 3], read as vLLM does


TINY_PAIR_LAYERS = 8  # the conftest `models` fixture builds the tiny pair this deep


def lint_draft(*args):
    """Findings other than the engine readings of the ids (tested on their own below)."""
    return [f for f in _lint_draft(*args) if f.code != "layer-ids-training"]


def codes(findings) -> list[tuple[str, str]]:
    return [(f.code, f.severity) for f in findings]


def test_clean_checkpoint_has_no_findings(models):
    assert lint_draft(models[1], models[0], TRAINED) == []


def drop_ids(cfg):
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    cfg.pop("eagle_config")


def test_missing_layer_ids_mean_a_silent_fallback(models, tmp_path):
    draft = edited_draft(models, tmp_path, config=drop_ids)
    [f] = lint_draft(draft, models[0], TRAINED)
    assert (f.code, f.severity) == ("layer-ids-missing", "error")
    assert f.message == (
        "no eagle_aux_hidden_state_layer_ids: engines fall back to h[2], h[L//2], h[L-3] = [h2, h4, h5] "
        "(L=8), not what the draft was trained on (h.1, h.2, h.3)"
    )


def test_missing_layer_ids_on_a_shallow_target_name_the_fallback_narrower_than_fc_in_each_engine(models, tmp_path):
    """L = 4: [2, L//2, L-3] = [2, 2, 1] reaches fc as two layers in both engines (layer order, each
    once), not the three chunks fc expects: each engine's reading says so (difftest.rules.layer_rules)."""

    def first_four_layers(t):  # the target cut to 4 layers, config and weights alike
        for k in [k for k in t if k.startswith(tuple(f"model.layers.{i}." for i in range(4, 8)))]:
            t.pop(k)

    shallow = edited_copy(
        models[0], tmp_path / "target", config=lambda cfg: cfg.update(num_hidden_layers=4), tensors=first_four_layers
    )
    draft = edited_draft(models, tmp_path, config=drop_ids)
    [f] = lint_draft(draft, shallow, TRAINED)
    assert f.code == "layer-ids-missing"
    for engine in ("vLLM 0.32.0 Model Runner V2", "SGLang 0.5.23"):  # vLLM: the runner 0.32.0 runs by default
        assert (f"{engine} (Llama rule: ids from") in f.message
    assert (
        f.message.count(
            "falls back to [2, L//2, L-3] = [2, 2, 1], feeding [h1, h2]; then fails: fc expects 3 "
            "chunks but the engine captures 2"
        )
        == 2
    )


def test_missing_layer_ids_are_only_a_warning_when_training_used_the_defaults(models, tmp_path):
    draft = edited_draft(models, tmp_path, config=drop_ids)
    assert codes(lint_draft(draft, models[0], ["target.h.2", "target.h.4", "target.h.5"])) == [
        ("layer-ids-missing", "warning")
    ]


def test_unsorted_ids_are_flagged(models, tmp_path):
    def unsorted(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [3, 1, 2]

    [f] = lint_draft(edited_draft(models, tmp_path, config=unsorted), models[0], TRAINED)
    assert (f.code, f.severity) == ("layer-ids-order", "error")
    assert (
        "vLLM and SGLang both capture while walking the layers and feed fc in layer order, each layer once ([1, 2, 3]"
        in f.message
    )


def test_conflicting_id_locations_are_flagged(models, tmp_path):
    def conflict(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]

    assert codes(lint_draft(edited_draft(models, tmp_path, config=conflict), models[0], TRAINED)) == [
        ("layer-ids-conflict", "error")
    ]


def test_absent_norm_flag_warns_about_the_format_default(models, tmp_path):
    [f] = lint_draft(edited_draft(models, tmp_path, config=lambda c: c.pop("norm_before_residual")), models[0], TRAINED)
    assert (f.code, f.severity) == ("norm-flag-default", "warning")
    assert f.message.startswith(
        "norm_before_residual absent: HF/EAGLE format defaults it to False, the other format to True"
    )


def test_fc_width_must_match_the_number_of_ids(models, tmp_path):
    def four_ids(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3, 4]

    [f] = lint_draft(edited_draft(models, tmp_path, config=four_ids), models[0], TRAINED)
    assert (f.code, str(f)) == (
        "fc-width",
        "error [fc-width]: fc in_features 192 != 4 ids x target hidden size 64 = 256",
    )


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.pop("d2t"),
            "d2t absent while draft vocab 256 < target vocab 512: draft ids map to the first target ids (vLLM and SGLang read draft id i as target id i)",
        ),
        (lambda t: t.__setitem__("t2d", torch.zeros(512, dtype=torch.bool)), "t2d.sum() = 0 != draft vocab 256"),
        (lambda t: t["d2t"].__setitem__(255, 400), "arange + d2t leaves the target vocab [0, 512) for 1 draft ids"),
        (lambda t: t["d2t"].__setitem__(1, -1), "arange + d2t maps 1 draft ids onto taken target ids"),
    ],
    ids=["d2t-missing", "t2d-sum", "out-of-range", "not-unique"],
)
def test_vocab_map_problems(models, tmp_path, edit, message):
    f = lint_draft(edited_draft(models, tmp_path, tensors=edit), models[0], TRAINED)[0]
    assert (f.code, f.severity, f.message) == ("vocab-map", "error", message)


def test_sglang_topk_1_forces_the_draft_token_budget(models):
    engines = {"sglang": {"speculative_eagle_topk": 1, "speculative_num_steps": 3, "speculative_num_draft_tokens": 8}}
    [f] = lint_draft(models[1], models[0], TRAINED, engines)
    assert str(f) == (
        "warning [sglang-topk]: engines.sglang: speculative_eagle_topk == 1 forces num_draft_tokens = "
        "num_steps + 1 = 4; the configured 8 is silently ignored"
    )


def test_engine_readings_of_the_ids_are_checked_against_training(models):
    [f] = _lint_draft(models[1], models[0], TRAINED)
    assert (f.code, f.severity) == ("layer-ids-training", "warning")
    assert f.message == (
        "trained on [h1, h2, h3]; other engines read ids [1, 2, 3] differently: SGLang 0.5.23 (Llama "
        "rule: ids from eagle_config, layer order, k -> h[k+1]) turns [1, 2, 3] (eagle_config) into "
        "[h2, h3, h4]; the draft was trained on [h1, h2, h3]; fix: {'eagle_config': "
        "{'eagle_aux_hidden_state_layer_ids': [0, 1, 2]}} (`difftest fix CASE --engines sglang` writes "
        "and verifies it); SpecForge's data generation reads them as [h2, h3, h4]"
    )


def deepseek_target(models, tmp_path: Path) -> Path:
    """The tiny target's config relabelled as DeepSeek-V3: only the class matters to the id rules."""
    out = tmp_path / "target"
    shutil.copytree(models[0], out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"])
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_sglang_reading_follows_the_deepseek_rule_for_a_deepseek_target(models, tmp_path):
    """SGLang's DeepSeek model adds 1 only when the first id is 1: ids [2, 3, 4] are read as is."""

    def ids_2_3_4(cfg):
        cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 3, 4]

    draft = edited_draft(models, tmp_path, config=ids_2_3_4)
    trained = ["target.h.2", "target.h.3", "target.h.4"]
    [f] = _lint_draft(draft, deepseek_target(models, tmp_path), trained)
    assert (
        f.message
        == "trained on [h2, h3, h4]; other engines read ids [2, 3, 4] differently: SpecForge's data generation reads them as [h3, h4, h5]"
    )
    [llama] = _lint_draft(draft, models[0], trained)
    assert (
        "(Llama rule: ids from eagle_config, layer order, k -> h[k+1]) turns [2, 3, 4] (eagle_config) into [h3, h4, h5]"
        in llama.message
    )


def test_ids_only_at_the_top_level_warn_that_sglang_falls_back(models, tmp_path):
    draft = edited_draft(models, tmp_path, config=lambda cfg: cfg.pop("eagle_config"))
    [f] = lint_draft(draft, models[0], TRAINED)
    assert str(f) == (
        "warning [layer-ids-sglang-location]: eagle_aux_hidden_state_layer_ids [1, 2, 3] only at the top "
        "level: SGLang 0.5.23 reads only eagle_config.eagle_aux_hidden_state_layer_ids and silently falls "
        "back to its default layers; write the ids in both places"
    )


def test_norm_before_residual_in_an_mla_draft_warns_that_sglang_ignores_it(models, tmp_path):
    def mla(cfg):
        cfg.update(architectures=["Eagle3DeepseekV2ForCausalLM"], kv_lora_rank=512, norm_before_residual=True)

    [f] = lint_draft(edited_draft(models, tmp_path, config=mla), models[0], TRAINED)
    assert (f.code, f.severity) == ("norm-flag-ignored", "warning")
    assert "SGLang 0.5.23's kimi_k25_eagle3.py ignores it" in f.message


def test_ids_that_do_not_name_the_trained_layers_are_an_error(models):
    """The seed's bug: trained on [h0, h1, h2] (embedding first), the config says [1, 2, 3]."""
    f = _lint_draft(models[1], models[0], ["target.h.0", "target.h.1", "target.h.2"])[0]
    assert str(f) == (
        "error [layer-ids-training]: vLLM 0.32.0 Model Runner V2 (Llama rule: ids from top level then "
        "eagle_config.layer_ids, layer order, k -> h[k]) turns [1, 2, 3] (top level) into [h1, h2, h3]; the draft "
        "was trained on "
        "[h0, h1, h2]; fix: {'eagle_aux_hidden_state_layer_ids': [0, 1, 2]} (`difftest fix CASE --engines "
        "vllm` writes and verifies it)"
    )


def _nested_only(cfg):  # the ids [1, 2, 3] only where vLLM's Model Runner V1 and SGLang read them
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]


def test_ids_only_in_eagle_config_are_an_error_for_the_runner_vllm_runs_by_default(models, tmp_path):
    draft = edited_draft(models, tmp_path, config=_nested_only)
    [error] = [f for f in _lint_draft(draft, models[0], TRAINED) if f.severity == "error"]
    assert error.code == "layer-ids-training" and "vLLM 0.32.0 Model Runner V2" in error.message
    assert "ignores eagle_config.eagle_aux_hidden_state_layer_ids [1, 2, 3]" in error.message


def test_a_run_on_runner_v1_still_hears_of_the_default_runner_misreading_the_ids(models, tmp_path):
    # Model Runner V1 reads eagle_config's ids; the lint still names V2, which a spec without parameters runs
    draft = edited_draft(models, tmp_path, config=_nested_only)
    errors = [
        f for f in _lint_draft(draft, models[0], TRAINED, None, [("vllm", {"runner": "v1"})]) if f.severity == "error"
    ]
    assert ["Model Runner V2" in f.message for f in errors] == [True]
    assert not any("Model Runner V1" in f.message for f in errors)
