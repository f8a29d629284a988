"""The reference engine on a GPU, checked: what `scripts/gpu-check` runs (docs/gpu.md).

  prepare  (here, with the project set up): builds the fixtures of the shipped cases the check runs,
           packs the project and those fixtures into one tarball (under 50 MiB; its size printed).
           --dry-run lists what it would pack, one path a line, and builds nothing.
  run      (there, on a machine with one GPU and no network, from the unpacked tarball): installs the
           project (pip, no index, no dependencies; else by PYTHONPATH), then compares `ref` on the CPU
           with `ref[device=cuda]` in float32 and bfloat16 on the shipped cases, checks that a miswiring
           is still caught on CUDA, that the noise floor calibrated on CUDA (`ref[device=cuda]` as the
           reference) passes the CPU reference, records the TF32 defaults and what a user's TF32 does,
           and writes OUT/summary.md and OUT/summary.json. About 8 minutes at most.

Only the reference runs there: the vLLM and SGLang environments are far over what can be carried to
a machine without network (scripts/gpu_check.sh and scripts/gpu_check_sglang.sh build them where pip
reaches an index)."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = "difftest-gpu-check"  # the tarball's top folder: BUNDLE/project, BUNDLE/cache/fixtures/...
LIMIT_BYTES = 50 * 2**20
TOTAL_S = 480  # everything `run` does, installation included
# the shipped cases only the reference can run there, and what the miswired twin of each reads
CASES = {
    "tiny_llama": "sglang",  # SGLang's +1 on ids [2, 4, 5]: h3, h5, h6
    "tiny_deepseek_v3": "h3+h5+h6",  # the same +1 on a DeepSeek-V3 target (MLA + MoE)
    "tiny_deepseek_v3_mla_draft": None,  # the MLA draft: the correct wiring only
    "seed_miswired_training": "vllm",  # the seed's own bug: config ids [2, 4, 7] against training's [h0, h2, h4]
}
DTYPES = ("float32", "bfloat16")
TENSOR_CHECKS = ("fc_inputs", "draft_logits")
ENGINE_CHECKS = (*TENSOR_CHECKS, "top1_agreement", "accept_length")
# the noise floor measured on CUDA: `ref[device=cuda]` the reference (it calibrates), `ref` under test
CALIBRATE_ON_CUDA = (("tiny_llama", "float32"), ("tiny_llama", "bfloat16"), ("tiny_deepseek_v3", "float32"))
# a user's TF32 (torch reads this at start-up; difftest never sets it): its error is far above a float32 floor
TF32_ENV = {"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}


# -- prepare (here) ------------------------------------------------------------------------------------
def fixture_names() -> list[str]:
    """The `fixture:NAME` targets and drafts of the cases the check runs."""
    import yaml

    names: list[str] = []
    for case in CASES:
        data = yaml.safe_load((ROOT / "cases" / f"{case}.yaml").read_text())
        for key in ("target", "draft"):
            value = str(data.get(key) or "")
            if value.startswith("fixture:") and value[8:] not in names:
                names.append(value[8:])
    return names


def project_files() -> list[Path]:
    """What the project is: git's tracked and untracked-but-not-ignored files as they are in the work
    tree (a change not yet committed is checked too); without git, the tree less what .gitignore names."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
        ).stdout.decode()
        files = sorted({ROOT / p for p in listed.split("\0") if p})
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "reports", "__pycache__", ".cache"}
        files = sorted(
            p
            for p in ROOT.rglob("*")
            if p.is_file() and not (set(p.relative_to(ROOT).parts) & skip) and ".egg-info" not in str(p)
        )
    return [p for p in files if p.is_file() and not p.is_symlink()]


def fixtures_root() -> Path:
    from difftest_fixtures.cache import fixtures_dir

    return fixtures_dir()


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def prepare(out: Path, dry_run: bool) -> int:
    names = fixture_names()
    fixtures = fixtures_root()
    version = fixtures.name
    files = project_files()
    if dry_run:
        for p in files:
            print(f"project/{p.relative_to(ROOT)}")
        for name in names:
            print(f"cache/fixtures/{version}/{name}/")
            if not (fixtures / name).is_dir():
                print(f"gpu-check: {name} is not built yet: prepare builds it", file=sys.stderr)
        return 0
    print(f"gpu-check: building the fixtures {', '.join(names)} (seconds when built)", flush=True)
    subprocess.run([sys.executable, "-m", "difftest.cli", "fixtures", *names], check=True, cwd=ROOT)
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": _git("status", "--porcelain", "--untracked-files=no") not in ("",),
        "cases": list(CASES),
        "fixtures": names,
        "prepared_with": {"python": sys.version.split()[0], **_versions()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, "w:gz", compresslevel=6) as tar:
        for p in files:
            tar.add(p, arcname=f"{BUNDLE}/project/{p.relative_to(ROOT)}", recursive=False)
        for name in names:
            for p in sorted((fixtures / name).rglob("*")):
                if p.is_file() and ".locks" not in p.parts:
                    tar.add(p, arcname=f"{BUNDLE}/cache/fixtures/{version}/{name}/{p.relative_to(fixtures / name)}")
        data = json.dumps(manifest, indent=1).encode()
        info = tarfile.TarInfo(f"{BUNDLE}/MANIFEST.json")
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
    size = partial.stat().st_size
    if size >= LIMIT_BYTES:
        partial.unlink()
        print(
            f"gpu-check: the tarball would be {size / 2**20:.1f} MiB, over the 50 MiB a device run carries",
            file=sys.stderr,
        )
        return 1
    partial.replace(out)
    print(f"{out}: {size / 2**20:.1f} MiB (limit 50 MiB): {len(files)} project files, fixtures {', '.join(names)}")
    print(f"there: tar -xzf {out.name} && {BUNDLE}/project/scripts/gpu-check run --out DIR")
    return 0


def _versions() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


# -- run (there) ---------------------------------------------------------------------------------------
@dataclass
class Job:
    name: str
    case: str
    dtype: str
    engines: list[str]
    expect: dict[str, str]  # spec id -> "pass" (every engine check passes) or "catch" (the tensor checks fail)
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""


def jobs(device: str) -> list[Job]:
    on = f"ref[device={device}]"
    out = []
    for dtype in DTYPES:
        for case, miswired in CASES.items():
            engines, expect = ["ref", on], {on: "pass"}
            if miswired:
                wrong = f"ref[device={device},wiring={miswired}]"
                engines.append(wrong)
                expect[wrong] = "catch"
            out.append(Job(f"{dtype}/{case}", case, dtype, engines, expect, note="ref on the CPU calibrates"))
    for case, dtype in CALIBRATE_ON_CUDA:
        out.append(
            Job(
                f"{dtype}/{case}+floor-on-{device.partition(':')[0]}",
                case,
                dtype,
                [on, "ref"],
                {"ref": "pass"},
                note=f"{on} is the reference: the float64 noise floor measured on {device}",
            )
        )
    out.append(
        Job(
            "float32/tiny_llama+user-tf32",
            "tiny_llama",
            "float32",
            ["ref", on],
            {on: "tf32"},
            env=dict(TF32_ENV),
            note="a user's TF32 (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1): expected to fail the tensor checks, named",
        )
    )
    return out


def _say(start: float, message: str) -> None:
    print(f"[gpu-check {time.time() - start:5.0f}s] {message}", flush=True)


def install(work: Path, start: float) -> tuple[dict[str, str], str]:
    """The environment the runs get: the project pip-installed into WORK/site (no index, no
    dependencies), else on PYTHONPATH with its entry points declared beside it (from pyproject.toml)."""
    site = work / "site"
    shutil.rmtree(site, ignore_errors=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
         "--target", str(site), str(ROOT)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    if done.returncode == 0:
        env["PYTHONPATH"] = str(site)
        how = f"pip install --no-deps --no-index --no-build-isolation --target {site}"
    else:
        shutil.rmtree(site, ignore_errors=True)
        declare_entry_points(site)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site)])
        last = (done.stderr.strip().splitlines() or ["?"])[-1][:160]
        how = f"PYTHONPATH (pip failed: {last}); entry points from pyproject.toml in {site}"
    _say(start, f"installed: {how}")
    return env, how


def declare_entry_points(site: Path) -> None:
    """A dist-info naming the project's entry points (engines, fixture providers, the pytest plugin):
    what makes `fixture:NAME` and `--engines=ref` resolve with the project on PYTHONPATH alone."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = site / f"difftest-{project.get('version', '0')}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: difftest\nVersion: {project.get('version', '0')}\n")
    groups = dict(project.get("entry-points", {}))
    groups["console_scripts"] = project.get("scripts", {})
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in entries.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))


MACHINE = r"""
import json, os, sys, warnings
import torch, transformers
out = {"python": sys.version.split()[0], "nproc": os.cpu_count(), "torch": torch.__version__,
       "transformers": transformers.__version__, "cuda": str(torch.version.cuda),
       "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    out["gpu"] = torch.cuda.get_device_name(0)
    out["gpus"] = torch.cuda.device_count()
from difftest_engines.ref import device
out["tf32_defaults"] = device.precision()
out["tf32_defaults_on"] = device.tf32(out["tf32_defaults"])
print(json.dumps(out))
"""


def machine(env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", MACHINE], capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def case_copy(case: str, dtype: str, folder: Path) -> Path:
    """The shipped case with another dtype, everything else as shipped."""
    import yaml

    data = yaml.safe_load((ROOT / "cases" / f"{case}.yaml").read_text())
    data["dtype"] = dtype
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{case}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=120))
    return path


def run_job(job: Job, work: Path, env: dict[str, str], deadline: float) -> dict:
    folder = work / "jobs" / job.name.replace("/", "-")
    shutil.rmtree(folder, ignore_errors=True)
    case = case_copy(job.case, job.dtype, folder / "cases")
    command = [
        sys.executable, "-m", "difftest.cli", "run", str(case), f"--engines={','.join(job.engines)}",
        "--out", str(folder / "reports"), "--no-capture-cache", "-q",
    ]  # fmt: skip
    started = time.time()
    limit = max(10.0, deadline - started)
    with open(folder / "run.log", "w") as log:
        try:
            rc = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, env={**env, **job.env}, cwd=folder, timeout=limit
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    report = folder / "reports" / f"{job.case}.json"
    return {"job": asdict(job), "rc": rc, "wall_s": round(time.time() - started, 1), "report": str(report)}


def judge(result: dict) -> dict:
    """What the job's report says against what it should: per spec under test its checks' outcomes,
    its worst error/threshold, what its worker said of itself; `ok` where every expectation holds."""
    job = result["job"]
    try:
        report = json.loads(Path(result["report"]).read_text())
    except (OSError, ValueError):
        tail = Path(result["report"]).parent.parent / "run.log"
        last = tail.read_text().strip().splitlines()[-1:] if tail.exists() else ["no log"]
        return {**result, "ok": False, "why": f"no report (rc {result['rc']}): {last[0][:200] if last else ''}"}
    outcomes: dict[str, dict[str, str]] = {}
    for c in report.get("checks", []):
        outcomes.setdefault(c["engine"], {})[c["check"]] = c["outcome"]
    worst: dict[str, float] = {}
    for spec, prompts in (report.get("comparisons") or {}).items():
        for p in prompts:
            for t in p.get("tensors", []):
                ex = t.get("excess")
                if isinstance(ex, (int, float)) and ex == ex and ex != float("inf"):
                    worst[spec] = max(worst.get(spec, 0.0), float(ex))
    infos = {spec: (entry or {}).get("info") or {} for spec, entry in (report.get("engines") or {}).items()}
    problems = []
    for spec, want in job["expect"].items():
        got = outcomes.get(spec, {})
        if want == "pass":
            bad = [f"{c} {got.get(c, 'missing')}" for c in ENGINE_CHECKS if got.get(c) != "passed"]
        elif want == "catch":
            bad = [f"{c} {got.get(c, 'missing')} (should fail)" for c in TENSOR_CHECKS if got.get(c) != "failed"]
        else:  # tf32: the info must say TF32, and the tensor checks fail where it is on
            versions = infos.get(spec, {}).get("versions", {})
            on = "tf32" in str(infos.get(spec, {}).get("version", ""))
            bad = [] if on else [f"TF32 not on in the worker ({versions.get('allow_tf32', '?')}): nothing to judge"]
            if on:
                bad = [
                    f"{c} {got.get(c, 'missing')} (TF32 should fail it)"
                    for c in TENSOR_CHECKS
                    if got.get(c) != "failed"
                ]
        problems += [f"{spec}: {b}" for b in bad]
    floor = (report.get("noise_floor") or {}).get("source", "")
    return {
        **result,
        "ok": not problems,
        "why": "; ".join(problems),
        "outcomes": outcomes,
        "worst_excess": worst,
        "noise_floor": floor,
        "infos": infos,
    }


def summary_md(machine_info: dict, installed: str, results: list[dict], wall: float) -> str:
    lines = [
        "# difftest GPU check: the reference on the CPU against `ref[device=cuda]`",
        "",
        f"{sum(r['ok'] for r in results)}/{len(results)} jobs as expected, {wall:.0f} s in all.",
        "",
        "| machine | |",
        "|---|---|",
    ]
    for k, v in machine_info.items():
        lines.append(f"| {k} | {v} |")
    lines += [f"| install | {installed} |", ""]
    lines += [
        "| job | rc | wall s | as expected | noise floor | outcomes (specs under test) | worst err/threshold |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        job = r["job"]
        outs = "; ".join(
            f"`{spec}` " + ", ".join(f"{c}:{o}" for c, o in r.get("outcomes", {}).get(spec, {}).items())
            for spec in job["expect"]
        )
        worst = ", ".join(f"`{s}` {v:.3g}x" for s, v in (r.get("worst_excess") or {}).items())
        ok = "yes" if r["ok"] else f"**no**: {r['why']}"
        lines.append(
            f"| {job['name']} | {r['rc']} | {r['wall_s']} | {ok} | {r.get('noise_floor', '')} | {outs} | {worst} |"
        )
    lines += ["", "Engine infos of the CUDA specs (device, TF32 as the worker found it):", ""]
    seen = set()
    for r in results:
        for spec, info in (r.get("infos") or {}).items():
            if "device=" in spec and (spec, info.get("version")) not in seen:
                seen.add((spec, info.get("version")))
                lines.append(
                    f"- `{spec}` ({r['job']['name']}): {info.get('kernels')}; {json.dumps(info.get('versions'))}"
                )
    return "\n".join(lines) + "\n"


def keep_reports(reports: Path, dest: Path) -> None:
    """A job's reports and its run log beside the summary (small: the tiny cases), under plain file
    names (a spec id's brackets, commas and = become _: what any copy back from a machine keeps)."""
    files = sorted(reports.rglob("*")) if reports.is_dir() else []
    for f in [*files, reports.parent / "run.log"]:
        if f.is_file():
            rel = f.relative_to(reports) if f.is_relative_to(reports) else Path(f.name)
            target = dest.joinpath(*(re.sub(r"[^\w.-]", "_", part) for part in rel.parts))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, target)


def run(out: Path, device: str, only: list[str], budget: float) -> int:
    start = time.time()
    deadline = start + budget
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)
    bundle_cache = ROOT.parent / "cache"
    env, installed = install(work, start)
    if bundle_cache.is_dir():  # the fixtures the tarball carries; captures and kernels go beside them
        env["DIFFTEST_CACHE"] = str(bundle_cache)
    info = machine(env)
    _say(start, f"machine: {json.dumps(info)}")
    if device != "cpu" and not info.get("cuda_available"):
        print(f"gpu-check: torch {info.get('torch', '?')} here has no CUDA device: nothing to check", file=sys.stderr)
        (out / "summary.json").write_text(json.dumps({"machine": info, "install": installed, "jobs": []}, indent=1))
        return 2
    todo = [j for j in jobs(device) if not only or j.name in only]
    _say(start, f"{len(todo)} jobs side by side, until {budget:.0f} s after the start")
    threads = max(1, (os.cpu_count() or 2) // max(1, len(todo)))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    with ThreadPoolExecutor(max_workers=len(todo) or 1) as pool:
        results = list(pool.map(lambda j: run_job(j, work, env, deadline - 20), todo))
    judged = [judge(r) for r in results]
    for r in judged:
        _say(
            start,
            f"{r['job']['name']}: rc {r['rc']}, {r['wall_s']} s, {'as expected' if r['ok'] else 'NOT: ' + r['why']}",
        )
    wall = time.time() - start
    (out / "summary.json").write_text(
        json.dumps({"machine": info, "install": installed, "wall_s": round(wall, 1), "jobs": judged}, indent=1)
    )
    (out / "summary.md").write_text(summary_md(info, installed, judged, wall))
    for r in judged:
        keep_reports(Path(r["report"]).parent, out / "reports" / r["job"]["name"].replace("/", "-"))
    shutil.rmtree(work, ignore_errors=True)
    _say(start, f"summary: {out / 'summary.md'} ({sum(r['ok'] for r in judged)}/{len(judged)} as expected)")
    return 0 if all(r["ok"] for r in judged) else 1


def default_out() -> Path:
    """$OUT (the device machine's), else BUNDLE/out in an unpacked tarball, else build/gpu-check-out here."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return ROOT.parent / "out" if ROOT.parent.name == BUNDLE else ROOT / "build" / "gpu-check-out"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="here: build the fixtures, pack project + fixtures into one tarball")
    p.add_argument("--out", type=Path, default=ROOT / "build" / f"{BUNDLE}.tar.gz")
    p.add_argument("--dry-run", action="store_true", help="list what would be packed; build nothing")
    r = sub.add_parser("run", help="there: the comparisons on the GPU, OUT/summary.md")
    r.add_argument(
        "--out", type=Path, default=default_out(), help="where summary.md goes (default: $OUT, else beside the bundle)"
    )
    r.add_argument("--device", default="cuda", help="cuda (default), cuda:N; cpu runs the same jobs on the CPU")
    r.add_argument("--only", action="append", default=[], help="a job by name (float32/tiny_llama, ...); repeatable")
    r.add_argument("--budget", type=float, default=TOTAL_S, help=f"seconds for everything (default {TOTAL_S})")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        return prepare(args.out.resolve(), args.dry_run)
    return run(args.out.resolve(), args.device, args.only, args.budget)


if __name__ == "__main__":
    raise SystemExit(main())
