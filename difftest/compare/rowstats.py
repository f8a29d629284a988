"""The numeric core of compare: per-row statistics of a (reference, engine) tensor pair.

A tensor is viewed as rows x columns (rows = every leading dimension, i.e. positions;
columns = the last dimension). Every statistic is reduced per row, so the caller gets a
per-token error profile for free and global numbers by combining rows in float64.

One definition, three implementations:
  * eager (the definition): row/column blocks of at most CHUNK elements, each upcast to
    float32 on the tensors' own device; no float32 copy of a whole tensor is ever made.
  * native (difftest/compare/rowkernel.cpp, CPU pairs of NATIVE_MIN elements or more): every
    statistic, softmax metrics included, from one read of each tensor from memory, rows in
    parallel; extra memory one row pair of float32 per thread at most. Built with the system
    C++ compiler on first use and cached (difftest.compare.rowkernel). Counts, maxima, max_col and
    rank equal the eager path's; sums agree to float32 rounding (the native ones are float64
    across blocks).
  * compiled (torch.compile, Inductor): the same functions fused into a few loops; used for
    tensors of COMPILE_MIN elements or more that the native kernel does not take (other
    devices, mixed dtypes, non-unit column strides).
If a kernel cannot be built (no C++ compiler), the eager path is used and a warning says why.

Elementwise rule (as torch.isclose, b the reference): |a - b| <= atol + rtol * |ref|;
equal values (also equal infinities) always match; NaN never matches; an infinity
matches only the same infinity.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from difftest.compare import rowkernel

ROW_FIELDS = (
    "max_abs",
    "max_col",
    "mismatched",
    "nonfinite",
    "sum_abs",
    "sum_sq",
    "sum_ab",
    "sum_aa",
    "sum_bb",
    "max_rel",
    "nan_a",
    "nan_b",
    "inf_a",
    "inf_b",
)
SOFTMAX_FIELDS = ("rank", "kl", "tv")


def _elementwise(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> dict[str, torch.Tensor]:
    """Per-row statistics of one [rows, cols] block (any float dtype; upcast here)."""
    # isnan(x) is written x != x and isfinite(x) |x| < inf: same values, but Inductor vectorises
    # these comparisons while torch.isnan/isinf/isfinite cost ~4x the whole kernel on CPU.
    a, b = a.float(), b.float()
    same = a == b
    absa, absb = a.abs(), b.abs()
    finite = (absa < torch.inf) & (absb < torch.inf)
    diff = (a - b).abs()
    diff = torch.where(same, 0.0, torch.where(diff != diff, torch.inf, diff))  # NaN sorts as the greatest difference
    close = same | (finite & (diff <= atol + rtol * absa))
    max_abs, max_col = diff.max(dim=-1)
    af, bf = torch.where(finite, a, 0.0), torch.where(finite, b, 0.0)
    rel = torch.where(finite & (absa > 0), diff / absa, 0.0)
    return {
        "max_abs": max_abs,
        "max_col": max_col,
        "mismatched": (~close).sum(-1),
        "nonfinite": (~finite & ~same).sum(-1),
        "sum_abs": torch.where(finite, diff, 0.0).sum(-1),
        # squared differences summed directly (not aa + bb - 2ab, which cancels for near-equal rows)
        "sum_sq": torch.where(finite, diff * diff, 0.0).sum(-1),
        "sum_ab": (af * bf).sum(-1),
        "sum_aa": (af * af).sum(-1),
        "sum_bb": (bf * bf).sum(-1),
        "max_rel": rel.amax(-1),
        "nan_a": (a != a).sum(-1),
        "nan_b": (b != b).sum(-1),
        "inf_a": (absa == torch.inf).sum(-1),
        "inf_b": (absb == torch.inf).sum(-1),
    }


# Softmax metrics of full logits rows: the rank of the reference's top-1 in the engine's row
# (0: it is also the engine's top-1; ties count for it, and among tied reference maxima the one
# the engine likes best is taken), KL(P_ref || P_engine) and total variation. Three passes over
# a row, each one fused loop that materialises nothing (Inductor would otherwise schedule one
# loop per reduction and store a float32 softmax block):
#   1. the row maxima, fused with the elementwise statistics (_first_pass),
#   2. the softmax denominators S, the engine's logit at the reference's top-1, and
#      W = sum exp(a - max a) * (a - b), which gives KL without a normalised pass:
#      KL = sum p_a (log p_a - log p_b) = W / S_a - (lse_a - lse_b)   (_sums),
#   3. the rank and total variation, which need the denominators (_rank_tv).
# KL's difference of log-sum-exps is taken in float64 from the maxima and the denominators
# ((ma - mb) + (log S_a - log S_b)): a float32 lse near 10-20 carries ~1e-6 of rounding, as
# much as the KL of two near-equal rows. For the same reason TV's probabilities are
# exp(a - max) / S rather than exp(a - lse).
# No argmax/gather: Inductor does not vectorise them (10x the rest on CPU).


def _first_pass(a, b, atol: float, rtol: float, logits: bool) -> dict[str, torch.Tensor]:
    out = _elementwise(a, b, atol, rtol)
    if logits:
        out["ma"], out["mb"] = a.float().amax(-1), b.float().amax(-1)
    return out


def _sums(a, b, ma, mb) -> dict[str, torch.Tensor]:
    a, b = a.float(), b.float()
    ea = (a - ma).exp()
    return {
        "sa": ea.sum(-1),
        "sb": (b - mb).exp().sum(-1),
        "w": torch.where(ea > 0, ea * (a - b), 0.0).sum(-1),  # 0 * inf where p_ref == 0 is masked
        "at": torch.where(a == ma, b, -torch.inf).amax(-1),  # the engine's logit at the reference's top-1
    }


def _rank_tv(a, b, ma, mb, ia, ib, at) -> dict[str, torch.Tensor]:
    """ia, ib: 1 / S of each row (float32)."""
    a, b = a.float(), b.float()
    return {"rank": (b > at).sum(-1), "tv": 0.5 * ((a - ma).exp() * ia - (b - mb).exp() * ib).abs().sum(-1)}


def _softmax_rest(a, b, ma, mb, sums, rank_tv) -> dict[str, torch.Tensor]:
    """Passes 2 and 3 for one row block whose maxima are known; float64 results on CPU."""
    s = sums(a, b, ma[:, None], mb[:, None])
    ia, ib = 1.0 / s["sa"], 1.0 / s["sb"]
    out = _cpu(rank_tv(a, b, ma[:, None], mb[:, None], ia[:, None], ib[:, None], s["at"][:, None]))
    w, sa, sb, ma64, mb64 = (x.double().cpu() for x in (s["w"], s["sa"], s["sb"], ma, mb))
    kl = w / sa - ((ma64 - mb64) + (sa.log() - sb.log()))
    out["kl"] = kl.clamp_min(0.0)  # >= 0 in exact arithmetic; float32 sums may dip just below
    return out


CHUNK = 1 << 20  # elements per eager block
NATIVE_MIN = 1 << 18  # CPU tensors at least this large take the native kernel (smaller: eager, ~0.1 s at most,
#                       and no kernel build in processes that never compare anything large)
COMPILE_MIN = 1 << 24  # tensors at least this large that the native kernel does not take go through Inductor
COMPILED_BLOCK = 1 << 23  # elements per compiled call (bf16: 16 MiB per tensor, well inside L3)
PATHS = ("native", "compiled", "eager")


@dataclass
class _Compiled:
    fns: tuple | None = None
    error: str | None = None


@dataclass
class _Native:
    kernel: rowkernel.Kernel | None = None
    error: str | None = None


_COMPILED = _Compiled()
_NATIVE = _Native()


def _compiled_fns() -> tuple:
    if _COMPILED.fns is None:
        _COMPILED.fns = tuple(torch.compile(f, dynamic=True) for f in (_first_pass, _sums, _rank_tv))
    return _COMPILED.fns


def _reason(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def native_kernel() -> rowkernel.Kernel | None:
    """The native kernel, built and loaded on first call; None (and one warning) if it cannot be."""
    if _NATIVE.kernel is None and _NATIVE.error is None:
        try:
            _NATIVE.kernel = rowkernel.load()
        except Exception as e:
            _NATIVE.error = _reason(e)
            warnings.warn(
                f"difftest: native comparison kernel unavailable ({_NATIVE.error}); using the eager path", stacklevel=2
            )
    return _NATIVE.kernel


def takes_native(a2: torch.Tensor, b2: torch.Tensor, mixed: bool = False) -> bool:
    """Whether the native kernel is the automatic choice for this pair: NATIVE_MIN elements or more,
    a pair it takes as it is (rowkernel.supports), and a kernel that could be built."""
    return a2.numel() >= NATIVE_MIN and rowkernel.supports(a2, b2, mixed=mixed) and native_kernel() is not None


def require_native(a2: torch.Tensor, b2: torch.Tensor, mixed: bool = False) -> rowkernel.Kernel:
    """The native kernel for a pair it must take; RuntimeError naming why not otherwise."""
    kernel = native_kernel()
    if kernel is None:
        raise RuntimeError(f"native comparison kernel unavailable: {_NATIVE.error}")
    if not rowkernel.supports(a2, b2, mixed=mixed):
        raise RuntimeError(f"native kernel does not take {a2.dtype}/{b2.dtype} {a2.device} {tuple(a2.stride())}")
    return kernel


def choose_path(a2: torch.Tensor, b2: torch.Tensor) -> str:
    """The path row_stats takes for this pair when none is asked for (see the module docstring)."""
    if takes_native(a2, b2):
        return "native"
    if a2.numel() >= COMPILE_MIN and _COMPILED.error is None:
        return "compiled"
    return "eager"


def row_stats(
    a2: torch.Tensor,
    b2: torch.Tensor,
    atol: float,
    rtol: float,
    logits: bool,
    chunk: int | None = None,
    path: str | None = None,
) -> dict[str, torch.Tensor]:
    """Per-row statistics of [R, C] tensors on one device; returns float64/int64 tensors of [R] on CPU.

    path: None chooses (choose_path); "native" raises RuntimeError where the kernel is unavailable
    or does not take the pair; "compiled" falls back to eager (with a warning) if Inductor fails."""
    if path not in (None, *PATHS):
        raise ValueError(f"path must be one of {PATHS}, not {path!r}")
    path = path or choose_path(a2, b2)
    if path == "native":
        return require_native(a2, b2).row_stats(a2, b2, atol, rtol, logits)
    if path == "compiled" and _COMPILED.error is None:
        try:
            return _row_stats_compiled(a2, b2, atol, rtol, logits)
        except Exception as e:
            _COMPILED.error = _reason(e)
            warnings.warn(
                f"difftest: compiled comparison unavailable ({_COMPILED.error}); using the eager path", stacklevel=2
            )
    return _row_stats_eager(a2, b2, atol, rtol, logits, chunk or CHUNK)


def _cpu(d: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.double() if v.is_floating_point() else v.long()).cpu() for k, v in d.items()}


def _row_stats_compiled(a2, b2, atol, rtol, logits):
    first, sums, rank_tv = _compiled_fns()
    rows = max(1, COMPILED_BLOCK // max(a2.shape[1], 1))
    parts = []
    for r in range(0, a2.shape[0], rows):
        a, b = a2[r : r + rows], b2[r : r + rows]
        part = first(a, b, atol, rtol, logits)
        if logits:
            ma, mb = part.pop("ma"), part.pop("mb")
            parts.append({**_cpu(part), **_softmax_rest(a, b, ma, mb, sums, rank_tv)})
        else:
            parts.append(_cpu(part))
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _row_stats_eager(a2, b2, atol, rtol, logits, chunk):
    R, C = a2.shape
    out: dict[str, list[torch.Tensor]] = {}
    if C <= chunk:
        rows = max(1, chunk // max(C, 1))
        for r in range(0, R, rows):
            part = _cpu(_elementwise(a2[r : r + rows], b2[r : r + rows], atol, rtol))
            for k, v in part.items():
                out.setdefault(k, []).append(v)
        merged = {k: torch.cat(v) for k, v in out.items()}
    else:  # rows wider than a block: column blocks, merged per row
        merged = None
        for c in range(0, C, chunk):
            part = _cpu(_elementwise(a2[:, c : c + chunk], b2[:, c : c + chunk], atol, rtol))
            part["max_col"] = part["max_col"] + c
            merged = part if merged is None else _merge_columns(merged, part)
    if logits:
        rows = max(1, chunk // max(C, 1))  # one full row at least: softmax needs the whole row
        soft = []
        for r in range(0, R, rows):
            a, b = a2[r : r + rows], b2[r : r + rows]
            soft.append(_softmax_rest(a, b, a.float().amax(-1), b.float().amax(-1), _sums, _rank_tv))
        merged.update({k: torch.cat([p[k] for p in soft]) for k in SOFTMAX_FIELDS})
    return merged


def _merge_columns(x: dict, y: dict) -> dict:
    better = y["max_abs"] > x["max_abs"]  # strict: the first column block wins ties, as a flat scan would
    out = {
        k: x[k] + y[k]
        for k in (
            "mismatched",
            "nonfinite",
            "sum_abs",
            "sum_sq",
            "sum_ab",
            "sum_aa",
            "sum_bb",
            "nan_a",
            "nan_b",
            "inf_a",
            "inf_b",
        )
    }
    out["max_abs"] = torch.where(better, y["max_abs"], x["max_abs"])
    out["max_col"] = torch.where(better, y["max_col"], x["max_col"])
    out["max_rel"] = torch.maximum(x["max_rel"], y["max_rel"])
    return out


def compile_status() -> str:
    """For reports: the kernels large comparisons ran through in this process."""
    if _NATIVE.kernel is not None:
        used = f"native ({_NATIVE.kernel.variant})"
        return used + ("; compiled for the rest" if _COMPILED.fns is not None and _COMPILED.error is None else "")
    why = f"native kernel unavailable: {_NATIVE.error}" if _NATIVE.error else ""
    if _COMPILED.error:
        why = "; ".join(filter(None, [why, f"compile failed: {_COMPILED.error}"]))
        return f"eager ({why})"
    if _COMPILED.fns is not None:
        return "compiled" + (f" ({why})" if why else "")
    return f"eager ({why})" if why else "eager"
