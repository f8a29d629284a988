"""The MLA EAGLE-3 draft (difftest_engines/ref/eagle3_mla.py): its forward against transformers' DeepseekV3
modules fed the same weights, its checkpoint as the engines read it, and bad input.

The independent computation is transformers 5.19's `DeepseekV3Attention` (with its own YaRN
rotary embedding and rope_interleave), `DeepseekV3MLP` and `DeepseekV3RMSNorm`, assembled in the
order vLLM's `DeepseekV2Eagle3DecoderLayer.forward` and SGLang's `Eagle3MLADecoderLayer.forward`
run them. The attention's q_a / kv_a projections read the 2H-wide cat(embeds, hidden), so the
HF module is built for hidden size 2H and its o_proj swapped for one that writes H.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftest.base.errors import ConfigError
from difftest_engines.ref.draft_loading import load_draft
from difftest_fixtures.deepseek import ROPE_PARAMETERS
from difftest_engines.ref.eagle3_mla import (
    Eagle3MLAConfig,
    Eagle3MLADraft,
    LatentCache,
    MLAttention,
    is_mla_config,
    save_mla_draft,
)

H, HEADS, Q_LORA, KV_LORA, ROPE, NOPE, V_HEAD, INTER = 32, 4, 16, 32, 8, 16, 12, 64
VOCAB, DRAFT_VOCAB, NUM_AUX = 64, 48, 3
YARN = ROPE_PARAMETERS  # the tiny DeepSeek-V3 target's (Kimi-K2-shaped) yarn rope
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
LAYER_IDS = [1, 2, 3]


def make_mla_config(rope: dict = YARN, **overrides) -> Eagle3MLAConfig:
    fields = dict(
        hidden_size=H,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        head_dim=NOPE + ROPE,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        target_hidden_size=H,
        num_aux=NUM_AUX,
        q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V_HEAD,
        rope_parameters=dict(rope),
        max_position_embeddings=1024,
    )
    fields.update(overrides)
    return Eagle3MLAConfig(**fields)


def make_mla_draft(seed: int = 0, **overrides) -> Eagle3MLADraft:
    """Seeded random draft: matrices N(0, 0.2), norm weights U(0.5, 1.5) (no norm is the identity), d2t not zero."""
    torch.manual_seed(seed)
    draft = Eagle3MLADraft(make_mla_config(**overrides))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) + 0.5)
            else:
                p.normal_(0, 0.2)
        draft.d2t.fill_(VOCAB - DRAFT_VOCAB)  # draft id d is target id d + 16
    return draft.eval()


def hf_config(hidden: int, rope: dict = YARN):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        hidden_size=hidden,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=V_HEAD,
        rope_parameters=dict(rope),
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
    )
    cfg._attn_implementation = "eager"
    return cfg


def hf_attention(ours: MLAttention, rope: dict = YARN):
    """transformers' DeepseekV3Attention over 2H inputs, o_proj writing H, loaded with our weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    cfg = hf_config(2 * H, rope)
    attn = DeepseekV3Attention(cfg, layer_idx=0)
    attn.o_proj = torch.nn.Linear(HEADS * V_HEAD, H, bias=False)
    attn.load_state_dict(ours.state_dict(), strict=True)
    return attn.eval(), DeepseekV3RotaryEmbedding(cfg)


def causal_mask(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


@pytest.mark.parametrize("rope", [YARN, DEFAULT_ROPE], ids=["yarn", "default"])
def test_mla_attention_matches_transformers_deepseek_v3_attention(rope):
    draft = make_mla_draft(rope=rope)
    attn, rotary = hf_attention(draft.layer.self_attn, rope)
    x = torch.randn(1, 9, 2 * H, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(9)[None] + 5  # away from 0, so a wrong rope shows
    with torch.no_grad():
        expected, _ = attn(x, rotary(x, positions), causal_mask(9))
        ours, cache = draft.layer.self_attn(x, positions, None, None)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert cache.c.shape == (1, 9, KV_LORA) and cache.k_pe.shape == (1, 9, 1, ROPE)


def test_mla_attention_without_q_lora_matches_transformers():
    draft = make_mla_draft(q_lora_rank=None)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    cfg = hf_config(2 * H)
    cfg.q_lora_rank = None
    attn = DeepseekV3Attention(cfg, layer_idx=0)
    attn.o_proj = torch.nn.Linear(HEADS * V_HEAD, H, bias=False)
    attn.load_state_dict(draft.layer.self_attn.state_dict(), strict=True)
    x = torch.randn(1, 6, 2 * H, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(6)[None]
    with torch.no_grad():
        expected, _ = attn(x, DeepseekV3RotaryEmbedding(cfg)(x, positions), causal_mask(6))
        ours, _ = draft.layer.self_attn(x, positions, None, None)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_latent_cache_decoding_equals_one_causal_pass():
    attn = make_mla_draft().layer.self_attn
    x = torch.randn(1, 8, 2 * H, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(8)[None]
    with torch.no_grad():
        full, _ = attn(x, positions, None, None)
        first, cache = attn(x[:, :5], positions[:, :5], None, None)
        rows = [first]
        for i in range(5, 8):
            y, cache = attn(x[:, i : i + 1], positions[:, i : i + 1], cache, None)
            rows.append(y)
    assert isinstance(cache, LatentCache) and cache.c.shape[1] == 8
    torch.testing.assert_close(torch.cat(rows, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm_output", [False, True])
def test_draft_forward_matches_transformers_modules_in_engine_order(norm_output):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP, DeepseekV3RMSNorm

    draft = make_mla_draft(norm_output=norm_output, fc_norm=True)
    attn, rotary = hf_attention(draft.layer.self_attn)
    mlp = DeepseekV3MLP(hf_config(H))
    mlp.load_state_dict(draft.layer.mlp.state_dict())

    def norm(ours) -> DeepseekV3RMSNorm:
        n = DeepseekV3RMSNorm(ours.weight.shape[0], eps=1e-6)
        n.load_state_dict(ours.state_dict())
        return n

    gen = torch.Generator().manual_seed(4)
    n = 7
    fc_in = torch.randn(1, n, NUM_AUX * H, generator=gen) * 3
    ids = torch.randint(0, VOCAB, (1, n), generator=gen)
    positions = torch.arange(n)[None]
    with torch.no_grad():
        chunks = fc_in.chunk(NUM_AUX, dim=-1)
        g = draft.fc(torch.cat([norm(m)(c) for m, c in zip(draft.fc_norm, chunks)], dim=-1))
        x = torch.cat(
            [norm(draft.layer.input_layernorm)(draft.embed_tokens(ids)), norm(draft.layer.hidden_norm)(g)], -1
        )
        a, _ = attn(x, rotary(x, positions), causal_mask(n))
        r = a + g  # the residual is the un-normed hidden (norm_before_residual false)
        p = mlp(norm(draft.layer.post_attention_layernorm)(r)) + r
        post = norm(draft.norm)(p)
        expected_logits = draft.lm_head(post)

        out = draft(ids, draft.combine(fc_in), positions)
    torch.testing.assert_close(out.logits, expected_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.hidden_prenorm, p, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.hidden_next, post if norm_output else p, atol=1e-5, rtol=1e-5)


def test_checkpoint_names_the_mla_class_and_deepseek_config_keys(tmp_path):
    save_mla_draft(make_mla_draft(), tmp_path, LAYER_IDS)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert config["model_type"] == "deepseek_v2"  # vLLM 0.32.0 turns a deepseek_v3 draft into its MTP model
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]) == (Q_LORA, KV_LORA, ROPE)
    assert config["rope_parameters"] == YARN
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "embed_tokens.weight",
        "d2t",
        "t2d",
        "layers.0.input_layernorm.weight",
        "layers.0.hidden_norm.weight",
        "layers.0.post_attention_layernorm.weight",
        "layers.0.self_attn.q_a_proj.weight",
        "layers.0.self_attn.q_a_layernorm.weight",
        "layers.0.self_attn.q_b_proj.weight",
        "layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "layers.0.self_attn.kv_a_layernorm.weight",
        "layers.0.self_attn.kv_b_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.0.mlp.down_proj.weight",
    } == keys


def test_config_parses_as_transformers_deepseek_v2_with_the_fields_engines_read(tmp_path):
    from transformers import AutoConfig

    save_mla_draft(make_mla_draft(), tmp_path, LAYER_IDS)
    cfg = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    assert type(cfg).__name__ == "DeepseekV2Config"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (H, 1, HEADS)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        Q_LORA,
        KV_LORA,
        NOPE,
        ROPE,
        V_HEAD,
    )
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 4.0
    assert (cfg.draft_vocab_size, cfg.target_hidden_size, cfg.eagle_config["eagle_aux_hidden_state_layer_ids"]) == (
        DRAFT_VOCAB,
        H,
        LAYER_IDS,
    )


@pytest.mark.parametrize("prefix", ["layers.0.", "midlayer.", "model.layers.0."])
def test_saved_draft_loads_back_to_the_same_outputs(tmp_path, prefix):
    draft = make_mla_draft()
    save_mla_draft(draft, tmp_path, LAYER_IDS)
    if prefix != "layers.0.":
        weights = load_file(str(tmp_path / "model.safetensors"))
        weights = {(prefix + k[len("layers.0.") :] if k.startswith("layers.0.") else k): v for k, v in weights.items()}
        save_file(weights, str(tmp_path / "model.safetensors"))
    loaded = load_draft(tmp_path)
    assert isinstance(loaded.model, Eagle3MLADraft)
    assert loaded.config.layer_ids == LAYER_IDS and loaded.config.num_aux == NUM_AUX
    gen = torch.Generator().manual_seed(5)
    fc_in, ids = torch.randn(1, 5, NUM_AUX * H, generator=gen), torch.randint(0, VOCAB, (1, 5), generator=gen)
    with torch.no_grad():
        want = draft(ids, draft.combine(fc_in), torch.arange(5)[None]).logits
        got = loaded.model(ids, loaded.model.combine(fc_in), torch.arange(5)[None]).logits
    assert torch.equal(got, want)
    assert torch.equal(loaded.model.d2t, draft.d2t)


def test_vllm_alias_architecture_is_an_mla_draft():
    assert is_mla_config({"architectures": ["Eagle3DeepseekV3ForCausalLM"]})
    assert not is_mla_config({"architectures": ["LlamaForCausalLMEagle3"]})


def _saved(tmp_path: Path) -> Path:
    save_mla_draft(make_mla_draft(), tmp_path, LAYER_IDS)
    return tmp_path


def _edit_config(model_dir: Path, drop: tuple[str, ...] = (), **updates) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    for key in drop:
        config.pop(key)
    config.update(updates)
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("field", ["kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "hidden_size"])
def test_missing_mla_config_field_is_a_one_line_error(tmp_path, field):
    model_dir = _saved(tmp_path)
    _edit_config(model_dir, drop=(field,))
    with pytest.raises(ConfigError) as err:
        load_draft(model_dir)
    assert (
        str(err.value)
        == f"{model_dir / 'config.json'}: field {field} missing (an Eagle3DeepseekV2ForCausalLM draft needs it)"
    )


def test_missing_mla_tensor_is_a_one_line_error(tmp_path):
    model_dir = _saved(tmp_path)
    weights = load_file(str(model_dir / "model.safetensors"))
    del weights["layers.0.self_attn.kv_b_proj.weight"]
    save_file(weights, str(model_dir / "model.safetensors"))
    with pytest.raises(ConfigError) as err:
        load_draft(model_dir)
    assert str(err.value) == f"{model_dir}: tensors missing from the checkpoint: layer.self_attn.kv_b_proj.weight"


def test_wrong_latent_width_names_the_tensor_and_both_shapes(tmp_path):
    model_dir = _saved(tmp_path)
    _edit_config(model_dir, kv_lora_rank=KV_LORA * 2)
    with pytest.raises(ConfigError) as err:
        load_draft(model_dir)
    assert str(err.value) == (
        f"{model_dir}: tensor layer.self_attn.kv_a_proj_with_mqa.weight has shape (40, 64), expected (72, 64)"
    )


def test_yarn_without_factor_is_a_one_line_error(tmp_path):
    model_dir = _saved(tmp_path)
    rope = dict(YARN)
    del rope["factor"]
    _edit_config(model_dir, rope_parameters=rope)
    with pytest.raises(ConfigError) as err:
        load_draft(model_dir)
    assert str(err.value) == f"{model_dir / 'config.json'}: rope_parameters.factor missing (required for yarn rope)"


def test_norm_before_fc_is_refused_because_neither_engine_applies_it(tmp_path):
    model_dir = _saved(tmp_path)
    _edit_config(model_dir, norm_before_fc=True)
    with pytest.raises(ConfigError, match="norm_before_fc is true, but neither engine's MLA draft applies it"):
        load_draft(model_dir)


# -- the built-in fixture tiny-deepseek-v3-eagle3-mla ------------------------------------------


@pytest.fixture(scope="module")
def mla_fixture() -> Path:
    from difftest_fixtures import mla as fixtures_mla

    return fixtures_mla.ensure_fixtures()[fixtures_mla.DRAFT]


def test_fixture_is_the_mla_class_with_the_targets_shapes_and_ids(mla_fixture):
    from difftest_fixtures import deepseek

    config = json.loads((mla_fixture / "config.json").read_text())
    target = json.loads((deepseek.fixture_path(deepseek.TARGET) / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    for key in ("q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_parameters"):
        assert config[key] == target[key], key
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576  # vLLM's CPU MLA backend takes only this
    assert (
        config["eagle_aux_hidden_state_layer_ids"]
        == config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        == [2, 4, 5]
    )


def test_fixture_draft_predicts_the_target_under_its_training_wiring_only(mla_fixture):
    """Recomputed on 16 sequences from the held-out seed: the trained wiring agrees with the target's greedy tokens
    (quality.json: 0.918 on all 64), SGLang's Llama +1 reading ([h3, h5, h6]) does not (0.046)."""
    from difftest_fixtures import deepseek, drafts
    from difftest_engines.ref.target import load_target
    from difftest_engines.ref.train import prepare_data, step0_agreement

    target = load_target(deepseek.fixture_path(deepseek.TARGET))
    draft = load_draft(mla_fixture).model
    assert isinstance(draft, Eagle3MLADraft)
    heldout = drafts.generate_sequences(target, 16, drafts.HELDOUT_PROMPT, drafts.HELDOUT_NEW, drafts.HELDOUT_SEED)
    trained = step0_agreement(draft, prepare_data(target, deepseek.GOOD_WIRING, heldout))
    shifted = step0_agreement(draft, prepare_data(target, deepseek.SHIFTED_WIRING, heldout))
    assert trained > 0.85
    assert shifted < 0.15
