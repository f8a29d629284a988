"""Tensor-by-tensor comparison of two captures, in data-flow order.

Large tensors (full-vocab logits, 3 x 7168-wide fc inputs) are compared in chunks of
the flattened tensor, on the device they live on, upcasting one chunk at a time to
float32: no full-size float32 copy is ever made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch

from difftest.capture import Capture
from difftest.tolerances import Tolerance, tolerance_for

CHUNK_ELEMENTS = 1 << 20


@dataclass
class TensorDiff:
    name: str
    status: str  # "ok" | "mismatch" | "missing" | "shape" | "allowed-missing"
    shape: list[int] = field(default_factory=list)
    numel: int = 0
    mismatched: int = 0
    max_abs: float = 0.0
    max_abs_index: list[int] = field(default_factory=list)
    ref_value: float = 0.0
    other_value: float = 0.0
    max_rel: float = 0.0
    mean_abs: float = 0.0
    cosine: float = 1.0
    rel_diff: float = 0.0  # SGLang's dump comparator: 1 - 2 sum(xy) / sum(x^2 + y^2)
    nonfinite_mismatch: int = 0  # NaN anywhere, or an infinity the other side lacks
    tolerance: str = ""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "allowed-missing")

    def summary(self) -> str:
        if self.status in ("missing", "allowed-missing", "shape"):
            return f"{self.name}: {self.detail}"
        pct = 100.0 * self.mismatched / max(self.numel, 1)
        idx = ", ".join(map(str, self.max_abs_index))
        head = (
            f"{self.name}: {self.mismatched}/{self.numel} elements ({pct:.1f}%) outside {self.tolerance}"
            if self.mismatched
            else f"{self.name}: all {self.numel} elements within {self.tolerance}"
        )
        return (
            f"{head}; greatest |diff| {self.max_abs:.4g} at [{idx}] (reference {self.ref_value:.4g}, "
            f"engine {self.other_value:.4g}); cos {self.cosine:.4f}, rel_diff {self.rel_diff:.2e}"
            + (f"; {self.nonfinite_mismatch} NaN/Inf mismatches" if self.nonfinite_mismatch else "")
        )


def compare_tensor(name: str, ref: torch.Tensor, other: torch.Tensor, tol: Tolerance) -> TensorDiff:
    if tuple(ref.shape) != tuple(other.shape):
        return TensorDiff(name, "shape", list(ref.shape), detail=f"shape {list(other.shape)} vs reference {list(ref.shape)}")
    other = other.to(ref.device)
    a_flat, b_flat = ref.reshape(-1), other.reshape(-1)
    n = a_flat.numel()
    mismatched = nonfinite = 0
    max_abs, max_at, max_rel = -1.0, 0, 0.0
    sum_abs = sum_ab = sum_aa = sum_bb = 0.0
    for start in range(0, n, CHUNK_ELEMENTS):
        a = a_flat[start : start + CHUNK_ELEMENTS].float()
        b = b_flat[start : start + CHUNK_ELEMENTS].float()
        same = a == b  # also true for equal infinities (-inf outside the draft vocab)
        diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
        diff = torch.nan_to_num(diff, nan=math.inf, posinf=math.inf)  # (nan_to_num's default clamps inf to the max float)
        finite = torch.isfinite(a) & torch.isfinite(b)
        # An infinite reference would make rtol * |a| infinite and pass anything; infinities match only exactly.
        close = same | (finite & (diff <= tol.atol + tol.rtol * a.abs()))
        mismatched += int((~close).sum())
        nonfinite += int((~finite & ~same).sum())
        chunk_max, chunk_at = diff.max(dim=0)
        if float(chunk_max) > max_abs:
            max_abs, max_at = float(chunk_max), start + int(chunk_at)
        rel = torch.where(finite & (a != 0), diff / a.abs(), torch.zeros_like(a))
        max_rel = max(max_rel, float(rel.max()))
        af, bf = torch.where(finite, a, 0.0), torch.where(finite, b, 0.0)
        sum_abs += float(torch.where(finite, diff, 0.0).sum())
        sum_ab += float((af * bf).sum())
        sum_aa += float((af * af).sum())
        sum_bb += float((bf * bf).sum())
    denom = math.sqrt(sum_aa * sum_bb)
    cosine = sum_ab / denom if denom > 0 else (1.0 if sum_aa == sum_bb else 0.0)
    rel_diff = 1.0 - 2.0 * sum_ab / (sum_aa + sum_bb) if (sum_aa + sum_bb) > 0 else 0.0
    index = list(torch.unravel_index(torch.tensor(max_at), ref.shape)) if ref.dim() else []
    return TensorDiff(
        name=name,
        status="mismatch" if mismatched else "ok",
        shape=list(ref.shape),
        numel=n,
        mismatched=mismatched,
        max_abs=max(max_abs, 0.0),
        max_abs_index=[int(i) for i in index],
        ref_value=float(a_flat[max_at]) if n else 0.0,
        other_value=float(b_flat[max_at]) if n else 0.0,
        max_rel=max_rel,
        mean_abs=sum_abs / max(n, 1),
        cosine=cosine,
        rel_diff=rel_diff,
        nonfinite_mismatch=nonfinite,
        tolerance=str(tol),
    )


@dataclass
class CaptureDiff:
    diffs: list[TensorDiff]  # data-flow order

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.diffs)

    def get(self, name: str) -> TensorDiff | None:
        return next((d for d in self.diffs if d.name == name), None)

    def first_divergence(self, names=None) -> TensorDiff | None:
        """The first failing tensor in data-flow order (a failing fc_in is named by its first failing chunk)."""
        for d in self.diffs:
            if d.ok or (names is not None and d.name not in names):
                continue
            if d.name == "draft.fc_in" and d.status == "mismatch":
                chunk = next((c for c in self.diffs if c.name.startswith("draft.fc_in.") and not c.ok), None)
                return chunk or d
            return d
        return None


def compare_captures(
    ref: Capture,
    other: Capture,
    dtype: str,
    tolerances: dict[str, dict] | None = None,
    allow_missing: list[str] | None = None,
) -> CaptureDiff:
    diffs = []
    other_names = set(other.names())
    for name in ref.names():
        if name not in other_names:
            allowed = any(fnmatchcase(name, p) for p in allow_missing or [])
            diffs.append(
                TensorDiff(name, "allowed-missing" if allowed else "missing",
                           detail="not captured by the engine" + (" (allowed by the case)" if allowed else ""))
            )  # fmt: skip
            continue
        diffs.append(compare_tensor(name, ref.get(name), other.get(name), tolerance_for(name, dtype, tolerances or {})))
    return CaptureDiff(diffs)


def top1_agreement(ref: Capture, other: Capture, names: list[str]) -> tuple[int, int]:
    """(agreeing rows, rows) of argmax over the last dim, summed over the given logits tensors."""
    agree = total = 0
    for name in names:
        if name in ref and name in other:
            a, b = ref.get(name), other.get(name)
            if a.shape[:-1] != b.shape[:-1]:
                continue
            agree += int((a.argmax(-1) == b.argmax(-1).to(a.device)).sum())
            total += a.shape[:-1].numel()
    return agree, total
