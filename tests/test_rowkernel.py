"""The native row kernel (difftest/compare/rowkernel.cpp) gives the eager path's numbers (the definition,
difftest.compare.rowstats): counts, maxima, max_col and rank equal; sums, KL and TV to float32 rounding.

Both builds where they differ (x86-64-v3 on a CPU with AVX2, and generic), every dtype it takes,
on pairs with NaN, +-inf, -inf vocabulary masks, tied differences and tied reference maxima, zero,
identical and all -inf rows, squares that overflow float32, and shapes from one element to rows
wider than L2 and wider than the kernel's scratch. The same for noise.row_rel_err's float64 sums."""

from __future__ import annotations

import math

import pytest
import torch

from difftest.compare import noise

from difftest.compare import rowkernel

from difftest.compare import rowstats
from difftest.compare.compare import compare_tensor
from difftest.compare.tolerances import DEFAULTS

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SHAPES = [(1, 1), (3, 5), (7, 8), (6, 17), (8, 2048), (7, 2049), (6, 4100), (64, 1000), (2, 300_000)]
EXACT = ("max_abs", "max_col", "mismatched", "nonfinite", "nan_a", "nan_b", "inf_a", "inf_b", "max_rel", "rank")


def _variants() -> list[str]:
    return list(dict.fromkeys([rowkernel.default_variant(), "generic"]))


@pytest.fixture(scope="module", params=_variants())
def kernel(request) -> rowkernel.Kernel:
    if rowkernel._compiler() is None:
        pytest.skip("no C++ compiler: difftest compares on the eager path here")
    return rowkernel.load(request.param)  # a compiler that cannot build the kernel is a failure


@pytest.fixture(scope="module")
def native() -> rowkernel.Kernel:
    """The build row_stats itself loads (the tests that are not about one build)."""
    if rowkernel._compiler() is None:
        pytest.skip("no C++ compiler: difftest compares on the eager path here")
    k = rowstats.native_kernel()
    assert k is not None, rowstats.compile_status()
    return k


def nasty_pair(R: int, C: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(R, C, generator=g, dtype=torch.float64) * 3
    b = a + torch.randn(R, C, generator=g, dtype=torch.float64) * 0.05
    b = torch.where(torch.rand(R, C, generator=g) < 0.5, a, b)  # half the elements equal
    rows = torch.arange(R)[:, None]
    if R > 2:
        a[1], b[1] = 0.0, 0.0  # a zero row
        b[2] = a[2]  # an identical row
    if C > 4:
        a[:, ::5] = b[:, ::5] = -math.inf  # outside the draft vocabulary, on both sides
        b[(torch.rand(R, C, generator=g) < 0.01) & (rows % 2 == 0)] = -math.inf  # the engine masks more
        b[(torch.rand(R, C, generator=g) < 0.005) & (rows % 3 == 0)] = math.nan
        a[(torch.rand(R, C, generator=g) < 0.002) & (rows % 4 == 1)] = math.inf
        b[R // 2, 1::7] = 6e4 if dtype == torch.float16 else 1e30  # squares overflow float32
    if R > 3 and C > 8:
        a[3, 2] = a[3, 7] = a[3, -1] = a[3].max() + 1  # a tied reference top-1 (across blocks when wide)
        b[3, 4] = a[3, 4] + 5  # tied greatest differences: the first column is reported
        b[3, 6] = a[3, 6] + 5
    if R > 4:
        a[4], b[4] = -math.inf, -math.inf  # an all -inf row
    if R > 5:
        a[5, 0] = math.nan
    return a.to(dtype), b.to(dtype)


def clean_pair(R: int, C: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every value finite: the kernel's short paths."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(R, C, generator=g) * 3
    b = a + torch.randn(R, C, generator=g) * 0.05
    if C > 1:  # a reference top-1 tied across blocks of columns; the engine likes the later one best
        a[0, 1] = a[0, -1] = a[0].max() + 1
        b[0, 1], b[0, -1] = a[0, 1] - 1, a[0, 1] - 0.5
    return a.to(dtype), b.to(dtype)


def assert_same_row_sums(native: dict, eager: dict) -> None:
    assert native.keys() == eager.keys()
    for k in EXACT:
        if k in eager:
            x, y = native[k].double(), eager[k].double()
            assert torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num()), k
    for k in ("sum_abs", "sum_sq", "sum_aa", "sum_bb"):  # sums of non-negative terms
        torch.testing.assert_close(native[k], eager[k], rtol=2e-6, atol=0, equal_nan=True, msg=k)
    scale = (eager["sum_aa"] + eager["sum_bb"]) / 2  # bounds |sum_ab|'s terms
    x, y = native["sum_ab"], eager["sum_ab"]
    assert (((x - y).abs() <= 2e-6 * scale) | (x == y) | (x.isnan() & y.isnan())).all(), "sum_ab"
    for k in ("kl", "tv"):
        if k in eager:
            torch.testing.assert_close(native[k], eager[k], rtol=1e-4, atol=2e-6, equal_nan=True, msg=k)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_native_gives_the_eager_numbers(kernel, dtype, shape):
    tol = DEFAULTS.get(str(dtype).removeprefix("torch."), DEFAULTS["float32"])
    for make in (nasty_pair, clean_pair):
        a, b = make(*shape, dtype, seed=sum(shape))
        for logits in (False, True):
            eager = rowstats._row_stats_eager(a, b, tol.atol, tol.rtol, logits, rowstats.CHUNK)
            assert_same_row_sums(kernel.row_stats(a, b, tol.atol, tol.rtol, logits), eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_rows_wider_than_the_scratch(native, dtype):
    """Softmax numerators computed twice instead of kept (rowkernel.cpp's SCRATCH_MAX_COLS)."""
    a, b = nasty_pair(6, (1 << 20) + 3, dtype, seed=3)
    for logits in (False, True):
        eager = rowstats._row_stats_eager(a, b, 0.016, 0.016, logits, rowstats.CHUNK)
        assert_same_row_sums(native.row_stats(a, b, 0.016, 0.016, logits), eager)


def test_row_strides_and_threads(kernel):
    """Rows of a wider tensor (row stride > C), broadcast rows (stride 0), any thread count."""
    a, b = nasty_pair(9, 3000, torch.bfloat16, seed=5)
    eager = rowstats._row_stats_eager(a[:, :2500], b[:, :2500], 0.016, 0.016, True, rowstats.CHUNK)
    for threads in (1, 3, 16):
        assert_same_row_sums(kernel.row_stats(a[:, :2500], b[:, :2500], 0.016, 0.016, True, threads=threads), eager)
    row_a, row_b = a[7:8].expand(5, -1), b[7:8].expand(5, -1)
    assert_same_row_sums(
        kernel.row_stats(row_a, row_b, 0.016, 0.016, True),
        rowstats._row_stats_eager(row_a, row_b, 0.016, 0.016, True, rowstats.CHUNK),
    )


def test_row_stats_takes_the_native_path_for_large_cpu_pairs(native):
    a, b = clean_pair(600, 512, torch.bfloat16, seed=1)  # >= NATIVE_MIN elements
    assert rowstats.choose_path(a, b) == "native"
    assert rowstats.choose_path(a[:10], b[:10]) == "eager"  # small: no kernel needed
    assert rowstats.choose_path(a, b.float()) == "eager"  # mixed dtypes
    assert not rowkernel.supports(a.t(), b.t())  # a column stride: eager (or Inductor when huge)
    assert rowstats.compile_status().startswith("native")


def test_compare_tensor_is_the_same_on_both_paths(native, monkeypatch):
    a, b = nasty_pair(40, 3001, torch.bfloat16, seed=7)
    tol = DEFAULTS["bfloat16"]
    monkeypatch.setattr(rowstats, "NATIVE_MIN", 0)
    fast = compare_tensor("draft.logits_target", a, b, tol)
    monkeypatch.setattr(rowstats, "NATIVE_MIN", 1 << 62)
    eager = compare_tensor("draft.logits_target", a, b, tol)
    for k in (
        "status",
        "mismatched",
        "nonfinite_mismatch",
        "max_abs",
        "max_abs_index",
        "ref_value",
        "other_value",
        "rows_mismatched",
        "worst_row",
        "row_mismatched",
        "top1_agree",
        "topk_member",
        "nan_ref",
        "nan_other",
        "inf_ref",
        "inf_other",
        "max_rel",
        "differs",
        "rows_above",
    ):
        assert getattr(fast, k) == getattr(eager, k), k
    for k in ("mean_abs", "cosine", "rel_diff", "kl_mean", "kl_max", "tv_mean", "tv_max", "err"):
        assert getattr(fast, k) == pytest.approx(getattr(eager, k), rel=1e-4, abs=1e-7, nan_ok=True), k


def test_a_kernel_that_cannot_be_built_falls_back_to_eager_with_a_warning(monkeypatch):
    def fail(variant=None):
        raise RuntimeError("g++ -O3 ... failed: no space left on device")

    monkeypatch.setattr(rowstats, "_NATIVE", rowstats._Native())
    monkeypatch.setattr(rowkernel, "load", fail)
    a, b = clean_pair(600, 512, torch.float32, seed=2)
    with pytest.warns(UserWarning, match="native comparison kernel unavailable .*no space left"):
        out = rowstats.row_stats(a, b, 1e-5, 1e-5, True)
    assert_same_row_sums(out, rowstats._row_stats_eager(a, b, 1e-5, 1e-5, True, rowstats.CHUNK))
    assert "native kernel unavailable" in rowstats.compile_status()
    with pytest.raises(RuntimeError, match="unavailable"):
        rowstats.row_stats(a, b, 1e-5, 1e-5, True, path="native")


def test_the_build_is_cached_by_source_compiler_and_flags(native, monkeypatch, tmp_path):
    cxx = rowkernel._compiler()
    kernel = native
    assert kernel.path == rowkernel.library_path(kernel.variant, cxx) and kernel.path.is_file()
    assert rowkernel.library_path("generic", cxx) != rowkernel.library_path("x86-64-v3", cxx)
    edited = tmp_path / "rowkernel.cpp"
    edited.write_text(rowkernel.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(rowkernel, "SOURCE", edited)
    assert rowkernel.library_path(kernel.variant, cxx) != kernel.path
    monkeypatch.undo()

    def no_compiler(cmd, **kw):  # a cached build is found without compiling (--version is asked, no more)
        assert cmd[1:] == ["--version"], cmd
        return __import__("subprocess").CompletedProcess(cmd, 0, stdout=f"{cxx_id}\n", stderr="")

    cxx_id = rowkernel._compiler_id(cxx)
    monkeypatch.setattr(rowkernel.subprocess, "run", no_compiler)
    assert rowkernel.build(kernel.variant) == kernel.path


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"]
)
def test_the_tolerance_boundary_is_rounded_as_torch_does(native, dtype):
    """Differences at atol + rtol * |ref| and one ulp either side: mul and add rounded separately
    (an FMA would round once and move elements across the boundary)."""
    tol = DEFAULTS[str(dtype).removeprefix("torch.")]
    a = (torch.randn(4, 4096, generator=torch.Generator().manual_seed(11)) * 4).to(dtype).float()
    bound = torch.tensor(tol.atol, dtype=torch.float32) + torch.tensor(tol.rtol, dtype=torch.float32) * a.abs()
    step = torch.tensor([-1, 0, 1, 0]).repeat(1024)[None, :]  # below, at, above the bound
    d = torch.where(
        step < 0, bound.nextafter(torch.zeros(())), torch.where(step > 0, bound.nextafter(bound * 2), bound)
    )
    b = a + d
    keep = (b - a).abs() == d  # pairs whose float32 difference is the intended one
    b = torch.where(keep, b, a)
    out = native.row_stats(a, b, tol.atol, tol.rtol, False)
    eager = rowstats._row_stats_eager(a, b, tol.atol, tol.rtol, False, rowstats.CHUNK)
    assert torch.equal(out["mismatched"], eager["mismatched"]) and 0 < int(eager["mismatched"].sum()) < a.numel()


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 2049), (2, 300_000)], ids=lambda s: "x".join(map(str, s)))
def test_native_rel_err_gives_the_eager_numbers(kernel, shape):
    """noise.row_rel_err (the calibration's float64 comparison), every pair of dtypes: a capture
    against its float64 twin, and same-dtype pairs."""
    R, C = shape
    for dx in DTYPES:
        for dr in dict.fromkeys([torch.float64, dx]):
            x, ref = nasty_pair(R, C, torch.float64, seed=C)
            if R > 1:
                x[R - 1] = ref[R - 1]  # an exact row: error 0
            x[0, 0] = ref[0, 0] * 1e200 if C > 1 else x[0, 0]  # a square beyond float64 (or inf once cast)
            x, ref = x.to(dx), ref.to(dr)
            s = kernel.rel_err_sums(x, ref)
            native = noise._rel_err(s["num"], s["den"], s["bad"] > 0)
            torch.testing.assert_close(
                native, noise.row_rel_err(x, ref, path="eager"), rtol=1e-12, atol=0, equal_nan=True
            )


def test_row_rel_err_takes_the_native_path_for_large_cpu_pairs(native, monkeypatch):
    x, ref = clean_pair(600, 512, torch.bfloat16, seed=4)  # >= NATIVE_MIN elements
    ref = ref.double()
    calls, real = [], rowkernel.Kernel.rel_err_sums

    def counted(self, x2, r2, threads=None):
        calls.append(tuple(x2.shape))
        return real(self, x2, r2, threads)

    monkeypatch.setattr(rowkernel.Kernel, "rel_err_sums", counted)
    torch.testing.assert_close(noise.row_rel_err(x, ref), noise.row_rel_err(x, ref, path="eager"), rtol=1e-12, atol=0)
    noise.row_rel_err(x[:4], ref[:4])  # small: eager
    assert calls == [(600, 512)]
