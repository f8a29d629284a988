"""The EAGLE-3 draft, in plain PyTorch, top to bottom.

EAGLE-3 (Li et al., 2025) drafts tokens for a target model from a fusion of the
target's hidden states. For a prompt position i the draft sees

    g_i   = fc( cat(h[a]_i, h[b]_i, h[c]_i) )          # "fc_in" -> "fc_out", width H
    e_i   = embed(t_{i+1})                             # the *next* token's embedding
    x_i   = cat( norm_in(e_i), norm_h(g_i) )           # width 2H
    r_i   = attn(x_i) + g_i   (or + norm_h(g_i) with norm_before_residual)
    p_i   = mlp(norm_post(r_i)) + r_i                  # "hidden_prenorm"
    logits_i = lm_head(norm(p_i))                      # over the draft vocab

and predicts t_{i+2}. Later draft steps feed p (or norm(p) with norm_output) back
in place of g and the drafted token in place of t_{i+1}; fc runs only at step 0.
Draft-vocab id d means target id d + d2t[d].

The flags mirror the engines' draft classes (vLLM 0.32.0
`model_executor/models/llama_eagle3.py::LlamaModel/LlamaDecoderLayer`, SGLang 0.5.23
`srt/models/llama_eagle3.py`): norm_before_fc (one RMSNorm over the whole fc input),
fc_norm (one RMSNorm per H-wide chunk), norm_before_residual, norm_output.

Checkpoint formats (read here; `draft_loading.load_draft` builds the draft from them):
  * HF/EAGLE: `architectures: [LlamaForCausalLMEagle3]`, keys `midlayer.*`, `fc`,
    `norm`, `lm_head`, `d2t`, `t2d`; layer ids top-level or in `eagle_config`;
    norm_before_residual defaults to False.
  * speculators: `speculators_model_type: eagle3`, `transformer_layer_config`,
    keys `layers.0.*`; norm_before_residual defaults to True
    (vLLM `transformers_utils/configs/speculators/algos.py::update_eagle3`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from difftest.api import check_config_numbers, refuse_on_errors, stored_tensors
from difftest.api import ConfigError
from difftest.api import load_safetensors, torch_load_tensors
from difftest_engines.ref.rope import RopeParameters, cos_sin, read_rope

Recorder = Callable[[str, torch.Tensor], None]


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (input embedding, d2t range)
    draft_vocab_size: int  # lm_head rows
    target_hidden_size: int
    num_aux: int  # number of H_target-wide chunks entering fc
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # the whole rope as the config spells it (difftest_engines/ref/rope.py); None: default rope with rope_theta
    rope_spec: RopeParameters | None = None
    attention_bias: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    format: str = "eagle"  # "eagle" (HF/EAGLE) or "speculators"
    layer_ids_top: list[int] | None = None  # eagle_aux_hidden_state_layer_ids at top level
    layer_ids_eagle_config: list[int] | None = None  # ... inside eagle_config
    # The draft layer's attention window as the config records it: `layer_types[0] == "sliding_attention"`
    # with `sliding_window` W (speculators >= 0.7 writes both into transformer_layer_config, every layer
    # sliding, W = 2048 by default). None: full causal attention. Applied where a trainer applies it
    # (difftest_engines.trainingdata.train_accuracy.scoring_window); the serving chain's default mask does not.
    sliding_window: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def rope(self) -> RopeParameters:
        return self.rope_spec or RopeParameters(theta=self.rope_theta)

    @property
    def layer_ids(self) -> list[int] | None:
        """The ids an engine reading either location would find (eagle_config first)."""
        return self.layer_ids_eagle_config or self.layer_ids_top


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Computed in float32 like every engine does (float64 stays float64: the noise-floor run), then cast back.
    wide = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(wide)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.to(wide)).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope(x: torch.Tensor, positions: torch.Tensor, params: RopeParameters) -> torch.Tensor:
    """Rotate-half rotary embedding (Llama/NeoX layout). x: [..., n, heads, d], positions: [..., n]."""
    d = x.shape[-1]
    wide = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 in the noise-floor run
    cos, sin = cos_sin(params, d, positions, wide)  # [..., n, d/2], float32 frequencies (rope.py)
    cos, sin = torch.cat([cos, cos], dim=-1)[..., None, :], torch.cat([sin, sin], dim=-1)[..., None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.to(wide) * cos + rotated.to(wide) * sin).type_as(x)


@dataclass
class KVCache:
    """Keys (already rotated) and values of the positions the draft has seen."""

    k: torch.Tensor  # [B, n, kv_heads, d]
    v: torch.Tensor

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        return KVCache(torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1))


class Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        nh, nkv, d, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(2 * H, nh * d, bias=cfg.attention_bias)  # input is cat(embeds, hidden)
        self.k_proj = nn.Linear(2 * H, nkv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(2 * H, nkv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * d, H, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, n, 2H]
        positions: torch.Tensor,  # [B, n]
        cache: KVCache | None,
        mask: torch.Tensor | None,  # [n, n_past + n] bool, True = may attend; None = causal after cache
    ) -> tuple[torch.Tensor, KVCache]:
        cfg = self.cfg
        B, n, _ = x.shape
        q = self.q_proj(x).view(B, n, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, n, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, n, cfg.num_key_value_heads, cfg.head_dim)
        q, k = rope(q, positions, cfg.rope), rope(k, positions, cfg.rope)
        cache = KVCache(k, v) if cache is None else cache.extend(k, v)
        n_kv = cache.k.shape[1]
        if mask is None:  # new queries sit after the cached positions
            past = n_kv - n
            mask = torch.arange(n_kv, device=x.device)[None, :] <= past + torch.arange(n, device=x.device)[:, None]
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        kk = cache.k.repeat_interleave(groups, dim=2).transpose(1, 2)  # [B, nh, n_kv, d]
        vv = cache.v.repeat_interleave(groups, dim=2).transpose(1, 2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask, scale=1 / math.sqrt(cfg.head_dim))
        y = y.transpose(1, 2).reshape(B, n, cfg.num_attention_heads * cfg.head_dim)
        return self.o_proj(y), cache


class MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """The draft's single ("mid") layer: attention over cat(embeds, hidden)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the token embeddings
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # on the fused hidden state
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


@dataclass
class DraftOutput:
    logits: torch.Tensor  # [B, n, draft_vocab]
    hidden_prenorm: torch.Tensor  # [B, n, H]
    hidden_next: torch.Tensor  # what the next draft step takes as hidden input
    cache: KVCache


class Eagle3Draft(nn.Module):
    """fc, embedding, the one layer, final norm, lm_head and d2t. `layer_class` builds the layer from
    the config: Llama's DecoderLayer here; a draft with another attention passes its own layer
    (eagle3_mla.py), which takes the same (x, positions, cache, mask) through `self_attn`."""

    def __init__(self, cfg: Eagle3Config, layer_class: Callable[[Eagle3Config], nn.Module] = DecoderLayer):
        super().__init__()
        self.cfg = cfg
        fc_in = cfg.num_aux * cfg.target_hidden_size
        self.input_norm = RMSNorm(fc_in, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
            if cfg.fc_norm
            else None
        )
        self.fc = nn.Linear(fc_in, cfg.hidden_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layer = layer_class(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # Draft id d -> target id d + d2t[d]; identity when the checkpoint has no map.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    # -- step 0 only: fuse the target's hidden states -------------------------------
    def combine(self, fc_in: torch.Tensor, record: Recorder | None = None) -> torch.Tensor:
        """[B, n, num_aux * H_target] -> [B, n, H]."""
        x = fc_in
        # the weights come with the checkpoint; the flag is read at run time, so the reference can
        # compute the draft as an engine that ignores it does (ref[norm_before_fc=false])
        if self.input_norm is not None and self.cfg.norm_before_fc:
            x = self.input_norm(x)
        if self.fc_norm is not None and self.cfg.fc_norm:
            chunks = x.chunk(self.cfg.num_aux, dim=-1)
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        out = self.fc(x)
        if record:
            record("fc_out", out)
        return out

    # -- every step ------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, n] target-vocab ids of the *next* tokens
        hidden: torch.Tensor,  # [B, n, H]: fc output (step 0) or the previous step's hidden_next
        positions: torch.Tensor,  # [B, n]
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
        record: Recorder | None = None,
    ) -> DraftOutput:
        cfg, layer = self.cfg, self.layer
        rec = record or (lambda name, t: None)
        embeds = self.embed_tokens(input_ids)
        rec("embeds", embeds)
        e = layer.input_layernorm(embeds)
        if cfg.norm_before_residual:
            h = layer.hidden_norm(hidden)
            residual = h
        else:
            residual = hidden
            h = layer.hidden_norm(hidden)
        x = torch.cat([e, h], dim=-1)  # [B, n, 2H]
        rec("layer0.attn_in", x)
        a, cache = layer.self_attn(x, positions, cache, mask)
        rec("layer0.attn_out", a)
        residual = a + residual
        m = layer.mlp(layer.post_attention_layernorm(residual))
        rec("layer0.mlp_out", m)
        prenorm = m + residual
        rec("hidden_prenorm", prenorm)
        out = self.norm(prenorm)
        logits = self.lm_head(out)
        rec("logits", logits)
        return DraftOutput(logits, prenorm, out if cfg.norm_output else prenorm, cache)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def logits_in_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocab logits into the target vocab; unmapped ids get -inf (as vLLM's compute_logits)."""
        full = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        targets = torch.arange(self.cfg.draft_vocab_size, device=logits.device) + self.d2t
        full[..., targets] = logits
        return full


# ---------------------------------------------------------------------------------------
# Checkpoint loading: both formats map onto the module names above.
# ---------------------------------------------------------------------------------------

_KEY_ALIASES = [  # (checkpoint prefix, ours), applied after stripping a leading "model."
    ("midlayer.", "layer."),
    ("layers.0.", "layer."),
    # SGLang's legacy names for the per-chunk fc norms (srt/models/llama_eagle3.py load_weights)
    ("aux_norm_low.", "fc_norm.0."),
    ("aux_norm_mid.", "fc_norm.1."),
    ("aux_norm_high.", "fc_norm.2."),
]


def canonical_key(key: str) -> str:
    """A draft checkpoint's tensor name as the reference draft names it (`model.` dropped, aliases read)."""
    key = key.removeprefix("model.")
    for src, dst in _KEY_ALIASES:
        if key.startswith(src):
            return dst + key[len(src) :]
    return key


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """safetensors (single or sharded) or a torch pickle loaded with weights_only=True. Every
    weight must be floating point (a cast from an integer tensor would silently invent values);
    the integer vocabulary maps d2t / t2d are the exception. Damaged files name themselves."""
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    # an index naming a shard that does not exist, or a truncated file, is refused before any load
    refuse_on_errors(stored_tensors(model_dir)[1], f"draft {model_dir}")
    files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        part = load_safetensors(f)
        out.update(part)
        origin.update(dict.fromkeys(part, f))
    if not files:
        for name in ("pytorch_model.bin", "model.pt", "model.bin"):
            f = model_dir / name
            if f.exists():
                out = _torch_load(f)
                origin = dict.fromkeys(out, f)
                break
        else:
            raise ConfigError(f"{model_dir}: no weights found (expected *.safetensors or pytorch_model.bin)")
    for key, value in out.items():
        if canonical_key(key) in ("d2t", "t2d"):
            continue
        if not value.is_floating_point():
            raise ConfigError(
                f"{origin[key]}: tensor {key} has dtype {str(value.dtype).removeprefix('torch.')}; "
                "draft weights must be floating point"
            )
    return out


def _torch_load(f: Path) -> dict[str, torch.Tensor]:
    """A torch pickle holding a flat state dict, loaded with weights_only=True (nothing else runs)."""
    data = torch_load_tensors(f)  # a refused or damaged pickle is one line naming f (difftest.rules.weight_files)
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()
    ):
        raise ConfigError(f"{f}: expected a state dict (tensor name -> tensor), got {type(data).__name__}")
    return data


def _ids(value: object, where: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise ConfigError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of integers, got {value!r}")
    return list(value)


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def _sliding_window(layer: dict, where: str, prefix: str) -> int | None:
    """The window of the draft's single layer, read as speculators reads it (0.7.0 - 0.9.0
    `models/eagle3/core.py::Eagle3DraftModel.__init__`: the layers whose `layer_types` entry is
    "sliding_attention" get `sliding_window`; `use_sliding_window` and `max_window_layers` are not
    read) and as vLLM's `model_executor/models/llama.py` reads `layer_types[layer_idx]`. A sliding
    layer with no window is plain causal there too (speculators' mask_mod skips a None window)."""
    types = layer.get("layer_types")
    if types is None or types == []:
        return None
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ConfigError(f"{where}: {prefix}layer_types must be a list of strings, got {types!r}")
    if types[0] not in ATTENTION_LAYER_TYPES:
        raise ConfigError(
            f"{where}: {prefix}layer_types[0] is {types[0]!r}; the reference draft runs "
            f"{' or '.join(map(repr, ATTENTION_LAYER_TYPES))} only"
        )
    if types[0] != "sliding_attention":
        return None
    window = layer.get("sliding_window")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConfigError(
            f"{where}: {prefix}sliding_window is {window!r} for a sliding_attention layer; "
            "expected a whole number of tokens >= 1"
        )
    return window


def parse_config(raw: dict, path: Path) -> Eagle3Config:
    where = str(path)
    sections = [(raw, "")]
    if isinstance(raw.get("transformer_layer_config"), dict):
        sections.append((raw["transformer_layer_config"], "transformer_layer_config."))
    check_config_numbers(sections, where)
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise ConfigError(
                f"{where}: speculators_model_type is {raw['speculators_model_type']!r}, expected 'eagle3'"
            )
        fmt = "speculators"
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ConfigError(f"{where}: transformer_layer_config missing (speculators format)")
        flags = raw
        norm_before_residual_default = True
        eagle_cfg: dict = {}
    else:
        fmt = "eagle"
        layer = raw
        flags = raw
        norm_before_residual_default = False
        eagle_cfg = raw.get("eagle_config") or {}
    try:
        H = int(layer["hidden_size"])
        nh = int(layer["num_attention_heads"])
        vocab = int(layer["vocab_size"])
        inter = int(layer["intermediate_size"])
    except KeyError as e:
        raise ConfigError(f"{where}: field {e.args[0]} missing") from None
    nkv = int(layer.get("num_key_value_heads") or nh)
    head_dim = int(layer.get("head_dim") or H // nh)
    # every rope type transformers knows, read as transformers 5 reads it (difftest_engines/ref/rope.py)
    rope_params = read_rope(layer, where, prefix="transformer_layer_config." if fmt == "speculators" else "")
    draft_vocab = int(flags.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab)
    target_hidden = int(flags.get("target_hidden_size") or layer.get("target_hidden_size") or H)
    ids_top = _ids(raw.get("eagle_aux_hidden_state_layer_ids"), f"{where}: eagle_aux_hidden_state_layer_ids")
    ids_ec = _ids(eagle_cfg.get("eagle_aux_hidden_state_layer_ids"), f"{where}: eagle_config")
    num_aux = int(layer.get("num_aux_hidden_states") or len(ids_ec or ids_top or [0, 0, 0]))
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ConfigError(f"{where}: num_hidden_layers={layer['num_hidden_layers']}; the reference draft has one layer")
    return Eagle3Config(
        hidden_size=H,
        intermediate_size=inter,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=head_dim,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        target_hidden_size=target_hidden,
        num_aux=num_aux,
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_params.theta,
        rope_spec=rope_params,
        attention_bias=bool(layer.get("attention_bias", False)),
        norm_before_fc=bool(eagle_cfg.get("norm_before_fc", flags.get("norm_before_fc", False))),
        fc_norm=bool(flags.get("fc_norm") or flags.get("use_aux_norm") or False),
        norm_before_residual=bool(flags.get("norm_before_residual", norm_before_residual_default)),
        norm_output=bool(flags.get("norm_output", False)),
        format=fmt,
        layer_ids_top=ids_top,
        layer_ids_eagle_config=ids_ec,
        sliding_window=_sliding_window(layer, where, "transformer_layer_config." if fmt == "speculators" else ""),
    )
