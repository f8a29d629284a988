"""compare's metrics beyond elementwise closeness: per-token profile, NaN/Inf counts, and the
distribution metrics of logits (top-1, top-k membership, KL, TV), eager and compiled alike."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

import difftest.compare.compare as compare_mod
from difftest.compare.compare import compare_tensor, is_logits
from difftest.compare.tolerances import DEFAULTS
from helpers import randn

dtypes = pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"]
)


def default_tol(dtype):
    """The dtype's default tolerance (test_compare's `tol` is the logits' own, by pattern)."""

    return DEFAULTS[str(dtype).removeprefix("torch.")]


@dtypes
def test_per_token_profile_locates_the_bad_rows(dtype):
    a = randn(2, 4, 8, dtype=dtype)
    b = a.clone()
    b[1, 2, 5] += 4
    b[0, 1, 0] += 2
    d = compare_tensor("draft.fc_out", a, b, default_tol(dtype))
    assert d.rows == 8 and d.rows_mismatched == 2 and d.worst_row == 6  # row = flattened leading dims
    assert [i for i, v in enumerate(d.row_mismatched) if v] == [1, 6]
    assert d.row_max_abs[6] == d.max_abs and d.row_max_abs[0] == 0.0
    assert d.row_cosine[0] == pytest.approx(1.0) and d.row_cosine[6] < 1.0
    assert "rows off 2/8 (worst row 6)" in d.summary()


@dtypes
def test_nan_and_inf_are_counted_per_side(dtype):
    a = randn(3, 6, dtype=dtype)
    a[:, 0] = float("-inf")
    b = a.clone()
    b[1, 2] = float("nan")
    b[2, 3] = float("inf")
    d = compare_tensor("draft.fc_out", a, b, default_tol(dtype))
    assert (d.nan_ref, d.nan_other, d.inf_ref, d.inf_other) == (0, 1, 3, 4)
    assert d.nonfinite_mismatch == 2


def test_logits_metrics_of_a_known_pair():
    ref = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    other = torch.tensor([[0.0, 1.0, 2.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    d = compare_tensor("draft.logits", ref, other, DEFAULTS["float32"], topk=2)
    assert (d.topk, d.top1_agree, d.topk_member) == (2, 1, 2)
    p, q = torch.softmax(ref[0], -1), torch.softmax(other[0], -1)
    kl0, tv0 = float((p * (p / q).log()).sum()), float(0.5 * (p - q).abs().sum())
    assert d.kl_max == pytest.approx(kl0, rel=1e-5) and d.kl_mean == pytest.approx(kl0 / 2, rel=1e-5)
    assert d.tv_max == pytest.approx(tv0, rel=1e-5) and d.tv_mean == pytest.approx(tv0 / 2, rel=1e-5)
    assert "top-1 agree 1/2, reference top-1 in engine top-2 2/2" in d.summary()


def test_logits_outside_the_draft_vocab_do_not_poison_kl():
    a = torch.tensor([[float("-inf"), 1.0, 2.0, float("-inf")]])
    d = compare_tensor("draft.logits_target", a, a.clone(), DEFAULTS["float32"])
    assert (d.kl_max, d.tv_max, d.top1_agree, d.topk_member) == (0.0, 0.0, 1, 1)
    b = a.clone()
    b[0, 2] = float("-inf")  # the reference's top-1 has no mass in the engine: KL is infinite
    assert compare_tensor("draft.logits_target", a, b, DEFAULTS["float32"]).kl_max == math.inf


def test_only_logits_get_distribution_metrics():
    assert [
        n
        for n in ["draft.logits", "draft.step2.logits_target", "target.logits", "draft.fc_out", "draft.layer0.attn_in"]
        if is_logits(n)
    ] == ["draft.logits", "draft.step2.logits_target", "target.logits"]
    a = randn(3, 5, dtype=torch.float32)
    assert compare_tensor("draft.fc_out", a, a + 1, DEFAULTS["float32"]).topk == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_kernel_gives_the_eager_numbers(dtype):
    """The fused Inductor path (large tensors the native kernel does not take: other devices, mixed
    dtypes) forced on a small pair: same statistics. The native kernel: tests/test_rowkernel.py."""
    pytest.importorskip("torch._inductor")
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler: Inductor cannot build the fused kernel here (difftest falls back to eager)")
    a = randn(37, 300, dtype=dtype, seed=4)
    a[:, ::11] = float("-inf")
    b = (a.float() + randn(37, 300, dtype=torch.float32, seed=5) * 0.03).to(dtype)
    b[3, 7] = float("nan")
    b[20, 100] = a[20, 100].float() + 50
    eager = compare_tensor("draft.logits_target", a, b, default_tol(dtype))
    old = compare_mod.row_stats.__globals__["COMPILE_MIN"]
    compare_mod.row_stats.__globals__["COMPILE_MIN"] = 0
    try:
        fused = compare_tensor("draft.logits_target", a, b, default_tol(dtype))
    finally:
        compare_mod.row_stats.__globals__["COMPILE_MIN"] = old
    from difftest.compare.rowstats import compile_status

    assert "compiled" in compile_status()
    for k in (
        "status",
        "mismatched",
        "nonfinite_mismatch",
        "max_abs",
        "max_abs_index",
        "rows_mismatched",
        "worst_row",
        "row_mismatched",
        "top1_agree",
        "topk_member",
        "nan_other",
        "inf_ref",
        "inf_other",
    ):
        assert getattr(fused, k) == getattr(eager, k), k
    for k in ("mean_abs", "cosine", "rel_diff", "max_rel", "kl_mean", "tv_mean", "tv_max"):
        assert getattr(fused, k) == pytest.approx(getattr(eager, k), rel=1e-4, abs=1e-7), k
