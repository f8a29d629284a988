"""Per-case reports: JSON (schema difftest.report/1), a Markdown digest and a self-contained
HTML page (difftest.html_report), written atomically. The JSON is the source: `difftest
report PATH.json` re-renders the other two from it. Layout: reports/README.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from difftest.acceptance import DEFINITION

SCHEMA = "difftest.report/1"


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def build(case, session, results: list[dict]) -> dict:
    engines = {}
    for spec in session.options.engines:
        info, err = session.engine_info(spec), session.start_error(spec)
        engines[spec.id] = {"info": info} if info else {"error": err or "not started"}
    comparisons = {}
    for engine_id, diffs in session.computed_comparisons(case).items():
        comparisons[engine_id] = [
            {
                "prompt": i,
                "first_divergence": (cd.first_divergence().name if cd.first_divergence() else None),
                "tensors": [dataclasses.asdict(d) for d in cd.diffs],
            }
            for i, cd in enumerate(diffs)
        ]
    return {
        "schema": SCHEMA,
        "case": case.name,
        "case_file": case.path,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "reference": session.options.reference.id,
        "accept_length_definition": DEFINITION,
        "engines": engines,
        "checks": results,
        "comparisons": comparisons,
        "environment": environment(),
        "reproduce": reproduce_command(case.path, [s.id for s in session.options.engines], session.options.reference.id),
        "case_yaml": _read_text(case.path),
    }


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        return f"(case file unreadable: {e.strerror})"


def reproduce_command(case_path: str, engines: list[str], reference: str) -> str:
    """The command that reruns this comparison. A stored baseline is not an engine one can name
    in --engines: it comes back as --baseline NAME[:ENGINE]."""
    if reference.startswith("baseline:"):
        live = [e for e in engines if e != reference]
        return shlex.join(["difftest", "run", case_path, f"--engines={','.join(live)}",
                           f"--baseline={reference.removeprefix('baseline:')}"])  # fmt: skip
    cmd = ["difftest", "run", case_path, f"--engines={','.join(engines)}"]
    if engines and engines[0] != reference:
        cmd.append(f"--reference={reference}")
    return shlex.join(cmd)


def _git_sha() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    if sha.returncode:
        return "unknown (not a git checkout)"
    return sha.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def environment() -> dict:
    """The harness side: the engines' own versions are under `engines`."""
    import torch

    from difftest import __version__
    from difftest.rowstats import compile_status

    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = "not installed"
    return {
        "difftest": __version__,
        "git_sha": _git_sha(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": tf,
        "harness_device": "cuda" if torch.cuda.is_available() else "cpu",
        "comparison_kernel": compile_status(),
    }


def markdown(report: dict) -> str:
    lines = [f"# difftest: {report['case']}", "", f"reference: `{report['reference']}`; case file `{report['case_file']}`", ""]
    lines += ["| engine | check | outcome | message |", "|---|---|---|---|"]
    for r in report["checks"]:
        msg = r["message"].replace("\n", "<br>").replace("|", "\\|")
        lines.append(f"| `{r['engine']}` | {r['check']} | {r['outcome']} | {msg} |")
    lines += ["", f"Accept length: {report['accept_length_definition']}.", ""]
    if report.get("reproduce"):
        lines += ["Reproduce:", "", "```bash", report["reproduce"], "```", ""]
    return "\n".join(lines)


def write(report: dict, directory: Path) -> Path:
    stem = report["case"].replace("/", "_")
    json_path = directory / f"{stem}.json"
    atomic_write(json_path, json.dumps(report, indent=1, default=str))
    render(report, directory)
    return json_path


def render(report: dict, directory: Path) -> tuple[Path, Path]:
    """Markdown and HTML beside the JSON, from the report dict alone."""
    from difftest.html_report import render as render_html

    stem = report["case"].replace("/", "_")
    atomic_write(directory / f"{stem}.md", markdown(report))
    atomic_write(directory / f"{stem}.html", render_html(report))
    return directory / f"{stem}.md", directory / f"{stem}.html"
