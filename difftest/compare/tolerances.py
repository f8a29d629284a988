"""Elementwise tolerances: information in every comparison, the verdict only where a case asks.

The verdict is difftest.compare.noise's (per-row error against a measured noise floor). A case's
`tolerances:` pattern makes the tensors it matches judged elementwise with these numbers;
for all others the elementwise counts are reported beside the noise verdict.

The defaults are looser than torch.testing's (`torch/testing/_comparison.py`,
float32 rtol 1.3e-6 / atol 1e-5) because two engines run different kernels with
different accumulation orders: a correctly wired engine lands within these, a miswired
one misses them by orders of magnitude. Elementwise rule, as torch.isclose:
|a - b| <= atol + rtol * |b| (b = the reference).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase

from difftest.base.dtypes import DType
from difftest.records.tolerance import TolerancePair


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    source: str = "default"

    def __str__(self) -> str:
        return f"atol={self.atol:g}, rtol={self.rtol:g} ({self.source})"


DEFAULTS: dict[str, Tolerance] = {
    DType.FLOAT32: Tolerance(atol=1e-4, rtol=1e-4, source="float32 default"),
    DType.FLOAT16: Tolerance(atol=1e-2, rtol=1e-2, source="float16 default"),
    DType.BFLOAT16: Tolerance(atol=5e-2, rtol=5e-2, source="bfloat16 default"),
}


def tolerance_for(name: str, dtype: str, overrides: Mapping[str, TolerancePair]) -> Tolerance:
    """The last matching override pattern (a case's `tolerances:`) wins, so specific patterns go after
    general ones; what a pattern leaves out (atol or rtol) keeps the value before it."""
    tol = DEFAULTS.get(dtype, DEFAULTS[DType.FLOAT32])
    for pattern, value in overrides.items():
        if fnmatchcase(name, pattern):
            atol = tol.atol if value.atol is None else value.atol
            rtol = tol.rtol if value.rtol is None else value.rtol
            tol = Tolerance(float(atol), float(rtol), f"case: {pattern}")
    return tol
