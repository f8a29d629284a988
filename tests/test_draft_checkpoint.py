"""Loading EAGLE-3 draft checkpoints: both formats, every norm flag, vocab maps, shared weights, bad input.

Checkpoints are written with difftest_engines/ref/train.py's save helpers from a seeded random
draft whose norm weights are non-trivial (so every norm flag changes the numbers), then
edited on disk to produce each variant.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftest.base.errors import ConfigError
from difftest_engines.ref.eagle3 import Eagle3Config, Eagle3Draft, parse_config
from difftest_engines.ref.draft_loading import load_draft
from difftest_engines.ref.train import save_eagle_format, save_speculators_format

H = 64
TARGET_H = 32  # != H, so fc's width is num_aux x target_hidden_size, not num_aux x H
NUM_AUX = 3
VOCAB = 256
LAYER_IDS = [1, 2, 3]
FLAGS = ("norm_before_fc", "fc_norm", "norm_before_residual", "norm_output")
WEIGHTS = "model.safetensors"


def make_config(draft_vocab_size: int = VOCAB, **flags) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=H,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=TARGET_H,
        num_aux=NUM_AUX,
        **flags,
    )


def make_draft(seed: int = 0, d2t: torch.Tensor | None = None, **cfg_kwargs) -> Eagle3Draft:
    """Seeded random draft; every norm weight drawn from U(0.5, 1.5) so no norm is the identity."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(make_config(**cfg_kwargs))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) + 0.5)
        if d2t is not None:
            draft.d2t.copy_(d2t)
    return draft.eval()


def set_config(model_dir: Path, **updates) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in updates.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def edit_weights(model_dir: Path, edit) -> None:
    weights = load_file(str(model_dir / WEIGHTS))
    edit(weights)
    save_file(weights, str(model_dir / WEIGHTS))


def run_two_steps(draft: Eagle3Draft, seed: int = 3):
    """Step 0 over a 6-token prompt, then one step on the last position; returns both DraftOutputs."""
    g = torch.Generator().manual_seed(seed)
    n = 6
    fc_in = torch.randn(1, n, NUM_AUX * TARGET_H, generator=g) * 3
    ids = torch.randint(0, VOCAB, (1, n), generator=g)
    next_id = torch.randint(0, VOCAB, (1, 1), generator=g)
    with torch.no_grad():
        out0 = draft(ids, draft.combine(fc_in), torch.arange(n)[None])
        out1 = draft(next_id, out0.hidden_next[:, -1:], torch.tensor([[n]]), cache=out0.cache)
    return out0, out1


# A draft with every norm module present (norm_before_fc and fc_norm own tensors), saved
# in HF/EAGLE format with all flags off; tests copy it and switch flags in config.json.
@pytest.fixture(scope="module")
def full_draft() -> Eagle3Draft:
    return make_draft(seed=0, norm_before_fc=True, fc_norm=True)


@pytest.fixture(scope="module")
def eagle_ckpt(full_draft, tmp_path_factory) -> Path:
    out = save_eagle_format(full_draft, tmp_path_factory.mktemp("eagle") / "draft", LAYER_IDS)
    set_config(out, **{f: False for f in FLAGS})
    return out


@pytest.fixture(scope="module")
def speculators_ckpt(full_draft, tmp_path_factory) -> Path:
    out = save_speculators_format(full_draft, tmp_path_factory.mktemp("spec") / "draft", LAYER_IDS)
    set_config(out, **{f: False for f in FLAGS})
    return out


@pytest.fixture
def eagle_copy(eagle_ckpt, tmp_path) -> Path:
    return Path(shutil.copytree(eagle_ckpt, tmp_path / "draft"))


@pytest.fixture
def speculators_copy(speculators_ckpt, tmp_path) -> Path:
    return Path(shutil.copytree(speculators_ckpt, tmp_path / "draft"))


# ---------------------------------------------------------------------------------------
# The two formats
# ---------------------------------------------------------------------------------------

FLAG_SETS = {
    "all-off": dict.fromkeys(FLAGS, False),
    "all-on": dict.fromkeys(FLAGS, True),
    "fc_norm+norm_output": {
        "norm_before_fc": False,
        "fc_norm": True,
        "norm_before_residual": False,
        "norm_output": True,
    },
    "norm_before_fc+norm_before_residual": {
        "norm_before_fc": True,
        "fc_norm": False,
        "norm_before_residual": True,
        "norm_output": False,
    },
}


@pytest.mark.parametrize("flags", FLAG_SETS.values(), ids=FLAG_SETS.keys())
def test_same_weights_in_both_formats_load_to_identical_logits(flags, tmp_path):
    draft = make_draft(seed=1, **flags)
    eagle = load_draft(save_eagle_format(draft, tmp_path / "eagle", LAYER_IDS))
    spec = load_draft(save_speculators_format(draft, tmp_path / "spec", LAYER_IDS))
    assert (eagle.config.format, spec.config.format) == ("eagle", "speculators")
    assert {f: getattr(eagle.config, f) for f in FLAGS} == flags
    assert {f: getattr(spec.config, f) for f in FLAGS} == flags
    (e0, e1), (s0, s1) = run_two_steps(eagle.model), run_two_steps(spec.model)
    assert torch.equal(e0.logits, s0.logits)
    assert torch.equal(e1.logits, s1.logits)
    reference0, _ = run_two_steps(draft)
    assert torch.equal(e0.logits, reference0.logits)


def test_speculators_format_reads_layer_keys_and_transformer_layer_config(speculators_ckpt):
    loaded = load_draft(speculators_ckpt)
    assert loaded.config.format == "speculators"
    assert (loaded.config.hidden_size, loaded.config.target_hidden_size, loaded.config.num_aux) == (
        H,
        TARGET_H,
        NUM_AUX,
    )
    assert loaded.config.layer_ids == LAYER_IDS


# ---------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------

LAYER = {"hidden_size": H, "num_attention_heads": 4, "vocab_size": VOCAB, "intermediate_size": 128}


def eagle_dict(**extra) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], **LAYER, **extra}


def speculators_dict(**extra) -> dict:
    return {"speculators_model_type": "eagle3", "transformer_layer_config": dict(LAYER), **extra}


@pytest.mark.parametrize(
    "raw, expected",
    [
        (eagle_dict(), False),
        (speculators_dict(), True),
        (eagle_dict(norm_before_residual=True), True),
        (speculators_dict(norm_before_residual=False), False),
    ],
    ids=["eagle-absent", "speculators-absent", "eagle-explicit-true", "speculators-explicit-false"],
)
def test_norm_before_residual_default_depends_on_format(raw, expected):
    assert parse_config(raw, Path("config.json")).norm_before_residual is expected


@pytest.mark.parametrize("make", [eagle_dict, speculators_dict], ids=["eagle", "speculators"])
def test_other_flags_default_to_false_in_both_formats(make):
    cfg = parse_config(make(), Path("config.json"))
    assert (cfg.norm_before_fc, cfg.fc_norm, cfg.norm_output) == (False, False, False)


def test_sglang_use_aux_norm_key_turns_on_fc_norm():
    assert parse_config(eagle_dict(use_aux_norm=True), Path("config.json")).fc_norm is True


def test_norm_before_fc_inside_eagle_config_is_read():
    raw = eagle_dict(eagle_config={"norm_before_fc": True})
    assert parse_config(raw, Path("config.json")).norm_before_fc is True


# what each flag must change, relative to the same checkpoint with every flag off
FLAG_EFFECTS = [
    ("norm_before_fc", "step0_logits"),
    ("fc_norm", "step0_logits"),
    ("norm_before_residual", "step0_logits"),
    ("norm_output", "hidden_next"),
]


@pytest.mark.parametrize("flag, changes", FLAG_EFFECTS, ids=[f for f, _ in FLAG_EFFECTS])
def test_each_flag_changes_the_draft_output(flag, changes, eagle_copy):
    base0, base1 = run_two_steps(load_draft(eagle_copy).model)
    set_config(eagle_copy, **{flag: True})
    loaded = load_draft(eagle_copy)
    assert getattr(loaded.config, flag) is True
    out0, out1 = run_two_steps(loaded.model)
    if changes == "step0_logits":
        assert not torch.allclose(out0.logits, base0.logits, atol=1e-3)
    else:  # norm_output: step 0 unchanged, the hidden handed on (and so step 1) changes
        assert torch.equal(out0.logits, base0.logits)
        assert torch.equal(out0.hidden_next, loaded.model.norm(out0.hidden_prenorm))
        assert not torch.allclose(out0.hidden_next, base0.hidden_next, atol=1e-3)
        assert not torch.allclose(out1.logits, base1.logits, atol=1e-3)


def test_without_norm_output_the_next_step_gets_the_prenorm_hidden(eagle_ckpt):
    out0, _ = run_two_steps(load_draft(eagle_ckpt).model)
    assert torch.equal(out0.hidden_next, out0.hidden_prenorm)


def test_tensors_of_a_disabled_flag_are_ignored_with_a_note(eagle_ckpt):
    notes = load_draft(eagle_ckpt).notes
    assert notes == [
        "ignored checkpoint tensors: fc_norm.0.weight, fc_norm.1.weight, fc_norm.2.weight, input_norm.weight"
    ]


# ---------------------------------------------------------------------------------------
# Layer ids
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, top, in_eagle_config, effective, num_aux",
    [
        (eagle_dict(eagle_aux_hidden_state_layer_ids=[1, 3, 5]), [1, 3, 5], None, [1, 3, 5], 3),
        (
            eagle_dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 4, 6]}),
            None,
            [0, 2, 4, 6],
            [0, 2, 4, 6],
            4,
        ),
        (
            eagle_dict(
                eagle_aux_hidden_state_layer_ids=[1, 3, 5], eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}
            ),
            [1, 3, 5],
            [2, 4, 6],
            [2, 4, 6],
            3,
        ),
        (eagle_dict(), None, None, None, 3),
        (speculators_dict(eagle_aux_hidden_state_layer_ids=[0, 2, 4, 7]), [0, 2, 4, 7], None, [0, 2, 4, 7], 4),
    ],
    ids=["top-level", "eagle_config", "both-eagle_config-wins", "none", "speculators-top-level"],
)
def test_layer_ids_are_read_from_top_level_and_eagle_config(raw, top, in_eagle_config, effective, num_aux):
    cfg = parse_config(raw, Path("config.json"))
    assert cfg.layer_ids_top == top
    assert cfg.layer_ids_eagle_config == in_eagle_config
    assert cfg.layer_ids == effective
    assert cfg.num_aux == num_aux


def test_non_integer_layer_ids_are_a_config_error():
    with pytest.raises(ConfigError, match=r"config\.json.*eagle_aux_hidden_state_layer_ids"):
        parse_config(eagle_dict(eagle_aux_hidden_state_layer_ids=["2", 4]), Path("config.json"))


# ---------------------------------------------------------------------------------------
# Draft vocab != target vocab
# ---------------------------------------------------------------------------------------

DRAFT_VOCAB = 128


@pytest.fixture(scope="module")
def chosen_target_ids() -> torch.Tensor:
    """The target ids of the draft vocab, ascending (as build_vocab_map makes them)."""
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:DRAFT_VOCAB].sort().values


@pytest.fixture(scope="module")
def small_vocab_ckpt(chosen_target_ids, tmp_path_factory) -> Path:
    d2t = chosen_target_ids - torch.arange(DRAFT_VOCAB)
    draft = make_draft(seed=2, d2t=d2t, draft_vocab_size=DRAFT_VOCAB)
    return save_eagle_format(draft, tmp_path_factory.mktemp("small-vocab") / "draft", LAYER_IDS)


def test_logits_in_target_vocab_put_draft_id_d_at_d_plus_d2t(small_vocab_ckpt, chosen_target_ids):
    loaded = load_draft(small_vocab_ckpt)
    assert loaded.model.lm_head.weight.shape == (DRAFT_VOCAB, H)
    out0, _ = run_two_steps(loaded.model)
    full = loaded.model.logits_in_target_vocab(out0.logits)
    assert full.shape == (*out0.logits.shape[:-1], VOCAB)
    assert torch.equal(full[..., chosen_target_ids], out0.logits)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[chosen_target_ids] = False
    assert torch.all(full[..., outside] == float("-inf"))
    assert torch.equal(loaded.model.to_target_ids(torch.arange(DRAFT_VOCAB)), chosen_target_ids)
    assert loaded.notes == []


def test_missing_d2t_leaves_a_note_and_maps_to_the_first_target_ids(small_vocab_ckpt, tmp_path):
    ckpt = Path(shutil.copytree(small_vocab_ckpt, tmp_path / "draft"))
    edit_weights(ckpt, lambda w: w.pop("d2t"))
    loaded = load_draft(ckpt)
    assert loaded.notes == ["d2t missing while draft vocab < target vocab: draft ids map to the first target ids"]
    assert torch.equal(loaded.model.to_target_ids(torch.arange(DRAFT_VOCAB)), torch.arange(DRAFT_VOCAB))


def test_missing_d2t_with_a_full_draft_vocab_leaves_no_note(eagle_copy):
    edit_weights(eagle_copy, lambda w: w.pop("d2t"))
    assert not any("d2t" in n for n in load_draft(eagle_copy).notes)


# ---------------------------------------------------------------------------------------
# Weights shared with the target
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_weights():
    g = torch.Generator().manual_seed(7)
    return torch.randn(VOCAB, H, generator=g), torch.randn(VOCAB, H, generator=g)


def test_checkpoint_without_embed_tokens_takes_the_targets(full_draft, target_weights, tmp_path):
    embed, _ = target_weights
    ckpt = save_eagle_format(full_draft, tmp_path / "draft", LAYER_IDS, include_embed=False)
    assert "embed_tokens.weight" not in load_file(str(ckpt / WEIGHTS))
    loaded = load_draft(ckpt, target_embed=embed)
    assert loaded.shared == ["embed_tokens"]
    assert torch.equal(loaded.model.embed_tokens.weight, embed)


def test_checkpoint_without_lm_head_and_full_draft_vocab_takes_the_targets(eagle_copy, target_weights):
    _, lm_head = target_weights
    edit_weights(eagle_copy, lambda w: w.pop("lm_head.weight"))
    loaded = load_draft(eagle_copy, target_lm_head=lm_head)
    assert loaded.shared == ["lm_head"]
    assert torch.equal(loaded.model.lm_head.weight, lm_head)


def test_checkpoint_with_both_shared_lists_both(eagle_copy, target_weights):
    edit_weights(eagle_copy, lambda w: (w.pop("lm_head.weight"), w.pop("embed_tokens.weight")))
    loaded = load_draft(eagle_copy, *target_weights)
    assert loaded.shared == ["embed_tokens", "lm_head"]


def test_checkpoint_with_own_embed_and_lm_head_shares_nothing(eagle_ckpt, target_weights):
    loaded = load_draft(eagle_ckpt, *target_weights)
    assert loaded.shared == []
    assert not torch.equal(loaded.model.embed_tokens.weight, target_weights[0])


# ---------------------------------------------------------------------------------------
# Bad input: one line, naming the file and the field or tensor
# ---------------------------------------------------------------------------------------


class _Unsafe:
    """Unpickling this would run code; a weights_only load must refuse it."""

    marker: str = ""

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _missing_config(d: Path):
    (d / "config.json").unlink()


def _invalid_json(d: Path):
    (d / "config.json").write_text('{"hidden_size": 64,\n "vocab_size": }\n')


def _no_hidden_size(d: Path):
    set_config(d, hidden_size=None)


def _wrong_target_hidden_size(d: Path):
    set_config(d, target_hidden_size=48)


def _wrong_lm_head_shape(d: Path):
    edit_weights(d, lambda w: w.__setitem__("lm_head.weight", torch.zeros(200, H)))


def _missing_tensors(d: Path):
    edit_weights(d, lambda w: (w.pop("midlayer.self_attn.q_proj.weight"), w.pop("norm.weight")))


def _missing_fc(d: Path):
    edit_weights(d, lambda w: w.pop("fc.weight"))


def _no_lm_head_small_vocab(d: Path):
    edit_weights(d, lambda w: w.pop("lm_head.weight"))
    set_config(d, draft_vocab_size=128)


def _no_embed_no_target(d: Path):
    edit_weights(d, lambda w: w.pop("embed_tokens.weight"))


def _no_weights(d: Path):
    (d / WEIGHTS).unlink()


def _unsafe_bin(d: Path):
    weights = load_file(str(d / WEIGHTS))
    (d / WEIGHTS).unlink()
    _Unsafe.marker = str(d / "code-was-run")
    torch.save({**weights, "extra": _Unsafe()}, d / "pytorch_model.bin")


def _garbage_bin(d: Path):
    (d / WEIGHTS).unlink()
    (d / "pytorch_model.bin").write_bytes(b"not a torch checkpoint")


BAD_CHECKPOINTS = [
    ("missing-config", _missing_config, ["config.json", "file not found"]),
    ("invalid-json", _invalid_json, ["config.json", "invalid JSON", "line 2"]),
    ("missing-hidden_size", _no_hidden_size, ["config.json", "hidden_size missing"]),
    (
        "fc-in-features",
        _wrong_target_hidden_size,
        ["fc.weight", "in_features 96", "num_aux(3)", "target_hidden_size(48)", "= 144"],
    ),
    ("wrong-shape", _wrong_lm_head_shape, ["tensor lm_head.weight", "shape (200, 64)", "expected (256, 64)"]),
    ("missing-tensors", _missing_tensors, ["tensors missing", "self_attn.q_proj.weight", "norm.weight"]),
    ("missing-fc", _missing_fc, ["fc.weight missing"]),
    ("no-lm_head-small-vocab", _no_lm_head_small_vocab, ["no lm_head.weight", "draft vocab != target vocab"]),
    ("no-embed-no-target", _no_embed_no_target, ["no embed_tokens.weight"]),
    ("no-weights", _no_weights, ["no weights found"]),
    ("unsafe-pickle-bin", _unsafe_bin, ["pytorch_model.bin", "not a plain-tensor checkpoint"]),
    ("garbage-bin", _garbage_bin, ["pytorch_model.bin", "not a plain-tensor checkpoint"]),
]


@pytest.mark.parametrize("breaker, fragments", [b[1:] for b in BAD_CHECKPOINTS], ids=[b[0] for b in BAD_CHECKPOINTS])
def test_bad_checkpoint_is_a_one_line_config_error_naming_file_and_field(breaker, fragments, eagle_copy):
    breaker(eagle_copy)
    with pytest.raises(ConfigError) as info:
        load_draft(eagle_copy)
    message = str(info.value)
    assert "\n" not in message
    assert str(eagle_copy) in message
    for fragment in fragments:
        assert fragment in message


def test_unsafe_pickle_is_never_executed(eagle_copy):
    _unsafe_bin(eagle_copy)
    with pytest.raises(ConfigError):
        load_draft(eagle_copy)
    assert not (eagle_copy / "code-was-run").exists()


def test_speculators_model_type_other_than_eagle3_is_a_config_error(speculators_copy):
    set_config(speculators_copy, speculators_model_type="mlp_speculator")
    with pytest.raises(ConfigError) as info:
        load_draft(speculators_copy)
    message = str(info.value)
    assert "\n" not in message
    assert str(speculators_copy / "config.json") in message
    assert "speculators_model_type is 'mlp_speculator', expected 'eagle3'" in message


def test_speculators_checkpoint_without_transformer_layer_config_is_a_config_error(speculators_copy):
    set_config(speculators_copy, transformer_layer_config=None)
    with pytest.raises(ConfigError, match="transformer_layer_config missing"):
        load_draft(speculators_copy)


def test_pytorch_model_bin_checkpoint_loads_like_safetensors(eagle_copy, eagle_ckpt):
    weights = load_file(str(eagle_copy / WEIGHTS))
    (eagle_copy / WEIGHTS).unlink()
    torch.save(weights, eagle_copy / "pytorch_model.bin")
    from_bin, from_safetensors = load_draft(eagle_copy), load_draft(eagle_ckpt)
    assert torch.equal(run_two_steps(from_bin.model)[0].logits, run_two_steps(from_safetensors.model)[0].logits)


# ---------------------------------------------------------------------------------------
# SGLang's legacy tensor names
# ---------------------------------------------------------------------------------------


def test_sglang_aux_norm_names_load_as_fc_norm(eagle_copy, full_draft):
    def rename(w):
        for j, legacy in enumerate(("aux_norm_low", "aux_norm_mid", "aux_norm_high")):
            w[f"{legacy}.weight"] = w.pop(f"fc_norm.{j}.weight")

    edit_weights(eagle_copy, rename)
    set_config(eagle_copy, fc_norm=True)
    loaded = load_draft(eagle_copy)
    assert loaded.notes == ["ignored checkpoint tensors: input_norm.weight"]
    for j in range(NUM_AUX):
        assert torch.equal(loaded.model.fc_norm[j].weight, full_draft.fc_norm[j].weight)
