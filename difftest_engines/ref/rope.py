"""Rotary position embedding: every rope type a Hugging Face config carries, as transformers computes it.

A rope turns position p into the angles p * inv_freq[j] (j = 0 .. d/2 - 1, d the rotated width) and
multiplies cos/sin by an attention scaling a. With e_j = theta^(-2j/d) the plain frequencies,
f = factor, M = max_position_embeddings, O = original_max_position_embeddings, L = the sequence length
(the largest position + 1):

  default   inv_freq_j = e_j                                                            a = 1
  linear    inv_freq_j = e_j / f                                                        a = 1
  dynamic   inv_freq_j = theta'^(-2j/d),  theta' = theta * (f * L'/M - (f - 1))^(d/(d-2)),
            L' = max(L, M): plain up to M, the base grows with the sequence past it     a = 1
  yarn      r_j = clamp((j - lo) / (hi - lo), 0, 1) ramps from the fast pairs (kept, e_j) to the
            slow ones (interpolated, e_j / f): inv_freq_j = e_j / f * r_j + e_j * (1 - r_j),
            lo/hi = c(beta_fast)/c(beta_slow) with c(b) = d * ln(O / (2 pi b)) / (2 ln theta)
            (floored/ceiled unless truncate is false, then clipped to [0, d - 1]; hi += 0.001
            when they meet), beta_fast 32 and beta_slow 1 by default;
            a = attention_factor, else m(f, mscale) / m(f, mscale_all_dim) when both are set
            (and non-zero), else m(f, 1), with m(s, mu) = 1 if s <= 1 else 0.1 mu ln s + 1
  llama3    by wavelength w_j = 2 pi / e_j: w_j < O / high_freq_factor keeps e_j,
            w_j > O / low_freq_factor takes e_j / f, and between the two
            s = (O / w_j - low) / (high - low) blends (1 - s) e_j / f + s e_j           a = 1
  longrope  inv_freq_j = 1 / (x_j * theta^(2j/d)), x = long_factor when L > O else short_factor;
            f defaults to M / O; a = attention_factor, else 1 if f <= 1 else sqrt(1 + ln f / ln O)

The frequencies are float32, computed in the order transformers computes them (and the engines, who
build theirs in float32 too), so the float64 noise-floor run widens the same frequencies; the angles
are widened by the caller. Semantics read (not copied) from transformers 5.19
`modeling_rope_utils.py` (`ROPE_INIT_FUNCTIONS`, `RotaryEmbeddingConfigMixin.standardize_rope_params`,
`dynamic_rope_update`): dynamic and longrope there depend on the largest position of the forward call,
which is the L taken here.

Config spellings: transformers 4's `rope_scaling` (type under `type` or `rope_type`) and transformers 5's
`rope_parameters`; as in transformers 5, a non-empty `rope_scaling` is read before `rope_parameters`, the
theta inside the chosen dict before the top-level `rope_theta` (10000 when neither), and yarn, llama3 and
longrope take `original_max_position_embeddings` from `max_position_embeddings` when the dict has none.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

import torch

from difftest.api import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
# the keys transformers' validation requires per type (original_max_position_embeddings is filled in)
REQUIRED_KEYS = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor"),
}
WITH_ORIGINAL_LENGTH = ("yarn", "llama3", "longrope")
DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class RopeParameters:
    """One config's rope, every value read; None where the config leaves a key to its default."""

    rope_type: str = "default"
    theta: float = DEFAULT_THETA
    max_position_embeddings: int | None = None  # M: dynamic's reference length, longrope's default factor
    factor: float | None = None
    original_max_position_embeddings: int | None = None  # O
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn, longrope
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None
    source: str = "rope_parameters"  # the config field it was read from (messages name it)

    @property
    def depends_on_length(self) -> bool:
        """dynamic and longrope frequencies change with the sequence length."""
        return self.rope_type in ("dynamic", "longrope")


def read_rope(
    section: dict,
    where: str,
    *,
    prefix: str = "",
    default_max_positions: int = 2048,
    aliases: dict[str, str] | None = None,
) -> RopeParameters:
    """The rope of one config section (a draft's config, or its transformer_layer_config: `prefix`
    names it in messages). An unknown type, or a type missing a key it needs, is one line naming the
    field. `aliases` maps an engine's own type names onto transformers' (deepseek_yarn -> yarn)."""
    scaling, params = section.get("rope_scaling"), section.get("rope_parameters")
    source, rope = "rope_parameters", {}
    for name, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is None or value == {}:
            continue
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {prefix}{name} must be a mapping, got {value!r}")
        source, rope = name, value
        break
    field = prefix + source
    type_key = "rope_type" if "rope_type" in rope else "type" if "type" in rope else "rope_type"
    kind = rope.get(type_key) or "default"
    kind = (aliases or {}).get(kind, kind)
    if kind not in ROPE_TYPES:
        close = difflib.get_close_matches(str(kind), ROPE_TYPES, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{where}: {field}.{type_key} {kind!r} is not a rope type the reference knows{hint} "
            f"(known: {', '.join(ROPE_TYPES)})"
        )
    for key in REQUIRED_KEYS[kind]:
        if rope.get(key) is None:
            raise ConfigError(f"{where}: {field}.{key} missing (required for {kind} rope)")
    partial = rope.get("partial_rotary_factor", section.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ConfigError(
            f"{where}: {field}.partial_rotary_factor is {partial}; the reference rotates whole heads (1.0) only"
        )
    theta = rope.get("rope_theta", section.get("rope_theta"))
    max_positions = section.get("max_position_embeddings") or default_max_positions
    original = rope.get("original_max_position_embeddings")
    if original is None and kind in WITH_ORIGINAL_LENGTH:
        original = max_positions

    def number(key: str) -> float | None:
        value = rope.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: {field}.{key} must be a number, got {value!r}")
        return float(value)

    def factors(key: str) -> tuple[float, ...] | None:
        value = rope.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, (int, float)) for v in value):
            raise ConfigError(f"{where}: {field}.{key} must be a list of numbers, got {value!r}")
        return tuple(float(v) for v in value)

    return RopeParameters(
        rope_type=kind,
        theta=float(theta) if theta is not None else DEFAULT_THETA,
        max_position_embeddings=int(max_positions),
        factor=number("factor"),
        original_max_position_embeddings=None if original is None else int(original),
        low_freq_factor=number("low_freq_factor"),
        high_freq_factor=number("high_freq_factor"),
        beta_fast=number("beta_fast"),
        beta_slow=number("beta_slow"),
        mscale=number("mscale"),
        mscale_all_dim=number("mscale_all_dim"),
        attention_factor=number("attention_factor"),
        truncate=bool(rope.get("truncate", True)),
        short_factor=factors("short_factor"),
        long_factor=factors("long_factor"),
        source=field,
    )


# ---------------------------------------------------------------------------------------
# The frequencies, one function per type (the module docstring's equations)
# ---------------------------------------------------------------------------------------


def _exponents(dim: int) -> torch.Tensor:
    """2j/d for j = 0 .. d/2 - 1, float32."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _plain(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(dim))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """m(s, mu): YaRN's attention temperature for a context stretched s times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _factor(p: RopeParameters) -> float:
    if p.factor is not None:
        return p.factor
    # longrope (and transformers' yarn) stretch M / O when the factor is left out
    assert p.max_position_embeddings is not None and p.original_max_position_embeddings is not None
    return p.max_position_embeddings / p.original_max_position_embeddings


def _dynamic(p: RopeParameters, dim: int, seq_len: int | None) -> torch.Tensor:
    reference = int(p.max_position_embeddings or 0)
    if seq_len is None or seq_len <= reference:
        return _plain(p.theta, dim)  # theta' = theta exactly up to M
    # past M transformers' forward forms theta' from the length as a tensor: in float32, as here
    length = torch.tensor(seq_len, dtype=torch.int64)
    f = _factor(p)
    theta = p.theta * ((f * length / reference) - (f - 1)) ** (dim / (dim - 2))
    return 1.0 / (theta ** _exponents(dim))


def _yarn(p: RopeParameters, dim: int) -> tuple[torch.Tensor, float]:
    f = _factor(p)
    original = int(p.original_max_position_embeddings or 0)
    beta_fast, beta_slow = p.beta_fast or 32, p.beta_slow or 1

    def correction_dim(rotations: float) -> float:  # the pair that turns `rotations` times over O positions
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(p.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' (and the engines') guard against 0/0
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the fast pairs keep e_j (extrapolate), 0: the slow ones take e_j / f
    pos_freqs = p.theta ** _exponents(dim)
    inv_freq = (1.0 / (f * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    if p.attention_factor is not None:
        scaling = p.attention_factor
    elif p.mscale and p.mscale_all_dim:
        scaling = yarn_mscale(f, p.mscale) / yarn_mscale(f, p.mscale_all_dim)
    else:
        scaling = yarn_mscale(f)
    return inv_freq, float(scaling)


def _llama3(p: RopeParameters, dim: int) -> torch.Tensor:
    e = _plain(p.theta, dim)
    f, low, high = float(p.factor or 1), float(p.low_freq_factor or 0), float(p.high_freq_factor or 0)
    original = int(p.original_max_position_embeddings or 0)
    wavelength = 2 * math.pi / e
    scaled = torch.where(wavelength > original / low, e / f, e)  # slow pairs: divided by f
    blend = (original / wavelength - low) / (high - low)
    smoothed = (1 - blend) * scaled / f + blend * scaled
    between = ~(wavelength < original / high) * ~(wavelength > original / low)
    return torch.where(between, smoothed, scaled)


def _longrope(p: RopeParameters, dim: int, seq_len: int | None) -> tuple[torch.Tensor, float]:
    original = int(p.original_max_position_embeddings or 0)
    f = _factor(p)
    if p.attention_factor is not None:
        scaling = p.attention_factor
    else:
        scaling = 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(original))
    long = seq_len is not None and seq_len > original
    chosen = p.long_factor if long else p.short_factor
    stretch = torch.tensor(chosen, dtype=torch.float32)
    if stretch.numel() != dim // 2:
        which = "long_factor" if long else "short_factor"
        raise ConfigError(f"{p.source}.{which} has {stretch.numel()} entries; the rotated width {dim} needs {dim // 2}")
    return 1.0 / (stretch * p.theta ** _exponents(dim)), float(scaling)


def inverse_frequencies(p: RopeParameters, dim: int, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, attention scaling of cos/sin) for a sequence of `seq_len` positions
    (None: at most the config's length, transformers' value at initialisation)."""
    if p.rope_type == "default":
        return _plain(p.theta, dim), 1.0
    if p.rope_type == "linear":
        return _plain(p.theta, dim) / _factor(p), 1.0
    if p.rope_type == "dynamic":
        return _dynamic(p, dim, seq_len), 1.0
    if p.rope_type == "yarn":
        return _yarn(p, dim)
    if p.rope_type == "llama3":
        return _llama3(p, dim), 1.0
    if p.rope_type == "longrope":
        return _longrope(p, dim, seq_len)
    raise ConfigError(f"{p.source}: rope type {p.rope_type!r} unknown (known: {', '.join(ROPE_TYPES)})")


def cos_sin(
    p: RopeParameters, dim: int, positions: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions[..., n] * inv_freq, times the attention scaling: [..., n, dim/2] in
    `dtype` (the angles are formed in it; float64 in the noise-floor run). The sequence length the
    length-dependent types see is the largest position + 1."""
    seq_len = int(positions.max()) + 1 if positions.numel() else None
    inv_freq, scaling = inverse_frequencies(p, dim, seq_len if p.depends_on_length else None)
    angles = positions.to(dtype)[..., None] * inv_freq.to(device=positions.device, dtype=dtype)
    return angles.cos() * scaling, angles.sin() * scaling
