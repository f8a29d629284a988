"""The independent tiny-models matrix (issue 12): build the models, write the cases, optionally run them.

    .venv/bin/python scripts/independent_matrix.py DIR                       # build + write DIR/cases, DIR/miswired/cases
    .venv/bin/python scripts/independent_matrix.py DIR --run --engines ref,vllm,sglang
    .venv/bin/python scripts/independent_matrix.py DIR --run --engines ref --miswired
    .venv/bin/python scripts/independent_matrix.py DIR --exports --run     # + the miswired exports
    .venv/bin/python scripts/independent_matrix.py --table ROOT            # the matrix of a finished run

Models and cases: tests/independent_models.py. --run runs one pytest session per engine, the
reference alone first (its captures are then cached for the others), then `--engines=REF,ENGINE`
for each other engine, reports in DIR/reports/<engine>/, and prints each session's wall time and a
table of per-case, per-engine check outcomes (P passed, F failed, E error, S skipped) with the
first line of each failing message. --miswired runs every miswired variant (reference engine
only; see MISWIRES; plus ENGINE_MISWIRES for vLLM when --engines names vllm) and shows the same
table for them (there the compared engine's checks should fail).
--exports also writes the miswired exports (independent_models.EXPORT_MISWIRES) as cases beside
the correct ones, and DIR/expectations.json, what each engine's rule data predicts for each.
--table ROOT prints, from a finished run's ROOT/reports and ROOT/expectations.json (the
`indep0` folder of `DIFFTEST_FULL_MATRIX=1 pytest tests/test_noise_matrix.py --basetemp=B`, or
a DIR of this script), one row per case and engine: the checks, the tensor where the error
was introduced, the accept lengths, and for each miswired export whether the engine did what
its rules predict.
Exit status: 0 unless a session could not run at all (failing checks are the table's business).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import independent_models as im  # noqa: E402

CHECK_ORDER = ("capture", "lint", "fc_inputs", "draft_logits", "top1_agreement", "accept_length", "train_accuracy")
LETTER = {"passed": "P", "failed": "F", "error": "E", "skipped": "S"}


def run_session(
    workdir: Path, cases: list[str], engines: list[str], report_dir: Path, extra: list[str], timeout: float
) -> tuple[int, float, str]:
    """`pytest <cases> --engines=...` in workdir (the plugin collects YAML under a folder named cases)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "difftest.plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfEs",
        "--rootdir",
        str(workdir),
        "-c",
        os.devnull,
        *cases,
        f"--engines={','.join(engines)}",
        f"--out={report_dir}",
        f"--junitxml={report_dir / 'junit.xml'}",
        *extra,
    ]
    print("$ (cd " + str(workdir) + " && " + " ".join(_quote(c) for c in cmd) + ")", flush=True)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {timeout}s\n{e.stdout or ''}{e.stderr or ''}"
    wall = time.time() - t0
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "pytest.log").write_text(out)
    print(f"  -> rc {rc}, {wall:.0f}s wall; log {report_dir / 'pytest.log'}", flush=True)
    return rc, wall, out


def _quote(s: str) -> str:
    return f"'{s}'" if any(c in s for c in "[],= ") else s


def outcomes(report_dir: Path, case: str, engine: str | None = None) -> dict[str, tuple[str, str]]:
    """check -> (outcome, first message line) for `engine` (all non-reference checks if None)."""
    path = report_dir / f"{case}.json"
    if not path.exists():
        return junit_outcomes(report_dir, case, engine)
    out = {}
    for r in json.loads(path.read_text())["checks"]:
        if engine is None or r["engine"] == engine:
            msg = (r.get("message") or "").strip().splitlines()
            out[r["check"]] = (r["outcome"], msg[0][:300] if msg else "")
    return out


def junit_outcomes(report_dir: Path, case: str, engine: str | None = None) -> dict[str, tuple[str, str]]:
    """The same from pytest's junit XML (when the JSON report was not written, e.g. the session's
    report writer crashed)."""
    import xml.etree.ElementTree as ET

    path = report_dir / "junit.xml"
    if not path.exists():
        return {}
    out = {}
    marker = f"{case}.yaml."
    for tc in ET.parse(path).getroot().iter("testcase"):
        cls, check = tc.get("classname", ""), tc.get("name", "")
        if marker not in cls:  # classname: cases.CASE.yaml.ENGINE, name: CHECK
            continue
        eng = cls.split(marker, 1)[1]
        if engine is not None and eng != engine:
            continue
        outcome, msg = "passed", ""
        for tag, word in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            el = tc.find(tag)
            if el is not None:
                outcome, msg = word, (el.get("message") or el.text or "").strip()
                break
        out[check] = (outcome, msg.splitlines()[0][:300] if msg else "")
    return out


def print_table(rows: list[tuple[str, str, dict]]) -> None:
    """rows: (case, engine, outcomes)."""
    wc = max([len(r[0]) for r in rows] + [4])
    we = max([len(r[1]) for r in rows] + [6])
    print(f"\n{'case':<{wc}}  {'engine':<{we}}  checks")
    for case, engine, res in rows:
        if not res:
            print(f"{case:<{wc}}  {engine:<{we}}  (no report)")
            continue
        cells = " ".join(f"{c}={LETTER.get(res[c][0], '?')}" for c in CHECK_ORDER if c in res)
        print(f"{case:<{wc}}  {engine:<{we}}  {cells}")
        for c in CHECK_ORDER:
            if c in res and res[c][0] in ("failed", "error"):
                print(f"{'':<{wc}}  {'':<{we}}    {c}: {res[c][1]}")


def _report_rows(reports: Path) -> dict[tuple[str, str], dict[str, dict]]:
    """(case, engine) -> check -> result, from a session's JSON reports."""
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for path in sorted(reports.glob("*.json")):
        for r in json.loads(path.read_text()).get("checks", []):
            rows.setdefault((path.stem, r["engine"]), {})[r["check"]] = r
    return rows


def _accept(result: dict | None) -> str:
    data = (result or {}).get("data") or {}
    eng, ref = data.get("engine"), data.get("reference")
    pick = lambda d: d.get("accept_length") if isinstance(d, dict) else d  # noqa: E731
    e, r = pick(eng), pick(ref)
    return f"{e:.3f}/{r:.3f}" if isinstance(e, (int, float)) and isinstance(r, (int, float)) else "-"


def print_matrix(root: Path) -> int:
    """The matrix of a finished run (see the module doc); 1 when an engine did not do what its rules say."""
    expectations = json.loads((root / "expectations.json").read_text()) if (root / "expectations.json").exists() else {}
    rows = _report_rows(root / "reports")
    compared = ("fc_inputs", "draft_logits", "top1_agreement", "accept_length")
    bad = 0
    print(f"{'case':<44} {'engine':<7} {'checks':<34} {'introduced':<22} {'AL eng/ref':<12} expected")
    for (case, engine), checks in sorted(rows.items()):
        if engine in ("ref", "train") or "[" in engine:
            continue
        cells = " ".join(f"{c[:5]}={LETTER.get(checks[c]['outcome'], '?')}" for c in compared if c in checks)
        first = next(
            (checks[c] for c in ("fc_inputs", "draft_logits") if checks.get(c, {}).get("outcome") == "failed"), None
        )
        introduced = ((first or {}).get("data") or {}).get("introduced") or "-"
        exp = expectations.get(case, {}).get("expect", {}).get(engine)
        if exp is None:
            verdict = "correct: " + (
                "ok" if all(checks.get(c, {}).get("outcome") == "passed" for c in compared) else "FAILED"
            )
        elif not exp["fails"]:
            ok = all(checks.get(c, {}).get("outcome") == "passed" for c in compared)
            verdict = f"immune ({exp['because']}): " + ("ok" if ok else "FAILED")
        else:
            msg = (first or {}).get("message") or ""
            ok = (
                first is not None
                and im.introduced_in(introduced, exp["where"], expectations[case].get("dtype", "float32"))
                and exp["why"] in msg
            )
            verdict = f"fails at {exp['where']} '{exp['why']}': " + ("ok" if ok else "MISMATCH")
        bad += verdict.endswith(("FAILED", "MISMATCH"))
        print(
            f"{case:<44} {engine:<7} {cells:<34} {introduced:<22} {_accept(checks.get('accept_length')):<12} {verdict}"
        )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--table"]:
        return print_matrix(Path(argv[1]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="work directory: cases go to DIR/cases, reports to DIR/reports")
    ap.add_argument("--exports", action="store_true", help="also the miswired exports, served by the engines")
    ap.add_argument(
        "--one-session",
        action="store_true",
        help="--run: one session on every engine, reports in DIR/reports, then the --table matrix",
    )
    ap.add_argument("--targets", default=",".join(im.TARGETS), help="comma list (default: all)")
    ap.add_argument("--dtypes", default=",".join(im.DTYPES), help="comma list (default: float32,bfloat16)")
    ap.add_argument("--run", action="store_true", help="run the correct-wiring cases")
    ap.add_argument("--engines", default="ref,vllm,sglang", help="the first is the reference")
    ap.add_argument("--miswired", action="store_true", help="run the miswired variants (reference engine)")
    ap.add_argument("--engine-timeout", type=float, default=900.0)
    ap.add_argument("--session-timeout", type=float, default=3600.0)
    ap.add_argument("--no-capture-cache", action="store_true")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    a = ap.parse_args(argv)

    workdir = a.dir.resolve()
    targets = [t for t in a.targets.split(",") if t]
    dtypes = [d for d in a.dtypes.split(",") if d]
    correct = im.write_cases(workdir / "cases", targets, dtypes)
    extra_cases = im.write_miswired_cases(workdir / "miswired" / "cases", targets, dtypes)
    if a.exports:
        exported = im.write_export_miswired_cases(workdir / "cases", workdir / "exports", targets, dtypes)
        im.write_expectations(workdir / "expectations.json", exported)
        print(f"wrote {len(exported)} miswired-export cases to {workdir / 'cases'}")
    print(
        f"wrote {len(correct)} cases to {workdir / 'cases'} and {len(extra_cases)} to {workdir / 'miswired' / 'cases'}"
    )
    if not (a.run or a.miswired):
        return 0
    extra = ["--require-engines", f"--engine-timeout={a.engine_timeout}", *a.pytest_args]
    if a.no_capture_cache:
        extra.append("--no-capture-cache")
    engines = [e for e in a.engines.split(",") if e]
    ref, others = engines[0], engines[1:]
    walls: list[tuple[str, float, int]] = []
    rows: list[tuple[str, str, dict]] = []
    bad = 0
    if a.run and a.one_session:  # every engine in one session, as tests/test_noise_matrix.py runs them
        rc, wall, _ = run_session(workdir, ["cases/"], engines, workdir / "reports", extra, a.session_timeout)
        walls.append((",".join(engines), wall, rc))
        bad += rc not in (0, 1)
        print(f"\nwall times:\n  {','.join(engines):<40} {wall:7.0f}s  rc {rc}\n")
        print_matrix(workdir)
        return 1 if bad else 0
    if a.run:
        rc, wall, _ = run_session(workdir, ["cases/"], [ref], workdir / "reports" / ref, extra, a.session_timeout)
        walls.append((ref, wall, rc))
        bad += rc not in (0, 1)
        for c in correct:
            rows.append((c.name, ref, outcomes(workdir / "reports" / ref, c.name, ref)))
        for eng in others:
            rdir = workdir / "reports" / eng
            rc, wall, _ = run_session(workdir, ["cases/"], [ref, eng], rdir, extra, a.session_timeout)
            walls.append((f"{ref},{eng}", wall, rc))
            bad += rc not in (0, 1)
            for c in correct:
                rows.append((c.name, eng, outcomes(rdir, c.name, eng)))
    if a.miswired:
        mis_dir = workdir / "miswired"
        variants = im.MISWIRES + [m for m in im.ENGINE_MISWIRES if m.engine_name in engines]
        for m in variants:
            for t in targets:
                spec = im.TARGETS[t]
                cases_dir = "miswired/cases" if m.case_suffix else "cases"
                # an engine-side variant serves the draft fitted for the dtype: one session per dtype
                groups = [[d] for d in dtypes] if "{draft_" in m.engine else [dtypes]
                for ds in groups:
                    files = [f"{cases_dir}/{m.case_name(spec, d)}.yaml" for d in ds]
                    eng = m.engine_spec(spec, ds[0])
                    rdir = mis_dir / "reports" / m.name / t / ("" if len(ds) > 1 else ds[0])
                    rc, wall, _ = run_session(workdir, files, ["ref", eng], rdir, extra, a.session_timeout)
                    walls.append((f"{m.name} {t} {','.join(ds)}", wall, rc))
                    bad += rc not in (0, 1)
                    for d in ds:
                        rows.append((m.case_name(spec, d), eng, outcomes(rdir, m.case_name(spec, d), eng)))
    print("\nwall times:")
    for what, wall, rc in walls:
        print(f"  {what:<40} {wall:7.0f}s  rc {rc}")
    print_table(rows)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
