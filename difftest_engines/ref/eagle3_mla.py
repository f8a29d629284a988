"""The EAGLE-3 draft with multi-head latent attention (MLA): the Kimi-K2.5 draft family.

Same data flow as the Llama draft in eagle3.py; only the attention differs. For a
prompt position i (H = draft hidden size, A = number of fused target layers):

    g_i   = fc( cat(fc_norm_1(h[a]_i), .., fc_norm_A(h[c]_i)) )   # fc_norm only with `fc_norm`
    x_i   = cat( input_layernorm(embed(t_{i+1})), hidden_norm(g_i) )         # width 2H
    r_i   = mla(x_i) + g_i          (+ hidden_norm(g_i) with norm_before_residual: vLLM only)
    p_i   = mlp(post_attention_layernorm(r_i)) + r_i                        # "hidden_prenorm"
    logits_i = lm_head(norm(p_i))

MLA over the 2H-wide x (DeepSeek-V2, arXiv 2405.04434), per head h of n_h:

    q_i        = q_b( q_a_layernorm( q_a(x_i) ) )          (q_proj(x_i) when q_lora_rank is null)
    [q_nope, q_pe]_{i,h} = q_{i,h}                          widths qk_nope_head_dim, qk_rope_head_dim
    [c_i, k_pe_i] = kv_a_proj_with_mqa(x_i)                 widths kv_lora_rank, qk_rope_head_dim
    c_i        = kv_a_layernorm(c_i)                        the latent: what the KV cache holds
    [k_nope, v]_{j,h} = kv_b(c_j)                           widths qk_nope_head_dim, v_head_dim
    k_{j,h}    = cat(k_nope_{j,h}, rope(k_pe_j))            k_pe is shared by all heads
    o_{i,h}    = softmax_j( cat(q_nope, rope(q_pe))_{i,h} . k_{j,h} * s ) v_{j,h}
    mla(x_i)   = o_proj( cat_h o_{i,h} )

rope rotates interleaved pairs (x0, x1), (x2, x3), ... (GPT-J style; vLLM `is_neox_style=False`,
HF `rope_interleave`), with any rope type's frequencies (difftest_engines/ref/rope.py); for yarn (DeepSeek
YaRN) cos/sin are scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim) (the engines'
rule, mscale 1 and mscale_all_dim 0 by default), and for any scaled rope the softmax
scale s = (qk_nope_head_dim + qk_rope_head_dim)^-0.5 * mscale(factor, mscale_all_dim)^2.

Whose semantics this follows (read, not copied):
  * vLLM 0.32.0 `model_executor/models/deepseek_eagle3.py`: `DeepseekV2Eagle3DecoderLayer.forward`
    (layer 0: input_layernorm on embeds, hidden_norm on the hidden, cat, MLA with `input_size=2H`,
    post_attention_layernorm fused with the residual add, dense `DeepseekV2MLP`, never MoE),
    `DeepseekV2Eagle3Model.forward` (final norm; norm_output picks post- over pre-norm),
    `Eagle3DeepseekV2ForCausalLM.combine_hidden_states` (fc_norm per chunk, then fc) and
    `compute_logits` (d2t scatter); MLA itself in `deepseek_v2.py::DeepseekV2MLAAttention`
    and `layers/mla.py::MultiHeadLatentAttentionWrapper.forward`; YaRN in
    `layers/rotary_embedding/deepseek_scaling_rope.py`.
  * SGLang 0.5.23 `srt/models/kimi_k25_eagle3.py`: `Eagle3MLADecoderLayer.forward` (the same
    flow, but the residual is always the un-normed hidden: it has no norm_before_residual),
    `Eagle3MLAModel.forward`, `Eagle3DeepseekV2ForCausalLM.load_weights`.
  * transformers 5.19 `models/deepseek_v3/modeling_deepseek_v3.py::DeepseekV3Attention` (the
    independent check in tests/test_eagle3_mla.py feeds it the same weights).

Checkpoint (what both engines load):
  config.json  `architectures: [Eagle3DeepseekV2ForCausalLM]` (vLLM also takes the alias
      Eagle3DeepseekV3ForCausalLM), a DeepSeek MLA `model_type`: deepseek_v2 here, kimi_k2 in
      lightseekorg's checkpoints (both run in vLLM 0.32.0; deepseek_v3 does not: vLLM's
      `config/speculative.py::SpeculativeConfig.hf_config_override` turns a deepseek_v3 draft
      into DeepSeekMTPModel, "Eagle3DeepSeekMTPModel are not supported"),
      hidden_size, intermediate_size, hidden_act (silu), num_hidden_layers (1),
      num_attention_heads, q_lora_rank (SGLang refuses null), kv_lora_rank, qk_nope_head_dim,
      qk_rope_head_dim, v_head_dim, rms_norm_eps, rope_parameters (or rope_theta + rope_scaling),
      max_position_embeddings, vocab_size, draft_vocab_size, target_hidden_size, fc_norm
      (or SGLang's legacy use_aux_norm), norm_output, norm_before_residual (read by vLLM only),
      layer ids at the top level (vLLM) and in eagle_config (SGLang reads that first; vLLM's
      fc width comes from num_aux_hidden_states, else eagle_config's ids, else 3).
  model.safetensors  `layers.0.` or `midlayer.` + {input_layernorm, hidden_norm,
      post_attention_layernorm, self_attn.{q_a_proj, q_a_layernorm, q_b_proj,
      kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}, mlp.{gate,up,down}_proj}.weight,
      fc.weight, fc_norm.{j}.weight, norm.weight, lm_head.weight, embed_tokens.weight
      (optional: shared from the target), d2t, t2d (ignored). Both engines fuse q_a_proj and
      kv_a_proj_with_mqa into one projection at load time; the checkpoint keeps them apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from difftest.api import ConfigError, check_config_numbers
from difftest_engines.ref.eagle3 import MLP, Eagle3Config, Eagle3Draft, RMSNorm, _ids
from difftest_engines.ref.rope import RopeParameters, inverse_frequencies, read_rope, yarn_mscale

ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


def is_mla_config(raw: dict) -> bool:
    """True when the draft config names an MLA EAGLE-3 class (what both engines dispatch on)."""
    return any(a in ARCHITECTURES for a in raw.get("architectures") or [])


@dataclass
class Eagle3MLAConfig(Eagle3Config):
    """Eagle3Config plus the MLA shapes and the rope parameters (head_dim = qk_nope + qk_rope)."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_parameters: dict = field(default_factory=dict)  # rope_type, rope_theta, and YaRN's keys
    max_position_embeddings: int = 4096


# ---------------------------------------------------------------------------------------
# Rotary embedding: interleaved pairs, any rope type's frequencies (rope.py), DeepSeek YaRN's scaling.
# ---------------------------------------------------------------------------------------

# vLLM names DeepSeek's yarn deepseek_yarn; transformers calls it yarn
ROPE_ALIASES = {"deepseek_yarn": "yarn"}


def mla_rope(cfg: Eagle3MLAConfig, where: str = "MLA draft config") -> RopeParameters:
    """The rope of cfg.rope_parameters, read by rope.py (the dict a config's rope_parameters holds)."""
    return read_rope(
        {"rope_parameters": cfg.rope_parameters, "max_position_embeddings": cfg.max_position_embeddings},
        where,
        aliases=ROPE_ALIASES,
    )


def rope_magnitude(rope: RopeParameters, scaling: float) -> float:
    """cos/sin magnitude: DeepSeek YaRN's mscale(f, mscale) / mscale(f, mscale_all_dim) (vLLM
    `DeepseekScalingRotaryEmbedding`, SGLang's deepseek_yarn; transformers' yarn agrees when both are
    set, Kimi's and DeepSeek's case), else the type's own attention scaling."""
    if rope.rope_type != "yarn":
        return scaling
    factor = float(rope.factor or 1)
    mscale = 1.0 if rope.mscale is None else rope.mscale
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, rope.mscale_all_dim or 0)


def softmax_scale(cfg: Eagle3MLAConfig) -> float:
    """(qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 for a scaled rope with
    mscale_all_dim (transformers' `yarn_apply_mscale`, the engines' DeepSeek attention)."""
    s = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = mla_rope(cfg)
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(float(rope.factor or 1), rope.mscale_all_dim)
        s *= m * m
    return s


def rope_interleaved(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, magnitude: float
) -> torch.Tensor:
    """x: [B, n, heads, d] with pairs (x[2j], x[2j+1]) rotated by angle position * inv_freq[j]."""
    wide = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 in the noise-floor run
    angles = positions.to(wide)[..., None] * inv_freq.to(wide)  # [B, n, d/2]
    cos, sin = (angles.cos() * magnitude)[:, :, None, :], (angles.sin() * magnitude)[:, :, None, :]
    xf = x.to(wide)
    even, odd = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)  # re-interleave
    return out.flatten(-2).type_as(x)


# ---------------------------------------------------------------------------------------
# Multi-head latent attention over cat(embeds, hidden)
# ---------------------------------------------------------------------------------------


@dataclass
class LatentCache:
    """What MLA caches per position: the normed latent c and the rotated shared rope key."""

    c: torch.Tensor  # [B, n, kv_lora_rank]
    k_pe: torch.Tensor  # [B, n, 1, qk_rope_head_dim]

    def extend(self, c: torch.Tensor, k_pe: torch.Tensor) -> "LatentCache":
        return LatentCache(torch.cat([self.c, c], dim=1), torch.cat([self.k_pe, k_pe], dim=1))


class MLAttention(nn.Module):
    def __init__(self, cfg: Eagle3MLAConfig):
        super().__init__()
        self.cfg = cfg
        nh, d_in = cfg.num_attention_heads, 2 * cfg.hidden_size  # input is cat(embeds, hidden)
        qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d_in, nh * qk_head, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_in, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * qk_head, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d_in, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.rope = mla_rope(cfg)
        self.scale = softmax_scale(cfg)

    def rope_frequencies(self, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(inv_freq, cos/sin magnitude) for this call's positions (dynamic and longrope depend on the
        largest position + 1, as in transformers' forward)."""
        seq_len = int(positions.max()) + 1 if self.rope.depends_on_length and positions.numel() else None
        inv_freq, scaling = inverse_frequencies(self.rope, self.cfg.qk_rope_head_dim, seq_len)
        return inv_freq.to(positions.device), rope_magnitude(self.rope, scaling)

    def forward(
        self,
        x: torch.Tensor,  # [B, n, 2H]
        positions: torch.Tensor,  # [B, n]
        cache: LatentCache | None,
        mask: torch.Tensor | None,  # [n, n_past + n] bool, True = may attend; None = causal after cache
    ) -> tuple[torch.Tensor, LatentCache]:
        cfg = self.cfg
        B, n, _ = x.shape
        nh, nope, rope_d = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(B, n, nh, nope + rope_d).split([nope, rope_d], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, rope_d], dim=-1)
        c, k_pe = self.kv_a_layernorm(c), k_pe.view(B, n, 1, rope_d)
        inv_freq, magnitude = self.rope_frequencies(positions)
        q_pe = rope_interleaved(q_pe, positions, inv_freq, magnitude)
        k_pe = rope_interleaved(k_pe, positions, inv_freq, magnitude)
        cache = LatentCache(c, k_pe) if cache is None else cache.extend(c, k_pe)
        n_kv = cache.c.shape[1]
        # Keys and values are re-expanded from the cached latents (the "naive" MLA form; the
        # engines absorb kv_b into q and the output instead, which is the same product).
        k_nope, v = (
            self.kv_b_proj(cache.c).view(B, n_kv, nh, nope + cfg.v_head_dim).split([nope, cfg.v_head_dim], dim=-1)
        )
        k = torch.cat([k_nope, cache.k_pe.expand(B, n_kv, nh, rope_d)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        if mask is None:  # new queries sit after the cached positions
            past = n_kv - n
            mask = torch.arange(n_kv, device=x.device)[None, :] <= past + torch.arange(n, device=x.device)[:, None]
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=self.scale
        )  # [B, nh, n, v_head_dim]
        y = y.transpose(1, 2).reshape(B, n, nh * cfg.v_head_dim)
        return self.o_proj(y), cache


class MLADecoderLayer(nn.Module):
    """The draft's single layer: the Llama draft's norms and dense MLP around MLA (never MoE)."""

    def __init__(self, cfg: Eagle3MLAConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the token embeddings
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the fused hidden state
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Eagle3MLADraft(Eagle3Draft):
    """fc, embedding, norms, lm_head and d2t as the Llama draft; its forward (eagle3.py,
    `Eagle3Draft.forward`) is the data flow above and calls the layer's MLA through the same
    (x, positions, cache, mask) interface, so the chain, tree and TTT training code run it unchanged."""

    def __init__(self, cfg: Eagle3MLAConfig):
        super().__init__(cfg, layer_class=MLADecoderLayer)
        self.input_norm = None  # norm_before_fc: neither engine's MLA draft has it (parse refuses it)


# ---------------------------------------------------------------------------------------
# Config: the keys the engines read (see the module docstring)
# ---------------------------------------------------------------------------------------


def _rope_parameters(raw: dict, where: str) -> dict:
    """The rope dict as transformers 5 reads the config (rope.py: rope_scaling or rope_parameters, the
    theta folded in), refused in one line when rope.py cannot compute it."""
    spec = read_rope(raw, where, default_max_positions=4096, aliases=ROPE_ALIASES)
    rope = {k: v for k, v in (raw.get(spec.source) or {}).items() if k != "type"}
    rope.update(rope_type=spec.rope_type, rope_theta=spec.theta)
    if spec.rope_type == "yarn":
        if rope.get("original_max_position_embeddings") is None:
            raise ConfigError(
                f"{where}: {spec.source}.original_max_position_embeddings missing (required for yarn rope)"
            )
        if rope.get("attention_factor") is not None:
            # vLLM turns yarn with attention_factor 1.0 into llama-style scaling and otherwise ignores it
            raise ConfigError(
                f"{where}: {spec.source}.attention_factor is set; the engines disagree on it, so the reference refuses it"
            )
    return rope


def parse_mla_config(raw: dict, path: Path) -> Eagle3MLAConfig:
    where = str(path)
    check_config_numbers([(raw, "")], where)  # "4" is refused, not read as int("4")

    def need(key: str) -> object:
        if raw.get(key) is None:
            raise ConfigError(f"{where}: field {key} missing (an Eagle3DeepseekV2ForCausalLM draft needs it)")
        return raw[key]

    H, nh = int(need("hidden_size")), int(need("num_attention_heads"))
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ConfigError(
            f"{where}: num_hidden_layers={raw['num_hidden_layers']}; both engines' MLA drafts have one layer"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"{where}: hidden_act {raw['hidden_act']!r}; the MLA draft's MLP is silu-gated (vLLM DeepseekV2MLP refuses others)"
        )
    if raw.get("norm_before_fc"):
        raise ConfigError(f"{where}: norm_before_fc is true, but neither engine's MLA draft applies it")
    if raw.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias is true, but neither engine's MLA draft has attention biases")
    eagle_cfg = raw.get("eagle_config") or {}
    ids_top = _ids(raw.get("eagle_aux_hidden_state_layer_ids"), f"{where}: eagle_aux_hidden_state_layer_ids")
    ids_ec = _ids(eagle_cfg.get("eagle_aux_hidden_state_layer_ids"), f"{where}: eagle_config")
    q_lora = raw.get("q_lora_rank")
    nope, rope_d = int(need("qk_nope_head_dim")), int(need("qk_rope_head_dim"))
    rope = _rope_parameters(raw, where)
    return Eagle3MLAConfig(
        hidden_size=H,
        intermediate_size=int(need("intermediate_size")),
        num_attention_heads=nh,
        num_key_value_heads=nh,  # MLA: every head has its own k_nope / v from the shared latent
        head_dim=nope + rope_d,
        vocab_size=int(need("vocab_size")),
        draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
        target_hidden_size=int(raw.get("target_hidden_size") or H),
        num_aux=int(raw.get("num_aux_hidden_states") or len(ids_ec or ids_top or [0, 0, 0])),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope["rope_theta"]),
        fc_norm=bool(raw.get("fc_norm") or raw.get("use_aux_norm") or False),
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        norm_output=bool(raw.get("norm_output", False)),
        format="eagle-mla",
        layer_ids_top=ids_top,
        layer_ids_eagle_config=ids_ec,
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(need("kv_lora_rank")),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_d,
        v_head_dim=int(need("v_head_dim")),
        rope_parameters=rope,
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
    )


# ---------------------------------------------------------------------------------------
# Saving (the fixture builder's writer); loading is draft_loading.load_draft, which dispatches here
# ---------------------------------------------------------------------------------------

ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "rope_interleave", "max_position_embeddings")


def mla_config_json(cfg: Eagle3MLAConfig, layer_ids: list[int], target_config: dict | None = None) -> dict:
    """config.json for the engines: a DeepSeek-V2 (MLA) config naming the EAGLE-3 MLA class.

    The rope keys are copied from the target's config when given (the draft shares the target's
    positions, and SGLang's CPU rope only implements DeepSeek YaRN)."""
    config = {
        "architectures": [ARCHITECTURES[0]],
        "model_type": "deepseek_v2",  # not deepseek_v3: vLLM 0.32.0 rewrites that to its MTP draft (docstring)
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": False,
        "rope_parameters": dict(cfg.rope_parameters),
        "rope_interleave": True,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(layer_ids),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True},
    }
    for key in ROPE_KEYS:
        if target_config and key in target_config:
            config[key] = target_config[key]
    return config


def save_mla_draft(
    draft: Eagle3MLADraft,
    out_dir: str | Path,
    layer_ids: list[int],
    *,
    target_config: dict | None = None,
    include_embed: bool = True,
) -> Path:
    """config.json + model.safetensors with `layers.0.*` keys (the layout SGLang's loader maps)."""
    from safetensors.torch import save_file

    cfg = draft.cfg
    weights: dict[str, torch.Tensor] = {}
    for key, value in draft.state_dict().items():
        if key == "embed_tokens.weight" and not include_embed:
            continue
        if key.startswith("layer."):
            key = "layers.0." + key[len("layer.") :]
        weights[key] = value.detach().float().contiguous() if value.is_floating_point() else value.contiguous()
    weights["d2t"] = draft.d2t.long().contiguous()
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.arange(cfg.draft_vocab_size) + draft.d2t] = True
    weights["t2d"] = t2d
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = mla_config_json(cfg, layer_ids, target_config)
    # each file written beside its final name and renamed into place: a reader never sees half of it
    tmp = out_dir / ".config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(out_dir / "config.json")
    tmp = out_dir / ".model.safetensors.tmp"
    save_file(weights, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / "model.safetensors")
    return out_dir
