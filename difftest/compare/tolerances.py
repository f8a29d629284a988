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

from dataclasses import dataclass
from fnmatch import fnmatchcase


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    source: str = "default"

    def __str__(self) -> str:
        return f"atol={self.atol:g}, rtol={self.rtol:g} ({self.source})"


DEFAULTS: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-4, rtol=1e-4, source="float32 default"),
    "float16": Tolerance(atol=1e-2, rtol=1e-2, source="float16 default"),
    "bfloat16": Tolerance(atol=5e-2, rtol=5e-2, source="bfloat16 default"),
}


def tolerance_for(name: str, dtype: str, overrides: dict[str, dict]) -> Tolerance:
    """The last matching override pattern wins, so specific patterns go after general ones."""
    tol = DEFAULTS.get(dtype, DEFAULTS["float32"])
    for pattern, value in overrides.items():
        if fnmatchcase(name, pattern):
            tol = Tolerance(float(value.get("atol", tol.atol)), float(value.get("rtol", tol.rtol)), f"case: {pattern}")
    return tol
