"""Every rope type a Hugging Face config carries (difftest_engines/ref/rope.py) against transformers' own.

For each type and a few parameter sets, our inverse frequencies and attention scaling equal
`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` on a LlamaConfig of the same config, and the
cos/sin the reference draft rotates with equal transformers' `LlamaRotaryEmbedding` (its forward, the
length-dependent dynamic and longrope included, at lengths up to and past the original one); both are
float32 in transformers, computed in the same order here, so the comparison is exact (float64
tolerance on the upcast values). Then the drafts: a config with SpecForge's llama3 rope loads and runs
in the reference draft, rotating as transformers' Llama attention does; an unknown type or a missing
key is one line naming the config field.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from difftest.base.errors import ConfigError
from difftest_engines.ref import rope as ref_rope
from difftest_engines.ref.draft_loading import load_draft
from difftest_engines.ref.eagle3 import Eagle3Config, Eagle3Draft, rope
from difftest_engines.ref.eagle3_mla import Eagle3MLAConfig, mla_rope, rope_magnitude
from difftest_engines.ref.train import save_eagle_format

HEAD_DIM, MAX_POSITIONS, ORIGINAL = 64, 4096, 1024
SHAPE = dict(hidden_size=256, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITIONS)
SPECFORGE_LLAMA3 = {  # SpecForge configs/llama3-70B-ealge3.json
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHORT = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]
LONG = [1.5 + 0.4 * i for i in range(HEAD_DIM // 2)]
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "linear-type-key": {"type": "linear", "factor": 2.5},  # transformers 4's older spelling
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "dynamic-8": {"rope_type": "dynamic", "factor": 8.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-deepseek": {  # DeepSeek-V3's shape: mscale / mscale_all_dim, betas
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "yarn-kimi": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "yarn-untruncated": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
        "truncate": False,
        "attention_factor": 0.9,
    },
    "yarn-mscale-only": {"rope_type": "yarn", "factor": 16.0, "mscale": 0.5},  # original from M
    "llama3": dict(SPECFORGE_LLAMA3, original_max_position_embeddings=ORIGINAL),
    "llama3-specforge": SPECFORGE_LLAMA3,
    "longrope": {
        "rope_type": "longrope",
        "short_factor": SHORT,
        "long_factor": LONG,
        "original_max_position_embeddings": ORIGINAL,
    },
    "longrope-factor": {
        "rope_type": "longrope",
        "short_factor": SHORT,
        "long_factor": LONG,
        "factor": 2.0,
        "attention_factor": 1.25,
        "original_max_position_embeddings": ORIGINAL,
    },
}
THETAS = (10000.0, 500000.0)
# lengths: inside the original length, past it (longrope's long factors), past M (dynamic grows)
LENGTHS = (None, 100, ORIGINAL + 1, 6000)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    # transformers warns (not refuses) about a few of these parameter sets (yarn's factor vs M / O)
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


def raw_config(name: str, theta: float, spelling: str = "rope_scaling") -> dict:
    rope = dict(ROPES[name])
    if spelling == "rope_parameters":
        rope["rope_theta"] = theta
        return {**SHAPE, "rope_parameters": rope}
    return {**SHAPE, "rope_theta": theta, "rope_scaling": rope}


def assert_same_float32(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-15, atol=0)


@pytest.mark.parametrize("theta", THETAS)
@pytest.mark.parametrize("name", sorted(ROPES))
def test_frequencies_and_scaling_equal_transformers_init_functions(name, theta):
    raw = raw_config(name, theta)
    hf = LlamaConfig.from_dict(raw)
    ours = ref_rope.read_rope(raw, "config.json")
    assert ours.rope_type == hf.rope_parameters["rope_type"]
    for seq_len in LENGTHS:
        inv_freq, scaling = ref_rope.inverse_frequencies(ours, HEAD_DIM, seq_len)
        if ours.rope_type == "default":
            theirs = 1.0 / (theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM))
            theirs_scaling = 1.0
        else:
            # transformers' forward passes the length as a tensor (torch.max(position_ids) + 1)
            length = None if seq_len is None else torch.tensor(seq_len)
            theirs, theirs_scaling = ROPE_INIT_FUNCTIONS[ours.rope_type](hf, "cpu", seq_len=length)
        assert_same_float32(inv_freq, theirs)
        assert scaling == pytest.approx(float(theirs_scaling), rel=1e-15), (name, seq_len)


# each spelling with one theta (the init-function test above takes both thetas)
@pytest.mark.parametrize(("spelling", "theta"), [("rope_scaling", 10000.0), ("rope_parameters", 500000.0)])
@pytest.mark.parametrize("name", sorted(ROPES))
def test_cos_sin_equal_transformers_rotary_embedding_up_to_and_past_the_original_length(name, spelling, theta):
    raw = raw_config(name, theta, spelling)
    params = ref_rope.read_rope(raw, "config.json")
    for n in (50, ORIGINAL + 1, 6000):
        module = LlamaRotaryEmbedding(LlamaConfig.from_dict(raw))  # fresh: dynamic's cache is per module
        positions = torch.arange(n)[None]
        cos, sin = module(torch.zeros(1, n, HEAD_DIM), positions)
        ours_cos, ours_sin = ref_rope.cos_sin(params, HEAD_DIM, positions, torch.float32)
        assert_same_float32(torch.cat([ours_cos, ours_cos], dim=-1), cos)
        assert_same_float32(torch.cat([ours_sin, ours_sin], dim=-1), sin)


def test_length_dependent_types_change_past_their_lengths():
    """The comparisons above reach the branches: dynamic past M, longrope past O."""
    for name, short, long in (("dynamic", 100, 6000), ("longrope", 100, ORIGINAL + 1)):
        p = ref_rope.read_rope(raw_config(name, 10000.0), "config.json")
        assert not torch.equal(
            ref_rope.inverse_frequencies(p, HEAD_DIM, short)[0], ref_rope.inverse_frequencies(p, HEAD_DIM, long)[0]
        )


def test_rope_scaling_is_read_before_rope_parameters_and_its_theta_before_the_top_level():
    """transformers 5 (`convert_rope_params_to_dict`): a non-empty rope_scaling replaces rope_parameters."""
    raw = {
        **SHAPE,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    p = ref_rope.read_rope(raw, "config.json")
    hf = LlamaConfig.from_dict(raw).rope_parameters
    assert (p.rope_type, p.theta, p.factor, p.source) == (
        hf["rope_type"],
        hf["rope_theta"],
        hf["factor"],
        "rope_scaling",
    )
    raw = {**SHAPE, "rope_theta": 500000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert ref_rope.read_rope(raw, "config.json").theta == LlamaConfig.from_dict(raw).rope_parameters["rope_theta"]


@pytest.mark.parametrize("name", ["yarn-kimi", "yarn-deepseek"])
def test_mla_draft_magnitude_is_transformers_yarn_where_both_mscales_are_set(name):
    """The MLA draft keeps the engines' DeepSeek-YaRN magnitude; with both mscales set (Kimi, DeepSeek)
    it is transformers' yarn attention factor."""
    rope = dict(ROPES[name], rope_theta=10000.0)
    cfg = Eagle3MLAConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=24,
        vocab_size=64,
        draft_vocab_size=64,
        target_hidden_size=32,
        num_aux=3,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        kv_lora_rank=32,
        v_head_dim=12,
        rope_parameters=rope,
        max_position_embeddings=MAX_POSITIONS,
    )
    p = mla_rope(cfg)
    _, scaling = ref_rope.inverse_frequencies(p, 8)
    _, theirs = ROPE_INIT_FUNCTIONS["yarn"](
        LlamaConfig.from_dict({**SHAPE, "head_dim": 8, "rope_parameters": rope}), "cpu"
    )
    assert rope_magnitude(p, scaling) == pytest.approx(theirs, rel=1e-15)


# -- refusals: one line naming the config field ------------------------------------------------


def test_an_unknown_rope_type_is_one_line_naming_the_field_and_the_closest_type():
    raw = {**SHAPE, "rope_scaling": {"rope_type": "lama3", "factor": 8.0}}
    with pytest.raises(ConfigError) as err:
        ref_rope.read_rope(raw, "d/config.json")
    assert str(err.value) == (
        "d/config.json: rope_scaling.rope_type 'lama3' is not a rope type the reference knows; did you mean "
        "'llama3'? (known: default, linear, dynamic, yarn, llama3, longrope)"
    )
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("rope", "field"),
    [
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "rope_scaling.high_freq_factor"),
        ({"type": "linear"}, "rope_scaling.factor"),
        ({"rope_type": "longrope", "short_factor": SHORT}, "rope_scaling.long_factor"),
        ({"rope_type": "yarn", "original_max_position_embeddings": 8}, "rope_scaling.factor"),
    ],
)
def test_a_missing_required_key_is_one_line_naming_it(rope, field):
    with pytest.raises(ConfigError) as err:
        ref_rope.read_rope({**SHAPE, "rope_scaling": rope}, "d/config.json")
    kind = rope.get("rope_type") or rope["type"]
    assert str(err.value) == f"d/config.json: {field} missing (required for {kind} rope)"


def test_a_speculators_config_names_the_layer_config_field(tmp_path):
    from difftest_engines.ref.train import save_speculators_format

    save_speculators_format(_draft(), tmp_path, [1, 2, 3], verifier_name_or_path="x")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["transformer_layer_config"]["rope_parameters"] = {"rope_type": "yarnn", "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"transformer_layer_config\.rope_parameters\.rope_type 'yarnn' .*'yarn'"):
        load_draft(tmp_path)


# -- the reference draft with SpecForge's llama3 rope -------------------------------------------


def _draft() -> Eagle3Draft:
    torch.manual_seed(0)
    cfg = Eagle3Config(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=256,
        draft_vocab_size=256,
        target_hidden_size=64,
        num_aux=3,
        rope_theta=500000.0,
    )
    return Eagle3Draft(cfg).eval()


def _saved_with_rope(tmp_path: Path, rope_scaling: dict | None) -> Path:
    save_eagle_format(_draft(), tmp_path, [1, 2, 3])
    cfg = json.loads((tmp_path / "config.json").read_text())
    if rope_scaling is not None:  # SpecForge's spelling: rope_theta + rope_scaling, no rope_parameters
        cfg.pop("rope_parameters", None)
        cfg["rope_scaling"] = dict(rope_scaling)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_a_draft_with_specforge_llama3_rope_loads_and_rotates_as_transformers_llama(tmp_path):
    model_dir = _saved_with_rope(tmp_path, SPECFORGE_LLAMA3)
    loaded = load_draft(model_dir)
    cfg = loaded.model.cfg
    assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.factor) == ("llama3", 500000.0, 8.0)
    # the draft's rotation against transformers' Llama attention's, from the same config.json
    hf = LlamaConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    positions = torch.arange(40)[None]
    q = torch.randn(1, 40, 4, 32, generator=torch.Generator().manual_seed(1))
    cos, sin = LlamaRotaryEmbedding(hf)(q, positions)
    theirs, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)
    torch.testing.assert_close(rope(q, positions, cfg.rope), theirs.transpose(1, 2), rtol=0, atol=0)


def test_llama3_rope_moves_the_draft_far_above_float32_noise_at_short_positions(tmp_path):
    """What cases/specforge_llama3_rope.yaml relies on: an engine that ran this draft with plain
    theta-500000 rope would be caught, not pass by accident (the shipped case's positions are < 64)."""
    llama3 = load_draft(_saved_with_rope(tmp_path / "llama3", SPECFORGE_LLAMA3)).model
    plain = load_draft(_saved_with_rope(tmp_path / "plain", None)).model
    g = torch.Generator().manual_seed(3)
    n = 24
    fc_in = torch.randn(1, n, 3 * 64, generator=g)
    ids = torch.randint(0, 256, (1, n), generator=g)
    with torch.no_grad():
        a = llama3(ids, llama3.combine(fc_in), torch.arange(n)[None]).hidden_prenorm
        b = plain(ids, plain.combine(fc_in), torch.arange(n)[None]).hidden_prenorm
    assert torch.equal(a[:, :1], b[:, :1])  # position 0 attends to itself only: rope cannot move it ...
    # ... later ones move by far more than float32 rounding (the noise floor's scale), untrained as it is
    assert (a - b).abs().max() > 100 * torch.finfo(torch.float32).eps * a.abs().max()
