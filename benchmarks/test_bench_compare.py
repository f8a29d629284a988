"""Benchmarks (pytest-benchmark): difftest's compare vs torch.testing.assert_close on large bf16 pairs.

Not part of the test suite (pyproject's testpaths is tests/). Run:

    .venv/bin/python -m pytest benchmarks/ --benchmark-only -s
    DIFFTEST_BENCH_LOGITS=4096x163840 DIFFTEST_BENCH_FC=4096x21504 .venv/bin/python -m pytest benchmarks/ ...

Shapes default to the issue's fc pair [4096 x 21504] and a logits pair of [1024 x 163840]
(the issue's [4096 x 163840] needs ~2.7 GB for the pair alone plus assert_close's ~6 GB
of temporaries; set DIFFTEST_BENCH_LOGITS to run it). Peak extra memory is the peak growth
of the process's RSS over the inputs while one comparison runs (sampled every millisecond).
Each benchmark also checks that the compiled kernel and the eager path agree.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from difftest import rowstats
from difftest.compare import compare_tensor
from difftest.tolerances import DEFAULTS

RESULTS: dict[tuple[str, str], dict] = {}


def _shape(var: str, default: str) -> tuple[int, int]:
    r, c = os.environ.get(var, default).lower().split("x")
    return int(r), int(c)


def _pair(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(rows, cols, generator=g).mul_(3).to(torch.bfloat16)
    b = a.clone()
    noise = torch.randn(rows, cols // 8, generator=g).mul_(0.05).to(torch.bfloat16)
    b[:, : cols // 8] += noise  # an engine with its own kernels: a slice of every row differs
    return a, b


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_extra(fn) -> int:
    """Peak RSS growth while fn runs, sampled every millisecond by a thread (VmHWM cannot be
    reset in every container, and it would include earlier peaks)."""
    gc.collect()
    base = _rss()
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return max(peak[0], _rss()) - base


def assert_close(a, b):
    try:
        torch.testing.assert_close(a, b)
    except AssertionError:
        pass


CASES = {
    "logits": ("draft.logits", lambda: _shape("DIFFTEST_BENCH_LOGITS", "1024x163840")),
    "fc_in": ("draft.fc_in", lambda: _shape("DIFFTEST_BENCH_FC", "4096x21504")),
}


@pytest.fixture(scope="module", autouse=True)
def ratios():
    """After the module: the ratios the issue asks for (printed; visible with -s)."""
    yield
    print("\n" + "\n".join(ratio_lines()))


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    name, shape = CASES[request.param]
    a, b = _pair(*shape())
    rowstats.row_stats(a[:64], b[:64], 0.05, 0.05, name.endswith("logits"), compiled=True)  # compile outside the timing
    yield request.param, name, a, b
    del a, b
    gc.collect()


def measure_memory(kind: str, impl: str) -> int:
    """Peak extra RSS of one comparison in a fresh process (a long-lived process keeps freed
    memory resident, which hides later allocations)."""
    code = f"""
import sys; sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parent.parent)]!r}
from test_bench_compare import CASES, _pair, assert_close, peak_extra
from difftest import rowstats
from difftest.compare import compare_tensor
from difftest.tolerances import DEFAULTS
name, shape = CASES[{kind!r}]
a, b = _pair(*shape())
if {impl!r} == "difftest":
    rowstats.row_stats(a[:64], b[:64], 0.05, 0.05, name.endswith("logits"), compiled=True)
    print(peak_extra(lambda: compare_tensor(name, a, b, DEFAULTS["bfloat16"])))
else:
    print(peak_extra(lambda: assert_close(a, b)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("impl", ["difftest", "assert_close"])
def test_compare_large_bf16(benchmark, pair, impl):
    kind, name, a, b = pair
    tol = DEFAULTS["bfloat16"]
    fn = (lambda: compare_tensor(name, a, b, tol)) if impl == "difftest" else (lambda: assert_close(a, b))
    benchmark.pedantic(fn, rounds=3, iterations=1, warmup_rounds=0)
    mem = measure_memory(kind, impl)
    RESULTS[(kind, impl)] = {"seconds": benchmark.stats.stats.min, "peak_extra_bytes": mem, "shape": list(a.shape)}
    benchmark.extra_info.update(RESULTS[(kind, impl)])
    if impl == "difftest":  # the compiled kernel agrees with the eager path (on 64 rows: eager is ~40x slower)
        assert rowstats.compile_status() == "compiled"
        a, b = a[:64], b[:64]
        old = rowstats.COMPILE_MIN
        try:
            rowstats.COMPILE_MIN = 0
            fast = compare_tensor(name, a, b, tol)
            rowstats.COMPILE_MIN = 1 << 62
            compare_tensor(name, a[:8], b[:8], tol)  # the first eager call pays one-off set-up
            t = time.perf_counter()
            eager = compare_tensor(name, a, b, tol)
            RESULTS[(kind, "difftest-eager")] = {"seconds": (time.perf_counter() - t) * pair[2].shape[0] / 64}
        finally:
            rowstats.COMPILE_MIN = old
        assert (fast.mismatched, fast.max_abs, fast.max_abs_index) == (eager.mismatched, eager.max_abs, eager.max_abs_index)
        assert fast.cosine == pytest.approx(eager.cosine, rel=1e-4)


def ratio_lines() -> list[str]:
    lines = []
    for kind in CASES:
        ours, theirs = RESULTS.get((kind, "difftest")), RESULTS.get((kind, "assert_close"))
        if not ours or not theirs:
            continue
        eager = RESULTS.get((kind, "difftest-eager"), {}).get("seconds", float("nan"))
        lines.append(
            f"{kind} {ours['shape']}: difftest {ours['seconds']:.3f} s (eager path, extrapolated from 64 rows: {eager:.1f} s), assert_close "
            f"{theirs['seconds']:.3f} s -> {theirs['seconds'] / ours['seconds']:.1f}x faster; peak extra memory "
            f"{ours['peak_extra_bytes'] / 2**20:.0f} MiB vs {theirs['peak_extra_bytes'] / 2**20:.0f} MiB -> "
            f"{ours['peak_extra_bytes'] / max(theirs['peak_extra_bytes'], 1):.2f} of it"
        )
    return lines
