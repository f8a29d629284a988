"""Benchmark (pytest-benchmark): a whole shipped case end to end, phase by phase, and the transfer
of a large capture from an engine's worker to the harness.

Not part of the test suite (pyproject's testpaths is tests/). Run:

    .venv/bin/python -m pytest benchmarks/test_bench_case.py --benchmark-only -s

case[ENGINES]: `difftest run cases/tiny_llama.yaml --engines=ENGINES --no-capture-cache` in a
    subprocess (the user's command: interpreter and pytest start, every engine worker started,
    every capture made, moved and compared, the noise floor's float64 captures, the report built
    and written), for ENGINES `ref`, and `ref,vllm` / `ref,sglang` where those environments exist
    (~/.cache/difftest/envs; skipped otherwise). A private DIFFTEST_CACHE (no earlier captures)
    links the real one's fixtures, environments and built kernels. Its wall time is split by the
    phases the run's report records (difftest.run.phase_clock: the `timings` of reports/<case>.json), the
    rest being what no phase covers (interpreter and pytest start, collection, the report's
    writing, the workers' exit). Printed: per phase and engine the seconds, and the harness's
    own share. One round per engine list (DIFFTEST_BENCH_ROUNDS for more); the machine's load
    (os.getloadavg) is printed with each figure.

transfer[MEDIUM]: a Kimi-width logits capture (DIFFTEST_BENCH_LOGITS, default [1024 x 163840]
    bf16, 320 MiB) from a worker to the harness, on the disk (a directory beside the capture
    cache) and in /dev/shm (where it exists):
      - through the real path: a worker (benchmarks/synthetic_engine.py, its tensor made once)
        answers a capture request (EnginePool.request: the worker writes the capture directory)
        and the harness loads it (EnginePool.load), min of 3 rounds, by phase;
      - in one process, the file write and read alone: before (safetensors' save_file and
        load_file, the previous path) and after (difftest.base.tensorfile), each with the anonymous
        memory the read adds (a copy) and a first pass over the loaded tensor.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from difftest.base import tensorfile
from difftest.records.capture import Capture
from difftest.case.case import Case
from difftest.run.engine import EngineSpec
from difftest.records.report import Report
from difftest.run.pool import EnginePool, Options
from difftest.run.protocol import CaptureRequest
from difftest.run.phase_clock import PHASES
from difftest.run.worker import WorkerClient

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from synthetic_engine import logits_shape, synthetic_logits  # noqa: E402
from test_bench_compare import machine_line  # noqa: E402

ROOT = BENCH.parent
CASE = "cases/tiny_llama.yaml"
ROUNDS = int(os.environ.get("DIFFTEST_BENCH_ROUNDS", "1"))
REAL_CACHE = Path(os.environ.get("DIFFTEST_CACHE") or Path.home() / ".cache" / "difftest")
# ref alone compares nothing; a second reference engine (miswired the way vLLM wires it) adds the
# comparisons and the noise floor's float64 calibration without any real engine
ENGINE_LISTS = ["ref", "ref,ref[wiring=vllm]", "ref,vllm", "ref,sglang"]
LINES: list[str] = []


def load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    print("\n" + "\n".join(["", machine_line(), *LINES]))


@pytest.fixture(scope="module")
def cache_without_captures(tmp_path_factory) -> Path:
    """A private DIFFTEST_CACHE: no captures from earlier runs; everything else the real one's."""
    root = tmp_path_factory.mktemp("difftest-cache")
    for entry in REAL_CACHE.iterdir():
        if entry.name not in ("captures", "shipped-runs"):
            (root / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return root


def env_python(name: str) -> Path:
    return REAL_CACHE / "envs" / name / "bin" / "python"


# -- a whole case ------------------------------------------------------------------------


def breakdown(report: Report, wall: float) -> list[str]:
    t = report.timings
    assert t is not None and t.phases, "the report records no timings"
    covered = t.harness_seconds + t.engine_seconds
    lines = [
        f"    wall {wall:.2f} s = engines {t.engine_seconds:.2f} + harness {t.harness_seconds:.2f} "
        f"({100 * t.harness_seconds / wall:.1f}% of the wall) + outside any phase {wall - covered:.2f} "
        f"(interpreter and pytest start, collection, report writing, workers' exit)"
    ]
    by_phase: dict[str, list] = {}
    for p in t.phases:
        by_phase.setdefault(p.phase, []).append(p)
    for name, rows in by_phase.items():
        parts = ", ".join(
            f"{p.engine or '-'}/{p.dtype or '-'} {p.seconds:.3f} s x{p.count}"
            + (f" {p.bytes / 2**20:.1f} MiB" if p.bytes else "")
            for p in rows
        )
        lines.append(f"    {name:<17} {PHASES[name][0]:<7} {sum(p.seconds for p in rows):8.3f} s  ({parts})")
    return lines


def start_cost() -> float:
    """A fresh interpreter importing what `difftest run` imports before any case is collected."""
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, pytest, difftest.plugin"], cwd=ROOT, check=True, timeout=600)
    return time.perf_counter() - t


def write_cost(report: Report, tmp_path: Path) -> float:
    from difftest.report import report_files

    t = time.perf_counter()
    report_files.write(report, tmp_path / "rewritten")
    return time.perf_counter() - t


@pytest.mark.parametrize("engines", ENGINE_LISTS)
def test_case(benchmark, engines, cache_without_captures, tmp_path):
    real = [e for e in engines.split(",") if not e.startswith("ref")]
    missing = [e for e in real if not env_python(e).exists()]
    if missing:
        pytest.skip(f"no environment for {', '.join(missing)} (scripts/setup-engine)")
    if not (REAL_CACHE / "fixtures").is_dir():
        pytest.skip(f"fixtures not built in {REAL_CACHE} (difftest fixtures)")
    runs: list[tuple[float, str, Path]] = []

    def run():
        report_dir = tmp_path / f"reports-{len(runs)}"
        cmd = [
            sys.executable,
            "-m",
            "difftest.cli",
            "run",
            CASE,
            f"--engines={engines}",
            "--no-capture-cache",
            f"--report-dir={report_dir}",
            *(f"--engine-python={e}={env_python(e)}" for e in real),
        ]
        env = dict(
            os.environ,
            DIFFTEST_CACHE=str(cache_without_captures),
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        before = load()
        t = time.perf_counter()
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        wall = time.perf_counter() - t
        assert out.returncode in (0, 1), out.stdout[-3000:] + out.stderr[-2000:]  # 1: a verdict, not a harness error
        runs.append((wall, f"{before} -> {load()}", report_dir))

    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    wall, loads, report_dir = min(runs)
    report = Report.load(report_dir / f"{Path(CASE).stem}.json")
    outcomes = sorted({c.outcome for c in report.checks})
    LINES.append(f"case {CASE} --engines={engines} (min of {len(runs)}; {loads}; outcomes {', '.join(outcomes)}):")
    LINES.extend(breakdown(report, wall))
    LINES.append(
        f"    of what no phase covers: an interpreter importing torch and the plugin {start_cost():.2f} s; "
        f"the report's writing (JSON, Markdown, HTML) {write_cost(report, tmp_path):.2f} s"
    )
    benchmark.extra_info.update(
        wall=wall, harness=report.timings.harness_seconds, engines=report.timings.engine_seconds
    )


# -- the transfer of a large capture -----------------------------------------------------


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("RssAnon:"))


def _first_pass(t: torch.Tensor) -> float:
    s = time.perf_counter()
    t.view(torch.int16).amax()  # every byte read once
    return time.perf_counter() - s


def _in_process(directory: Path, x: torch.Tensor, before: bool) -> dict:
    from safetensors.torch import load_file, save_file

    path = directory / "t.safetensors"
    best: dict = {}
    for _ in range(3):
        gc.collect()
        s = time.perf_counter()
        save_file({"target.logits": x}, str(path)) if before else tensorfile.write(path, {"target.logits": x})
        write = time.perf_counter() - s
        base = _rss_anon()
        s = time.perf_counter()
        y = (load_file(str(path)) if before else tensorfile.read(path))["target.logits"]
        read = time.perf_counter() - s
        first = _first_pass(y)
        copied = _rss_anon() - base
        assert torch.equal(y, x)
        del y
        path.unlink()
        for k, v in (("write", write), ("read", read), ("first_pass", first), ("anon_mib", copied / 2**20)):
            best[k] = min(best.get(k, float("inf")), v)
    return best


def _through_worker(directory: Path) -> dict:
    spec = EngineSpec("synthetic")
    pool = EnginePool(Options(engines=[spec], reference=spec, log_dir=directory / "logs"))
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
    client = WorkerClient(
        spec, "synthetic_engine:SyntheticEngine", sys.executable, directory / "worker.log", 600, env=env
    )
    case = Case(name="x", path="x.yaml", target="t", draft="d")
    rounds = []
    try:
        client.start()
        for i in range(3):
            out = directory / "cache" / f"k{i}"
            s = time.perf_counter()
            with pool.clock.phase("session", f"x{i}.yaml", "synthetic", "bfloat16"):
                pool.request(client, CaptureRequest(case, [1, 2], str(out)), out)
                capture = pool.load(out)
            total = time.perf_counter() - s
            first = _first_pass(capture.tensors["target.logits"])
            phases = {p.phase: p for p in pool.clock.timings(f"x{i}.yaml").phases}
            rounds.append(
                {
                    "total": total,
                    "first_pass": first,
                    "bytes": phases["transfer.read"].bytes,
                    **{k: phases[k].seconds for k in ("engine.capture", "transfer.write", "request", "transfer.read")},
                }
            )
            del capture
    finally:
        client.close()
    best = min(rounds, key=lambda r: r["total"])
    best["check"] = (
        "content checked"
        if torch.equal(Capture.load(directory / "cache" / "k0").tensors["target.logits"], synthetic_logits())
        else "CONTENT DIFFERS"
    )
    return best


MEDIA = {"disk": None, "shm": Path("/dev/shm")}


@pytest.mark.parametrize("medium", list(MEDIA))
def test_transfer(benchmark, medium, cache_without_captures, tmp_path):
    base = MEDIA[medium]
    if base is not None and not (base.is_dir() and os.access(base, os.W_OK)):
        pytest.skip(f"{base} is not a writable directory here")
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="difftest-bench-", dir=base or cache_without_captures))
    try:
        x = synthetic_logits()
        loads = [load()]
        worker = benchmark.pedantic(lambda: _through_worker(directory), rounds=1, iterations=1, warmup_rounds=0)
        old = _in_process(directory, x, before=True)
        new = _in_process(directory, x, before=False)
        loads.append(load())
    finally:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    mib = x.numel() * x.element_size() / 2**20
    assert worker["check"] == "content checked"
    rows, cols = logits_shape()
    LINES.append(
        f"transfer of logits [{rows}x{cols}] bf16 ({mib:.0f} MiB) on {medium} ({directory.parent}; "
        f"{' -> '.join(loads)}), min of 3:"
    )
    LINES.append(
        f"    worker -> harness: request {worker['total']:.3f} s = engine.capture {worker['engine.capture']:.3f} + "
        f"transfer.write {worker['transfer.write']:.3f} + request {worker['request']:.3f} + transfer.read "
        f"{worker['transfer.read']:.4f}; {worker['bytes'] / 2**20:.0f} MiB moved; first pass over the loaded "
        f"tensor {worker['first_pass']:.3f} s"
    )
    for name, r in (("before (safetensors save_file/load_file)", old), ("after (difftest.base.tensorfile)", new)):
        LINES.append(
            f"    {name}: write {r['write']:.3f} s, read {r['read']:.4f} s (+{r['anon_mib']:.0f} MiB anonymous "
            f"memory), first pass {r['first_pass']:.3f} s"
        )
    benchmark.extra_info.update({f"worker_{k}": v for k, v in worker.items() if isinstance(v, float)})
