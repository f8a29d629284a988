"""The floating-point dtypes difftest speaks of, declared once.

A case computes in one of CASE_DTYPES; its calibration run computes in CALIBRATION (float64),
with the weights first rounded to the case's dtype where that is a half one (HALF). DType is a
`str` Enum, so a value compares, hashes, formats and serialises (JSON) as its name: "float32".
"""

from __future__ import annotations

from enum import Enum


class DType(str, Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT64 = "float64"

    # as its name wherever it is written (messages, file names, JSON); Python 3.11 changed what
    # format() of a str Enum gives, and workers may run another Python than the harness
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


CASE_DTYPES: tuple[DType, ...] = (DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16)  # what a case's `dtype:` takes
HALF: tuple[DType, ...] = (DType.BFLOAT16, DType.FLOAT16)  # their calibration run rounds the weights first
CALIBRATION = DType.FLOAT64  # the exact run a case's noise floor is measured against
# Formats an engine may run a float32 case's matmuls in (TF32 tensor cores, a bf16 GEMM): the explicit
# mantissa bits each matmul's inputs are rounded to (round to nearest), the products summed in float32.
# A case declares one per engine (`precision:`); the reference emulates them (`ref[matmul=tf32]`).
MATMUL_PRECISIONS: dict[str, int] = {"tf32": 10, "bf16": 7}


def matmul_unit_roundoff(precision: str) -> float:
    """The unit roundoff of a matmul format's inputs: 2^-11 for TF32, 2^-8 for bf16."""
    return 2.0 ** -(MATMUL_PRECISIONS[precision] + 1)


def torch_dtype(dtype: str):
    """The torch dtype of a DType (or its name); torch is imported only when asked."""
    import torch

    return getattr(torch, DType(dtype).value)
