"""Per-case reports: JSON (schema difftest.report/1) plus a Markdown digest, written atomically.

JSON layout:
  schema, case, case_file, created, reference, accept_length_definition,
  engines: {spec id: {info | error}},
  checks: [{engine, check, outcome (passed|failed|skipped|error), message, data}],
  comparisons: {spec id: [{prompt, first_divergence, tensors: [TensorDiff...]}]}
"""

from __future__ import annotations

import dataclasses
import json
import os
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
    }


def markdown(report: dict) -> str:
    lines = [f"# difftest: {report['case']}", "", f"reference: `{report['reference']}`; case file `{report['case_file']}`", ""]
    lines += ["| engine | check | outcome | message |", "|---|---|---|---|"]
    for r in report["checks"]:
        msg = r["message"].replace("\n", "<br>").replace("|", "\\|")
        lines.append(f"| `{r['engine']}` | {r['check']} | {r['outcome']} | {msg} |")
    lines += ["", f"Accept length: {report['accept_length_definition']}.", ""]
    return "\n".join(lines)


def write(report: dict, directory: Path) -> Path:
    stem = report["case"].replace("/", "_")
    json_path = directory / f"{stem}.json"
    atomic_write(json_path, json.dumps(report, indent=1, default=str))
    atomic_write(directory / f"{stem}.md", markdown(report))
    return json_path
