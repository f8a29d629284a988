"""The reference computing like an engine whose matmuls run below float32 (`ref[matmul=tf32]`, `bf16`).

TF32 tensor cores (PyTorch's `allow_tf32`, `float32_matmul_precision="high"`) round each float32 input
of a matmul to 10 explicit mantissa bits and sum the products in float32; a bf16 GEMM rounds them to
7. Emulated here on the CPU, honestly: every float32 operand of a matmul (nn.Linear, torch.matmul and
its aliases, attention's two products, grouped MoE GEMMs) is rounded to nearest (ties to even) in
that many bits, and the product is computed by the same float32 kernel as before. Only float32
operands are rounded: a float64 calibration run or a bf16 case computes as it would.

This gives the tests an engine with the signature of reduced precision (difftest.compare.diagnose:
reduced_precision) and the harness a way to measure the floor of a case that declares one
(`precision:` in the case, difftest.run.case_run)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from difftest.api import MATMUL_PRECISIONS


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 `x` rounded to `bits` explicit mantissa bits, to nearest with ties to even, kept in
    float32 (NaN and infinities as they are; a value that rounds past the largest float becomes inf)."""
    if x.dtype != torch.float32 or bits >= 23:
        return x
    drop = 23 - bits
    b = x.contiguous().view(torch.int32)
    # adding half an ulp of the target format, less one, plus the kept lowest bit, then truncating, is
    # round-to-nearest-even on the magnitude bits (the sign bit is not touched by the carry)
    half = (1 << (drop - 1)) - 1
    keep_lsb = (b >> drop) & 1
    rounded = ((b + half + keep_lsb) & ~((1 << drop) - 1)).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x)


# the products a TF32 / bf16 GEMM computes: their first two tensor operands are rounded
_BINARY = {
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.mm,
    torch.Tensor.mm,
    torch.bmm,
    torch.Tensor.bmm,
    F.linear,
    torch._C._nn.linear,
}
# out = beta * input + alpha * (a @ b): the first argument is added, not multiplied
_ADD_THEN_BINARY = {torch.addmm, torch.Tensor.addmm, torch.baddbmm, torch.Tensor.baddbmm}
for _name in ("_grouped_mm",):  # transformers' MoE experts kernel, where this torch has it
    if hasattr(torch, _name):
        _BINARY.add(getattr(torch, _name))


class ReducedMatmul(TorchFunctionMode):
    """Within it, every float32 matmul rounds its operands to `bits` mantissa bits."""

    def __init__(self, bits: int):
        super().__init__()
        self.bits = bits

    def _r(self, t):
        return round_mantissa(t, self.bits) if isinstance(t, torch.Tensor) else t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _BINARY and len(args) >= 2:
            args = (self._r(args[0]), self._r(args[1]), *args[2:])
        elif func in _ADD_THEN_BINARY and len(args) >= 3:
            args = (args[0], self._r(args[1]), self._r(args[2]), *args[3:])
        elif func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """SDPA as its two matmuls (scores, then probabilities times values), each rounded: a fused
        attention kernel on TF32 tensor cores rounds both products' inputs."""
        if dropout_p:
            raise ValueError("ref[matmul=...]: attention with dropout (the reference runs in eval mode)")
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        # the mode is off inside its own handler: each product's operands are rounded here
        scores = torch.matmul(self._r(q), self._r(k).transpose(-2, -1)) * scale
        if is_causal:
            n, m = q.shape[-2], k.shape[-2]
            causal = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
            scores = scores.masked_fill(~causal, -math.inf)
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
        return torch.matmul(self._r(scores.softmax(-1)), self._r(v))


@contextmanager
def matmul_precision(precision: str | None) -> Iterator[None]:
    """Every float32 matmul computed inside rounds its inputs as `precision` does (None: as they are)."""
    if precision is None:
        yield
        return
    with ReducedMatmul(MATMUL_PRECISIONS[precision]):
        yield


def emulated(method: Callable) -> Callable:
    """An engine method (self, case, ...) run under the case's `matmul` setting (settings.py)."""

    @functools.wraps(method)
    def run(self, case, *args, **kwargs):
        with matmul_precision(self.settings_for(case).matmul):
            return method(self, case, *args, **kwargs)

    return run
