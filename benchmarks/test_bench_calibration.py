"""Benchmark (pytest-benchmark): the cost of the noise-floor calibration (difftest.compare.noise) per case.

Not part of the test suite (pyproject's testpaths is tests/). Run:

    .venv/bin/python -m pytest benchmarks/test_bench_calibration.py --benchmark-only -s

The reference (`ref`) measures a case's noise floor by capturing every prompt a second time in
float64 (CaseRun.noise_floor). Issue 12's target: the calibration adds at most 25% to a case's
wall time. Measured per case (cases/tiny_llama.yaml, cases/tiny_deepseek_v3.yaml when its
fixtures are built; each in the case's dtype and in bfloat16), all in one run, without the
on-disk capture cache (a temporary DIFFTEST_CACHE whose fixtures/ links to the real one, and
Options(use_cache=False)):

  ref_captures  (a) the reference's captures in the case's dtype, every prompt; the worker is
                    started before the timing (its start-up is printed separately), so this is
                    model load + forward passes, what the calibration doubles
  calibration   (b) its extra work: the float64 captures (float64 model load included) +
                    measure_floor, after (a) in the same session
  run           (c) the whole case as a user sees it with --engines=ref,"ref[wiring=vllm]": a
                    fresh session, both workers started, every check in the plugin's order, the
                    report built and written. The time CaseRun.noise_floor spends inside it is
                    recorded too (the calibration as the run really pays it)
  cli               `difftest run CASE --engines=ref,"ref[wiring=vllm]" --no-capture-cache`
                    in a subprocess (interpreter and pytest start-up included; one round)

Printed at the end (visible with -s): per case the times, (b)/(a), (b)/(c), and what the
calibration adds to the run, in-run / (c - in-run): measured inside one run, so it is the figure
that machine load disturbs least (two separate runs of a case on a shared 2-core machine differ
by more than the calibration costs). Where (b) goes: the float64 captures are recaptured in the
warm worker (forward passes only) and the models are loaded again in this process (load only).
Nothing timing-related is asserted; the floor being measured is.

rel_err[DTYPE]: the calibration's per-row comparison (noise.row_rel_err: a capture in the case's
dtype against its float64 twin, in float64) on a Kimi-sized logits pair (DIFFTEST_BENCH_LOGITS,
default [1024 x 163840]; needs no fixtures): the path it takes (native, else eager) against the
eager path, min of 3 rounds each, against the memory-copy limit of the same two tensors, and peak
extra memory in a fresh process, printed with the machine line of test_bench_compare.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from difftest.checks import checks as checks_mod
from difftest.compare import noise
from difftest.compare import rowkernel
from difftest.compare import rowstats
from difftest.report import writer as report_mod
from difftest.report import report_files
from difftest.case.case import load_case
from difftest.run.engine import parse_engine_list
from difftest.base.errors import DifftestError
from difftest.records import CheckResult
from difftest.run.session import Options, Session
from difftest_engines.ref.draft_loading import load_draft
from difftest_engines.ref.engine import DTYPES as REF_DTYPES
from difftest_engines.ref.target import load_target

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bench_compare import _shape, best_of, machine_line, memory_limits

ROOT = Path(__file__).resolve().parent.parent
ENGINES = "ref,ref[wiring=vllm]"
ROUNDS = int(os.environ.get("DIFFTEST_BENCH_ROUNDS", "2"))
REAL_CACHE = Path(os.environ.get("DIFFTEST_CACHE") or Path.home() / ".cache" / "difftest")

# name -> (case file, fixtures it needs)
CASES = {
    "tiny_llama": ("cases/tiny_llama.yaml", ["tiny-llama", "tiny-llama-eagle3"]),
    "tiny_deepseek_v3": ("cases/tiny_deepseek_v3.yaml", ["tiny-deepseek-v3", "tiny-deepseek-v3-eagle3"]),
}
DTYPES = ["case", "bfloat16"]

RESULTS: dict[tuple[str, str], dict] = {}
REL_ERR: dict[str, dict] = {}


def _fixtures_built(names: list[str]) -> bool:
    roots = [p for p in (REAL_CACHE / "fixtures").glob("*") if p.is_dir()]
    return all(any((r / n).is_dir() for r in roots) for n in names)


@pytest.fixture(scope="module")
def cache_sharing_fixtures(tmp_path_factory):
    """A private DIFFTEST_CACHE (no captures from earlier runs) sharing the built fixtures."""
    root = tmp_path_factory.mktemp("difftest-cache")
    (root / "fixtures").symlink_to(REAL_CACHE / "fixtures", target_is_directory=True)
    old = os.environ.get("DIFFTEST_CACHE")
    os.environ["DIFFTEST_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("DIFFTEST_CACHE", None)
    else:
        os.environ["DIFFTEST_CACHE"] = old


@pytest.fixture(scope="module", autouse=True)
def print_calibration_ratios():
    yield
    print("\n" + "\n".join(calibration_ratio_lines()))


@pytest.fixture(scope="module", params=[(c, d) for c in CASES for d in DTYPES], ids=lambda p: f"{p[0]}-{p[1]}")
def case_file(request, tmp_path_factory, cache_sharing_fixtures):
    """The case YAML to run: the shipped file, or a copy with `dtype: bfloat16` (in a directory
    named cases/, which the plugin collects from; fixture: names make copying safe)."""
    name, dtype = request.param
    path, needs = CASES[name]
    if not _fixtures_built(needs):
        pytest.skip(f"{name}: fixtures {', '.join(needs)} not built in {REAL_CACHE / 'fixtures'} (difftest fixtures)")
    if dtype == "case":
        return name, str(ROOT / path)
    raw = yaml.safe_load((ROOT / path).read_text())
    raw["dtype"] = dtype
    d = tmp_path_factory.mktemp(f"{name}-{dtype}") / "cases"
    d.mkdir()
    out = d / f"{name}_{dtype}.yaml"
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    return name, str(out)


def _session(report_dir: Path) -> Session:
    engines = parse_engine_list(ENGINES)
    return Session(Options(engines=engines, reference=engines[0], use_cache=False, log_dir=report_dir / "logs"))


def _record(case, key: str, value) -> dict:
    entry = RESULTS.setdefault((Path(case.path).stem, case.dtype), {})
    entry.setdefault(key, []).append(value)
    return entry


def _captures(session: Session, case, spec) -> list:
    run = session.run(case)
    return [run.capture(spec, i) for i in range(len(case.prompts))]


def prepared_name(case) -> str:
    return f"{Path(case.path).stem} [{case.dtype}]"


def _float64(case):
    return dataclasses.replace(case, dtype=noise.CALIBRATION_DTYPE, path=f"{case.path}#{noise.CALIBRATION_DTYPE}")


def _again(case, tag: str):
    """The same case under another memo key: the session recaptures, the worker keeps its models."""
    return dataclasses.replace(case, path=f"{case.path}#{tag}")


@pytest.mark.parametrize("part", ["ref_captures", "calibration", "run", "cli"])
def test_calibration_cost(benchmark, case_file, part, tmp_path, cache_sharing_fixtures):
    name, path = case_file
    case = load_case(path)
    sessions: list[Session] = []
    state: dict = {}

    def fresh() -> Session:
        for s in sessions:
            s.close()
        sessions.clear()
        s = _session(tmp_path)
        sessions.append(s)
        return s

    try:
        if part == "ref_captures":

            def setup():
                s = fresh()
                spec = s.pool.calibration_spec()
                t = time.perf_counter()
                s.pool.client(spec)  # the worker starts outside the timing
                _record(s.run(case).prepared, "worker_start", time.perf_counter() - t)
                state.update(session=s, spec=spec)
                return (), {}

            def target():
                _captures(state["session"], case, state["spec"])

        elif part == "calibration":

            def setup():
                s = fresh()
                spec = s.pool.calibration_spec()
                _captures(s, case, spec)  # (a) first, as a run does
                state.update(session=s, spec=spec)
                return (), {}

            def target():
                s, spec = state["session"], state["spec"]
                prepared = s.run(case).prepared
                t = time.perf_counter()
                try:
                    pairs = list(zip(_captures(s, case, spec), _captures(s, _float64(prepared), spec)))
                except DifftestError as e:  # the run would fall back to an unmeasured floor
                    state.update(error=str(e).splitlines()[0], floor=None, t_cap=time.perf_counter() - t, t_floor=0.0)
                    return
                t_cap = time.perf_counter() - t
                floor = noise.measure_floor(pairs, prepared.dtype, "benchmark")
                t_floor = time.perf_counter() - t - t_cap
                state.update(floor=floor, t_cap=t_cap, t_floor=t_floor)

        elif part == "run":

            def setup():
                s = fresh()
                spent = []
                run = s.run(case)
                real = run.noise_floor

                def timed():
                    t = time.perf_counter()
                    try:
                        return real()
                    finally:
                        spent.append(time.perf_counter() - t)

                run.noise_floor = timed  # type: ignore[method-assign]
                state.update(session=s, spent=spent)
                return (), {}

            def target():
                s = state["session"]
                results, outcomes = [], {}
                for spec in s.options.engines:
                    is_ref = spec.id == s.options.reference.id
                    for check in checks_mod.checks_for(case, is_ref):
                        v = checks_mod.run_check(check, s.run(case), spec)
                        outcomes[f"{spec.id}::{check}"] = v.passed
                        outcome = "passed" if v.passed else "failed"
                        results.append(CheckResult(spec.id, check, outcome, v.message, v.data))
                report_files.write(report_mod.build(s.run(case).record(results)), tmp_path / "reports")
                state["outcomes"] = outcomes

        else:  # cli

            def setup():
                return (), {}

            def target():
                cmd = [
                    str(Path(sys.executable).with_name("difftest")),
                    "run",
                    path,
                    f"--engines={ENGINES}",
                    "--no-capture-cache",
                    f"--report-dir={tmp_path / 'cli-reports'}",
                ]
                out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
                state["cli"] = (out.returncode, out.stdout[-3000:] + out.stderr[-2000:])

        durations = []

        def timed_target():
            t = time.perf_counter()
            target()
            durations.append(time.perf_counter() - t)
            if part == "calibration":
                _record(case, "calibration_captures", state["t_cap"])
                _record(case, "measure_floor", state["t_floor"])
            if part == "run":
                _record(case, "run_noise_floor", sum(state["spent"]))

        rounds = 1 if part == "cli" else ROUNDS
        benchmark.pedantic(timed_target, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
        for d in durations:
            _record(case, part, d)
        entry = RESULTS[(Path(case.path).stem, case.dtype)]
        benchmark.extra_info.update({k: min(v) for k, v in entry.items() if isinstance(v[0], float)})

        # sanity (never timings)
        if part == "calibration":
            floor = state["floor"]
            if floor is None:
                pytest.fail(
                    f"{prepared_name(case)}: the reference cannot capture in float64 (the floor would be "
                    f"unmeasured): {state['error']}"
                )
            assert floor.measured and floor.tensors, floor.source
            assert all(tf.rows > 0 and tf.floor >= 0 for tf in floor.tensors.values())
            s, spec = state["session"], state["spec"]
            prepared = s.run(case).prepared
            # where (b) goes: the worker now holds both models, so a recapture is forward passes only
            t = time.perf_counter()
            _captures(s, _again(_float64(prepared), "again"), spec)
            _record(case, "float64_forward", time.perf_counter() - t)
            t = time.perf_counter()
            _captures(s, _again(prepared, "again"), spec)
            _record(case, "dtype_forward", time.perf_counter() - t)
            _record(case, "floor_tensors", len(floor.tensors))
            # the models alone, loaded in this process (imports warmed by a first load, untimed)
            load_target(prepared.target, REF_DTYPES[prepared.dtype])
            for dt, key in ((prepared.dtype, "dtype_load"), (noise.CALIBRATION_DTYPE, "float64_load")):
                t = time.perf_counter()
                target_model = load_target(prepared.target, REF_DTYPES[dt])
                load_draft(
                    prepared.draft,
                    target_embed=target_model.get_input_embeddings().weight.detach(),
                    target_lm_head=target_model.get_output_embeddings().weight.detach(),
                    dtype=REF_DTYPES[dt],
                )
                _record(case, key, time.perf_counter() - t)
                del target_model
        if part == "run":
            assert state["outcomes"], "no checks ran"
            assert state["spent"], "the run never measured the noise floor"
            floor = state["session"].run(case)._floor
            assert floor is not None and floor.measured, floor and floor.source
            _record(case, "run_failed_checks", sorted(k for k, ok in state["outcomes"].items() if not ok))
        if part == "cli":
            rc, tail = state["cli"]
            assert rc in (0, 1), tail  # 1: a check failed (a verdict), not a harness error
            _record(case, "cli_rc", rc)
    finally:
        for s in sessions:
            s.close()


def _rel_err_pair(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(capture in dtype, its float64 twin): the same values up to the dtype's rounding, plus noise."""
    rows, cols = _shape("DIFFTEST_BENCH_LOGITS", "1024x163840")
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(rows, cols, generator=g, dtype=torch.float64).mul_(3)
    return exact.to(dtype).add_(torch.randn(rows, cols, generator=g).mul_(1e-3).to(dtype)), exact


def _rel_err_memory(dtype: torch.dtype, path: str) -> int:
    code = f"""
import sys; sys.path[:0] = {[str(Path(__file__).parent), str(ROOT)]!r}
import torch
from test_bench_calibration import _rel_err_pair, peak_extra
from difftest.compare import noise
x, ref = _rel_err_pair(getattr(torch, {str(dtype).removeprefix("torch.")!r}))
noise.row_rel_err(x[:64], ref[:64], path={path!r})  # one-off set-up (and a kernel build): not counted
print(peak_extra(lambda: noise.row_rel_err(x, ref, path={path!r})))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_rel_err(benchmark, dtype):
    x, ref = _rel_err_pair(getattr(torch, dtype))
    noise.row_rel_err(x[:64], ref[:64])  # the kernel build, if any: not timed
    cols = x.shape[-1]
    native = rowstats.NATIVE_MIN <= x.numel() and rowkernel.supports(
        x.reshape(-1, cols), ref.reshape(-1, cols), mixed=True
    )
    path = "native" if native and rowstats.native_kernel() is not None else "eager"
    # the tensors bound as defaults: they are deleted below, before the memory is measured
    errs = benchmark.pedantic(
        lambda x=x, ref=ref: noise.row_rel_err(x, ref, path=path), rounds=3, iterations=1, warmup_rounds=0
    )
    eager_errs = noise.row_rel_err(x, ref, path="eager")
    torch.testing.assert_close(errs, eager_errs, rtol=1e-9, atol=0)
    r = REL_ERR[dtype] = {
        "path": path,
        "shape": list(x.shape),
        "seconds": benchmark.stats.stats.min,
        "eager_seconds": best_of(lambda x=x, ref=ref: noise.row_rel_err(x, ref, path="eager"), 3),
        "mib": (x.numel() * x.element_size() / 2**20, ref.numel() * ref.element_size() / 2**20),
        **memory_limits(x, ref),
    }
    del x, ref, errs, eager_errs
    r["memory"] = _rel_err_memory(getattr(torch, dtype), path), _rel_err_memory(getattr(torch, dtype), "eager")
    benchmark.extra_info.update({k: v for k, v in r.items() if k != "mib"})


def calibration_ratio_lines() -> list[str]:
    lines = [""]
    if REL_ERR:
        lines.append(machine_line())
    for dtype, r in REL_ERR.items():
        lines.append(
            f"rel_err {dtype} vs float64 {r['shape']} ({r['mib'][0]:.0f} + {r['mib'][1]:.0f} MiB), path {r['path']}: "
            f"{r['seconds']:.3f} s, eager path {r['eager_seconds']:.3f} s -> {r['eager_seconds'] / r['seconds']:.1f}x faster; "
            f"memory copy of both {r['copy_seconds']:.3f} s (read-only sum {r['read_seconds']:.3f} s) -> "
            f"{100 * r['copy_seconds'] / r['seconds']:.0f}% of the copy limit "
            f"({100 * r['read_seconds'] / r['seconds']:.0f}% of the read-only pass); "
            f"peak extra memory {r['memory'][0] / 2**20:.0f} MiB vs eager {r['memory'][1] / 2**20:.0f} MiB"
        )
    if not RESULTS:
        return lines
    lines.append(f"calibration cost (min over {ROUNDS} rounds; seconds; target: adds <= 25% to a case's wall time)")
    for (stem, dtype), r in RESULTS.items():
        m = lambda k, r=r: min(r[k]) if k in r else float("nan")  # noqa: E731
        a, b, c = m("ref_captures"), m("calibration"), m("run")
        in_run = m("run_noise_floor")
        lines.append(
            f"{stem} [{dtype}]: (a) ref captures {a:.2f} (worker start {m('worker_start'):.2f} before it); "
            f"(b) calibration {b:.2f} = float64 captures {m('calibration_captures'):.2f} (forward only "
            f"{m('float64_forward'):.2f}; {m('dtype_forward'):.2f} in {dtype}) + measure_floor {m('measure_floor'):.3f}; "
            f"model load alone (warm imports): float64 {m('float64_load'):.2f}, {dtype} {m('dtype_load'):.2f}"
        )
        lines.append(
            f"    (c) run {c:.2f} (noise_floor inside it: in-run {in_run:.2f}), CLI {m('cli'):.2f}"
            f" | (b)/(a) {b / a:.2f}  (b)/(c) {b / c:.2f}  adds in-run/(c - in-run) {in_run / (c - in_run):.1%}"
            + (f"  failed checks: {r['run_failed_checks'][-1]}" if r.get("run_failed_checks", [[]])[-1] else "")
        )
    return lines
