"""The draft's TTT forward in a trainer's own arithmetic, where the reference draft's differs from it.

The reference draft (difftest_engines/ref/eagle3.py) computes each RMSNorm and the rotary embedding in
float32 and rounds once, and attends with one scaled_dot_product_attention over a boolean mask. In float32
that is the trainers' forward to within float32 roundoff; in bfloat16 every rounding step is a place where
the two can part, and a draft's argmax flips wherever its top-2 logits are that close. SpecForge 0.2.0
trains and logs its acc_k in the model's torch_dtype (bfloat16 by default), so `train-acc --dtype bfloat16`
under SpecForge's rules runs the draft as SpecForge does, op for op (`specforge_unroll`), and its counts
are SpecForge's exactly (tests/test_specforge_writer_e2e.py, tests/test_trainers_oracle.py).

SpecForge 0.2.0, `specforge/modeling/draft/llama3_eagle.py` (what `specforge_unroll` follows):
* `LlamaRMSNorm.forward`: normalize in float32, round to the input dtype, then multiply by the weight in
  that dtype (two roundings; the reference rounds once, after the weight);
* `LlamaRotaryEmbedding._set_cos_sin_cache` / `forward`: cos/sin of einsum(t, inv_freq) in float32, rounded
  to the activations' dtype before use; `apply_rotary_pos_emb`: q*cos + rotate_half(q)*sin in that dtype;
* `LlamaAttention.forward` with `cache_hidden` (the sdpa backend's TTT path, `OnlineEagle3Model.forward`
  passes cache_hidden=[[], []]): scores q.k0^T / sqrt(d) in the dtype plus the float mask of
  `modeling/draft/base.py::prepare_decoder_attention_mask` (finfo.min above the diagonal), one column
  (q * k_i).sum(-1) / sqrt(d) per later step i, softmax in float32 rounded back, then weights @ v0 plus
  w_i * v_i per step; rotary positions i + k at step k (position_ids + len(cache_hidden[0]));
* `LlamaDecoderLayer.forward`: residual = the hidden input (un-normed; the config's norm_before_residual is
  not read), cat(input_layernorm(embeds), hidden_norm(hidden)), attention, residual add, MLP;
* `LlamaForCausalLMEagle3.compute_logits`: lm_head(norm(h)) when the config's norm_output is true (its
  default when the key is absent), lm_head(h) when it is false; `backbone` returns the pre-norm h, which
  the next step takes either way (the reference reads norm_output as "feed the normed output onward");
* `project_hidden_states`: fc over cat(fc_norm per chunk) when the config's fc_norm is set, else fc (the
  config's norm_before_fc is not read);
* `algorithms/eagle3/model.py::OnlineEagle3Model.forward`: the draft runs over all N positions of the
  sample, input ids shifted left by one with a 0 at the end (`TargetHead.preprocess` / `utils.padding`),
  shifted again before each later step.
Only the rotary embedding's default type is SpecForge's formula here; a draft with another rope type takes
the reference's cos/sin (difftest_engines/ref/rope.py), rounded the same way.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from difftest_engines.ref.rope import cos_sin


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # SpecForge 0.2.0 llama3_eagle.py::LlamaRMSNorm.forward: the weight multiplies after the cast back
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cos_sin(cfg, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, d] cos and sin for positions 0..n-1, rounded to `dtype` as SpecForge's rotary cache is used."""
    d = cfg.head_dim
    rope = cfg.rope
    if rope.rope_type == "default":
        # LlamaRotaryEmbedding.__init__ / _set_cos_sin_cache (float32 cache, default dtype)
        inv_freq = 1.0 / (rope.theta ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.einsum("i,j->ij", torch.arange(n, dtype=inv_freq.dtype), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
    cos, sin = cos_sin(rope, d, torch.arange(n), torch.float32)
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype)


def is_llama_draft(draft) -> bool:
    """SpecForge's EAGLE-3 draft is Llama's: a layer with q/k/v/o projections and a gated MLP."""
    attn = getattr(getattr(draft, "layer", None), "self_attn", None)
    return all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))


@torch.no_grad()
def specforge_unroll(
    draft,
    fc_in: torch.Tensor,  # [N, A*H]
    input_ids: torch.Tensor,  # [N]
    ttt_steps: int,
    logits_norm: bool,  # the config's norm_output as SpecForge reads it (absent: True)
    margins: list | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """SpecForge 0.2.0's TTT unroll (module docstring) -> per step [N-1] draft ids at origins 0..N-2, and per
    step the [N-1, draft_vocab] logits in the draft's dtype. margins: as train_accuracy.unroll's."""
    cfg, layer = draft.cfg, draft.layer
    attn, mlp = layer.self_attn, layer.mlp
    dtype = next(draft.parameters()).dtype
    N = int(input_ids.shape[0])
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = fc_in[None].to(dtype)
    if draft.fc_norm is not None and cfg.fc_norm:  # project_hidden_states
        x = torch.cat([_rms(c, n.weight, n.eps) for n, c in zip(draft.fc_norm, x.chunk(cfg.num_aux, dim=-1))], dim=-1)
    hidden = draft.fc(x)  # [1, N, H]
    ids = torch.cat([input_ids[1:], input_ids.new_zeros(1)])[None]  # TargetHead.preprocess: padding(left=False)
    cos_all, sin_all = _cos_sin(cfg, N + ttt_steps, dtype)
    # base.py::prepare_decoder_attention_mask: _make_causal_mask (float32 finfo(dtype).min, cast) + _expand_mask
    # of an all-ones attention_mask (0); built in float64 for a float64 draft (SpecForge's float32 fill cannot hold
    # that finfo.min: it never runs in float64, the tests here do)
    col = torch.arange(N)
    wide = torch.promote_types(dtype, torch.float32)
    mask = torch.full((N, N), torch.finfo(dtype).min, dtype=wide)
    mask = mask.masked_fill_(col < (col + 1).view(N, 1), 0).to(dtype)[None, None]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    preds, logits_out = [], []
    scale = math.sqrt(d)
    for _ in range(ttt_steps):
        embeds = draft.embed_tokens(ids).to(dtype)
        residual = hidden
        h = torch.cat(
            (
                _rms(embeds, layer.input_layernorm.weight, layer.input_layernorm.eps),
                _rms(hidden, layer.hidden_norm.weight, layer.hidden_norm.eps),
            ),
            dim=-1,
        )
        q = attn.q_proj(h).view(1, N, nh, d).transpose(1, 2)
        kk = attn.k_proj(h).view(1, N, nkv, d).transpose(1, 2)
        vv = attn.v_proj(h).view(1, N, nkv, d).transpose(1, 2)
        pos = torch.arange(N) + len(keys)  # position_ids + lck
        cos, sin = cos_all[pos][None, None], sin_all[pos][None, None]
        q = (q * cos) + (_rotate_half(q) * sin)
        kk = (kk * cos) + (_rotate_half(kk) * sin)
        rep = nh // nkv  # repeat_kv
        keys.append(kk[:, :, None].expand(1, nkv, rep, N, d).reshape(1, nh, N, d))
        values.append(vv[:, :, None].expand(1, nkv, rep, N, d).reshape(1, nh, N, d))
        weights = torch.matmul(q, keys[0].transpose(2, 3)) / scale + mask
        for ki in keys[1:]:
            weights = torch.cat((weights, ((q * ki).sum(-1) / scale)[..., None]), dim=-1)
        weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights[..., :N], values[0])
        for i, vi in enumerate(values[1:], start=1):
            out = out + weights[..., N + i - 1][..., None] * vi
        hidden = residual + attn.o_proj(out.transpose(1, 2).contiguous().reshape(1, N, nh * d))
        m = _rms(hidden, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        hidden = hidden + mlp.down_proj(F.silu(mlp.gate_proj(m)) * mlp.up_proj(m))
        out_h = _rms(hidden, draft.norm.weight, draft.norm.eps) if logits_norm else hidden
        logits = draft.lm_head(out_h)[0, : N - 1]  # origin N-1 is the padded one
        logits_out.append(logits)
        preds.append(logits.argmax(-1))  # _acc_and_loss: logits.argmax(-1) in the draft's dtype
        if margins is not None:
            logits = logits.float()
            top = logits.topk(2, dim=-1).values if logits.shape[-1] > 1 else logits.repeat(1, 2)
            margins.append((top[:, 0] - top[:, 1]) / logits.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny))
        ids = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1)  # OnlineEagle3Model.forward: padding(left=False)
    return preds, logits_out


def config_norm_output(draft_dir: str | Path) -> bool | None:
    """The draft config's norm_output as written (top level, where both checkpoint formats keep it), None when
    absent: SpecForge reads an absent key as true, the reference draft's config parser as false."""
    try:
        raw = json.loads((Path(draft_dir) / "config.json").read_text())
    except (OSError, ValueError):  # load_draft has already refused an unreadable config in its own words
        return None
    value = raw.get("norm_output") if isinstance(raw, dict) else None
    return None if value is None else bool(value)
