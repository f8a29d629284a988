"""The failure catalogue's static rules: each fault, made on a copy of an independent tiny draft,
is named with the engine that mishandles it and the first tensor it changes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from difftest.rules.draft_rules import ENGINES, engine_reading, flag_locations
from difftest.checks.lint import lint_draft
from helpers import edited_draft, make_tiny_pair

TRAINED = ["target.h.1", "target.h.2", "target.h.3"]


@pytest.fixture(scope="module", params=[0, 3], ids=["seed0", "seed3"])
def seeded_models(request, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny pair at two seeds, 7 layers deep: each rule must hold on two independent random drafts
    (conftest's `models` is one pair per module)."""
    return make_tiny_pair(tmp_path_factory.mktemp("models"), num_layers=7, seed=request.param)


def findings(seeded_models, draft, code: str):
    return [f for f in lint_draft(draft, seeded_models[0], TRAINED) if f.code == code]


def test_the_untouched_draft_raises_no_catalogue_finding(seeded_models):
    catalogue = {
        "flag-ignored",
        "lm-head-missing",
        "draft-weights",
        "embedding-substituted",
        "rope-conflict",
        "rope-dropped",
        "d2t-convention",
        "checkpoint-format",
    }
    assert [f for f in lint_draft(seeded_models[1], seeded_models[0], TRAINED) if f.code in catalogue] == []


def test_norm_before_residual_is_named_as_ignored_by_sglang_only(seeded_models, tmp_path):
    draft = edited_draft(seeded_models, tmp_path, config=lambda c: c.update(norm_before_residual=True))
    [f] = findings(seeded_models, draft, "flag-ignored")
    assert f.severity == "error" and f.engines == ("sglang",)
    assert "norm_before_residual" in f.message and "LlamaDecoderLayer.forward" in f.message
    assert f.tensor == "draft.layer0.mlp_out"


def test_fc_norm_inside_eagle_config_is_missed_by_both_engines(seeded_models, tmp_path):
    draft = edited_draft(seeded_models, tmp_path, config=lambda c: c["eagle_config"].update(fc_norm=True))
    found = findings(seeded_models, draft, "flag-ignored")
    assert sorted(f.engines[0] for f in found) == ["sglang", "vllm"]
    assert all("reads it only from top level" in f.message and f.tensor == "draft.fc_out" for f in found)


def test_norm_before_fc_inside_eagle_config_is_read_by_both_engines(seeded_models, tmp_path):
    draft = edited_draft(seeded_models, tmp_path, config=lambda c: c["eagle_config"].update(norm_before_fc=True))
    assert findings(seeded_models, draft, "flag-ignored") == []


def test_use_aux_norm_is_an_sglang_alias_that_vllm_never_reads(seeded_models, tmp_path):
    draft = edited_draft(seeded_models, tmp_path, config=lambda c: c.update(use_aux_norm=True))
    [f] = findings(seeded_models, draft, "flag-ignored")
    assert f.engines == ("vllm",) and "never reads it" in f.message


def test_missing_lm_head_names_what_each_engine_substitutes(seeded_models, tmp_path):
    draft = edited_draft(seeded_models, tmp_path, tensors=lambda t: t.pop("lm_head.weight"))
    [f] = findings(seeded_models, draft, "lm-head-missing")
    assert f.severity == "error" and f.tensor == "draft.logits"
    assert "target's lm_head" in f.message and "random initialisation" in f.message


def test_missing_layer_tensor_is_listed(seeded_models, tmp_path):
    draft = edited_draft(seeded_models, tmp_path, tensors=lambda t: t.pop("midlayer.hidden_norm.weight"))
    [f] = findings(seeded_models, draft, "draft-weights")
    assert f.severity == "error" and "midlayer.hidden_norm.weight" in f.message


def test_renamed_weights_are_missing_and_unexpected(seeded_models, tmp_path):
    def rename(t):
        t["model.fc_proj.weight"] = t.pop("fc.weight")

    draft = edited_draft(seeded_models, tmp_path, tensors=rename)
    found = findings(seeded_models, draft, "draft-weights")
    assert {(f.severity, "fc.weight" in f.message or "fc_proj" in f.message) for f in found} == {
        ("error", True),
        ("warning", True),
    }


def test_a_retrained_embedding_is_named_as_replaced_by_sglang(seeded_models, tmp_path):
    draft = edited_draft(
        seeded_models,
        tmp_path,
        tensors=lambda t: t.update({"embed_tokens.weight": torch.randn_like(t["embed_tokens.weight"])}),
    )
    [f] = findings(seeded_models, draft, "embedding-substituted")
    assert f.engines == ("sglang",) and f.tensor == "draft.embeds" and "set_embed" in f.message


def test_an_embedding_equal_to_the_targets_raises_nothing(seeded_models, tmp_path):
    assert findings(seeded_models, seeded_models[1], "embedding-substituted") == []


def test_the_targets_embedding_saved_in_bfloat16_raises_nothing(seeded_models, tmp_path):
    # speculators saves its checkpoints in bf16: a float32 target's frozen embedding comes back rounded
    draft = edited_draft(
        seeded_models,
        tmp_path,
        tensors=lambda t: t.update({"embed_tokens.weight": t["embed_tokens.weight"].to(torch.bfloat16)}),
    )
    assert findings(seeded_models, draft, "embedding-substituted") == []


def test_a_retrained_embedding_saved_in_bfloat16_is_still_named(seeded_models, tmp_path):
    def retrain(t):
        t["embed_tokens.weight"] = (t["embed_tokens.weight"] * 1.05).to(torch.bfloat16)

    draft = edited_draft(seeded_models, tmp_path, tensors=retrain)
    assert [f.code for f in findings(seeded_models, draft, "embedding-substituted")] == ["embedding-substituted"]


def test_a_draft_without_embedding_gets_only_a_warning(seeded_models, tmp_path):
    draft = edited_draft(seeded_models, tmp_path, tensors=lambda t: t.pop("embed_tokens.weight"))
    [f] = findings(seeded_models, draft, "embedding-shared")
    assert f.severity == "warning"


def _absolute_d2t(t):
    t["d2t"] = t["d2t"] + torch.arange(t["d2t"].numel())


def test_absolute_d2t_is_recognised_through_t2d(seeded_models, tmp_path):
    draft = edited_draft(seeded_models, tmp_path, tensors=_absolute_d2t)
    [f] = findings(seeded_models, draft, "d2t-convention")
    assert f.tensor == "draft.logits_target" and "absolute target ids" in f.message
    assert findings(seeded_models, draft, "vocab-map") == []  # one cause, not a pile of symptoms


def test_absolute_d2t_is_recognised_without_t2d(seeded_models, tmp_path):
    def absolute_without_t2d(t):
        # a sparse hot-token set, so offsets read from absolute ids leave the vocabulary
        t["d2t"] = torch.arange(t["d2t"].numel()) * 2 + 1 - torch.arange(t["d2t"].numel())
        _absolute_d2t(t)
        t.pop("t2d")

    draft = edited_draft(seeded_models, tmp_path, tensors=absolute_without_t2d)
    assert [f.code for f in findings(seeded_models, draft, "d2t-convention")] == ["d2t-convention"]


def test_offset_d2t_is_not_mistaken_for_absolute(seeded_models, tmp_path):
    def sparse_offsets(t):
        n = t["d2t"].numel()
        targets = torch.arange(n) * 2
        t["d2t"] = targets - torch.arange(n)
        t2d = torch.zeros(512, dtype=torch.bool)
        t2d[targets] = True
        t["t2d"] = t2d

    draft = edited_draft(seeded_models, tmp_path, tensors=sparse_offsets)
    assert findings(seeded_models, draft, "d2t-convention") == []


def test_conflicting_rope_fields_are_an_error(seeded_models, tmp_path):
    def conflict(c):
        c["rope_theta"] = 500000.0
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}

    draft = edited_draft(seeded_models, tmp_path, config=conflict)
    [f] = findings(seeded_models, draft, "rope-conflict")
    assert "500000" in f.message and "10000" in f.message and f.tensor == "draft.layer0.attn_out"


def test_rope_dropped_by_a_converter_is_named_against_the_targets(seeded_models, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(seeded_models[0], target)
    tcfg = json.loads((target / "config.json").read_text())
    tcfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    tcfg.pop("rope_theta", None)
    (target / "config.json").write_text(json.dumps(tcfg))

    def drop(c):
        c.pop("rope_theta", None)
        c.pop("rope_parameters", None)

    draft = edited_draft(seeded_models, tmp_path, config=drop)
    [f] = [f for f in lint_draft(draft, target, TRAINED) if f.code == "rope-dropped"]
    assert "500000" in f.message and "theta 10000" in f.message


def test_every_flag_rule_cites_the_engine_source():
    for rules in ENGINES.values():
        assert rules.version and all(r.source.startswith(("vllm/", "sglang/")) for r in rules.flags)


def test_engine_reading_follows_the_rule_table():
    raw = {"norm_output": True, "eagle_config": {"norm_before_fc": True}}
    located = flag_locations(raw)
    assert engine_reading(ENGINES["vllm"], "norm_before_fc", located["norm_before_fc"]) == (True, "eagle_config")
    assert engine_reading(ENGINES["sglang"], "norm_output", located["norm_output"]) == (True, "top level")
    assert engine_reading(ENGINES["sglang"], "norm_before_residual", {"top level": True}) == (None, "never read")
