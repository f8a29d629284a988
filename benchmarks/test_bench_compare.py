"""Benchmarks (pytest-benchmark): difftest's compare vs torch.testing.assert_close on large pairs,
and against the memory-copy limit of the same tensors, measured in the same run.

Not part of the test suite (pyproject's testpaths is tests/). Run:

    .venv/bin/python -m pytest benchmarks/test_bench_compare.py --benchmark-only -s
    DIFFTEST_BENCH_LOGITS=1024x163840 DIFFTEST_BENCH_FC=4096x21504 DIFFTEST_BENCH_DTYPES=bfloat16,float16,float32 ...

Shapes default to a Kimi-sized logits pair [1024 x 163840], the same width as a draft's logits
scattered into it (`draft.logits_target`: 32000 finite columns, -inf elsewhere) and the fc-input
pair [4096 x 21504];
dtypes to bfloat16, float16 and float32. Printed at the end (visible with -s): first what the
figures depend on (CPU model, CPUs available, torch threads, torch version and CPU capability, the
comparison path taken), then per case and dtype:
  * difftest: compare_tensor, min of 3 rounds; the eager path extrapolated from 16 rows;
  * assert_close: torch.testing.assert_close, min of 3 rounds -> the speed-up;
  * the memory-copy limit: copying both tensors into preallocated tensors of their shape
    (`dst.copy_(src)`, torch's threads, min of 5 rounds; a fresh `empty_like` would add page faults
    and flatter the figure), and a read-only pass (`x.sum()`) for information -> the fraction
    of the copy limit difftest reaches (copy time / difftest time);
  * peak extra memory of one comparison in a fresh process: the peak growth of its RSS over the
    inputs, sampled every millisecond.
Each difftest benchmark also checks that the path it took agrees with the eager path.

`test_capture_store[whole|reduced]` saves and loads a Kimi-width draft capture (`draft.logits`
[T x 32000] and its `draft.logits_target` [T x 163840], T = DIFFTEST_BENCH_CAPTURE_ROWS, default
1024, bf16) as captures store it (difftest.records.scattered: the scattered tensor as its column
index) and, as the baseline of the same run, whole: file size, save and load seconds (min of 3).
"""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from difftest.compare import rowstats
from difftest.compare.compare import compare_tensor, is_logits
from difftest.base.settings import suggest
from difftest.records import scattered
from difftest.records.capture import Capture
from difftest.compare.tolerances import DEFAULTS

RESULTS: dict[tuple[str, str, str], dict] = {}
COPY_ROUNDS = 5


def _shape(var: str, default: str) -> tuple[int, int]:
    """The ROWSxCOLS shape in var; anything else stops the run in one line."""
    from synthetic_engine import parse_shape

    text = os.environ.get(var, default)
    shape = parse_shape(text)
    if shape is None:
        pytest.exit(f"{var}: expected ROWSxCOLS of positive integers (e.g. {default}), got {text!r}", returncode=4)
    return shape


def _pair(rows: int, cols: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(rows, cols, generator=g).mul_(3).to(dtype)
    b = a.clone()
    noise = torch.randn(rows, cols // 8, generator=g).mul_(0.05).to(dtype)
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


def best_of(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def memory_limits(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Seconds to copy both tensors (into preallocated ones) and to read both once (a sum)."""
    da, db = torch.empty_like(a), torch.empty_like(b)
    da.copy_(a), db.copy_(b)  # touch the destination pages outside the timing
    copy = best_of(lambda da=da, db=db: (da.copy_(a), db.copy_(b)), COPY_ROUNDS)  # bound: deleted below
    del da, db
    read = best_of(lambda: (a.sum(), b.sum()), COPY_ROUNDS)
    return {"copy_seconds": copy, "read_seconds": read}


DRAFT_VOCAB = 32000  # the draft vocabulary of the real-shape EAGLE-3 drafts (difftest_fixtures/real_shapes.py)


def _scattered_pair(rows: int, cols: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft's logits scattered into a target vocabulary of `cols` (-inf elsewhere), twice, a slice
    of every row's finite values differing: what two engines' `draft.logits_target` hold."""
    g = torch.Generator().manual_seed(0)
    src_a, src_b = _pair(rows, min(DRAFT_VOCAB, cols), dtype)
    where = torch.randperm(cols, generator=g)[: src_a.shape[1]].sort().values
    a = torch.full((rows, cols), float("-inf"), dtype=dtype)
    b = a.clone()
    a[:, where], b[:, where] = src_a, src_b
    return a, b


CASES = {
    "logits": ("draft.logits", lambda: _shape("DIFFTEST_BENCH_LOGITS", "1024x163840"), _pair),
    "logits_target": (
        "draft.logits_target",
        lambda: _shape("DIFFTEST_BENCH_LOGITS", "1024x163840"),
        _scattered_pair,
    ),
    "fc_in": ("draft.fc_in", lambda: _shape("DIFFTEST_BENCH_FC", "4096x21504"), _pair),
}
BENCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _dtypes(var: str, default: str) -> list[torch.dtype]:
    """The dtypes named in var; a name outside BENCH_DTYPES stops the run in one line."""
    out = []
    for name in os.environ.get(var, default).split(","):
        if name not in BENCH_DTYPES:
            pytest.exit(
                f"{var}: {name!r} is not one of {', '.join(BENCH_DTYPES)}{suggest(name, BENCH_DTYPES)}", returncode=4
            )
        out.append(BENCH_DTYPES[name])
    return out


DTYPES = _dtypes("DIFFTEST_BENCH_DTYPES", "bfloat16,float16,float32")


def machine_line() -> str:
    """What every figure depends on."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"machine: {model}; {available} CPUs available of {os.cpu_count()}; torch {torch.__version__} "
        f"({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads; "
        f"comparison kernel: {rowstats.compile_status()}"
    )


@pytest.fixture(scope="module", autouse=True)
def print_compare_ratios():
    """After the module: the ratios the issue asks for (printed; visible with -s)."""
    yield
    print("\n" + "\n".join(compare_ratio_lines()))


@pytest.fixture(
    scope="module",
    params=[(k, d) for k in CASES for d in DTYPES],
    ids=lambda p: f"{p[0]}-{str(p[1]).removeprefix('torch.')}",
)
def pair(request):
    kind, dtype = request.param
    name, shape, make = CASES[kind]
    a, b = make(*shape(), dtype)
    # the first comparison of a process may build the native kernel (once per cache): not timed
    compare_tensor(name, a[:64], b[:64], DEFAULTS[str(dtype).removeprefix("torch.")])
    yield kind, name, a, b
    del a, b
    gc.collect()


def measure_memory(kind: str, dtype: torch.dtype, impl: str) -> int:
    """Peak extra RSS of one comparison in a fresh process (a long-lived process keeps freed
    memory resident, which hides later allocations)."""
    code = f"""
import sys; sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parent.parent)]!r}
import torch
from test_bench_compare import CASES, assert_close, peak_extra
from difftest.compare.compare import compare_tensor
from difftest.compare.tolerances import DEFAULTS
name, shape, make = CASES[{kind!r}]
dtype = getattr(torch, {str(dtype).removeprefix("torch.")!r})
a, b = make(*shape(), dtype)
tol = DEFAULTS[str(dtype).removeprefix("torch.")]
fn = (lambda a, b: compare_tensor(name, a, b, tol)) if {impl!r} == "difftest" else assert_close
fn(a[:64], b[:64])  # one-off imports (torch.unravel_index's alone are ~36 MiB) and the kernel build: not counted
print(peak_extra(lambda: fn(a, b)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("impl", ["difftest", "assert_close"])
def test_compare_large(benchmark, pair, impl):
    kind, name, a, b = pair
    dname = str(a.dtype).removeprefix("torch.")
    tol = DEFAULTS[dname]
    fn = (lambda: compare_tensor(name, a, b, tol)) if impl == "difftest" else (lambda: assert_close(a, b))
    benchmark.pedantic(fn, rounds=3, iterations=1, warmup_rounds=0)
    mem = measure_memory(kind, a.dtype, impl)
    RESULTS[(kind, dname, impl)] = {
        "seconds": benchmark.stats.stats.min,
        "peak_extra_bytes": mem,
        "shape": list(a.shape),
    }
    benchmark.extra_info.update(RESULTS[(kind, dname, impl)])
    if impl != "difftest":
        return
    path = rowstats.choose_path(a, b)
    limits = memory_limits(a, b)
    RESULTS[(kind, dname, impl)].update(limits, path=path, bytes=a.numel() * a.element_size() * 2)
    benchmark.extra_info.update(limits, path=path)
    # the path taken agrees with the eager path (on 16 rows: eager is ~200x slower)
    a, b = a[:16], b[:16]
    fast = rowstats.row_stats(a, b, tol.atol, tol.rtol, is_logits(name), path=path)
    rowstats.row_stats(a[:8], b[:8], tol.atol, tol.rtol, is_logits(name), path="eager")  # one-off set-up
    t = time.perf_counter()
    eager = rowstats.row_stats(a, b, tol.atol, tol.rtol, is_logits(name), path="eager")
    RESULTS[(kind, dname, "difftest-eager")] = {"seconds": (time.perf_counter() - t) * pair[2].shape[0] / 16}
    for k in ("max_abs", "max_col", "mismatched", "nonfinite", "rank"):
        if k in eager:
            assert torch.equal(fast[k], eager[k]), k
    for k in ("sum_abs", "sum_sq", "sum_ab", "sum_aa", "sum_bb", "kl", "tv"):
        if k in eager:
            torch.testing.assert_close(fast[k], eager[k], rtol=1e-4, atol=1e-6, msg=k)


STORE: dict[str, dict] = {}


@pytest.mark.parametrize("form", ["whole", "reduced"])
def test_capture_store(benchmark, form, tmp_path, monkeypatch):
    """Save and load of a Kimi-width draft capture, as captures store it and whole (the baseline)."""
    rows = int(os.environ.get("DIFFTEST_BENCH_CAPTURE_ROWS", "1024"))
    src, _ = _pair(rows, DRAFT_VOCAB)
    full = scattered.scatter(
        src, torch.randperm(163840, generator=torch.Generator().manual_seed(1))[:DRAFT_VOCAB].sort().values, 163840
    )
    cap = Capture({"draft.logits": src, "draft.logits_target": full})
    if form == "whole":
        monkeypatch.setattr(scattered, "pack", lambda tensors: (dict(tensors), {}))
    out = tmp_path / "cap"
    benchmark.pedantic(lambda: cap.save(out), rounds=3, iterations=1, warmup_rounds=0)
    load = best_of(lambda: Capture.load(out), 3)
    back = Capture.load(out)
    assert torch.equal(back.tensors["draft.logits_target"], full)  # what a comparison reads, either way
    STORE[form] = {
        "rows": rows,
        "file_bytes": (out / "tensors.safetensors").stat().st_size,
        "save_seconds": benchmark.stats.stats.min,
        "load_seconds": load,
    }
    benchmark.extra_info.update(STORE[form])


def store_lines() -> list[str]:
    whole, reduced = STORE.get("whole"), STORE.get("reduced")
    if not whole or not reduced:
        return []
    return [
        f"capture store, draft.logits [{whole['rows']} x {DRAFT_VOCAB}] + draft.logits_target "
        f"[{whole['rows']} x 163840] bf16: file {whole['file_bytes'] / 2**20:.0f} MiB whole -> "
        f"{reduced['file_bytes'] / 2**20:.0f} MiB reduced ({reduced['file_bytes'] / whole['file_bytes']:.2f}x); "
        f"save {whole['save_seconds']:.3f} s -> {reduced['save_seconds']:.3f} s; "
        f"load {whole['load_seconds'] * 1e3:.1f} ms -> {reduced['load_seconds'] * 1e3:.1f} ms "
        "(whole: a mapped view; reduced: the target-vocabulary tensor rebuilt in memory)"
    ]


def compare_ratio_lines() -> list[str]:
    lines = [machine_line(), *store_lines()]
    for kind in CASES:
        for dtype in DTYPES:
            d = str(dtype).removeprefix("torch.")
            ours, theirs = RESULTS.get((kind, d, "difftest")), RESULTS.get((kind, d, "assert_close"))
            if not ours or not theirs:
                continue
            eager = RESULTS.get((kind, d, "difftest-eager"), {}).get("seconds", float("nan"))
            lines.append(
                f"{kind} {d} {ours['shape']} (2 x {ours['bytes'] / 2 / 2**20:.0f} MiB), path {ours['path']}: "
                f"difftest {ours['seconds']:.3f} s (eager path, extrapolated from 16 rows: {eager:.0f} s), "
                f"assert_close {theirs['seconds']:.3f} s -> {theirs['seconds'] / ours['seconds']:.1f}x faster; "
                f"memory copy of both {ours['copy_seconds']:.3f} s (read-only sum {ours['read_seconds']:.3f} s) -> "
                f"difftest at {100 * ours['copy_seconds'] / ours['seconds']:.0f}% of the copy limit "
                f"({100 * ours['read_seconds'] / ours['seconds']:.0f}% of the read-only pass); "
                f"peak extra memory {ours['peak_extra_bytes'] / 2**20:.0f} MiB vs "
                f"{theirs['peak_extra_bytes'] / 2**20:.0f} MiB"
            )
    return lines
