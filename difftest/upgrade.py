"""The end-of-session summary: per case x compared engine, reference vs engine accept length,
the first divergent tensor and a verdict, from the per-case reports alone.

Verdicts:
  same        every compared tensor is bit-identical and the accept lengths are equal
  drifted     every check passes, but some tensor or the accept length moved (within tolerance)
  regressed   a check failed: a tensor beyond tolerance, top-1 agreement or accept length
  error / skipped   the engine could not be compared (its message is in the report)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

SAME, DRIFTED, REGRESSED, ERROR, SKIPPED = "same", "drifted", "regressed", "error", "skipped"


@dataclass
class SummaryRow:
    case: str
    engine: str
    reference: str
    reference_accept: float | None
    engine_accept: float | None
    first_divergence: str  # "-" when nothing is beyond tolerance
    largest_drift: str  # the tensor with the largest |diff| among those within tolerance, or "-"
    verdict: str
    html: str


def _accept(results: list[dict]) -> tuple[float | None, float | None]:
    for r in results:
        if r["check"] == "accept_length" and r.get("data"):
            return r["data"]["reference"]["accept_length"], r["data"]["engine"]["accept_length"]
    return None, None


def _first_divergence(prompts: list[dict]) -> str:
    for p in prompts:  # prompt order, then data-flow order within the prompt (the report keeps it)
        if p.get("first_divergence"):
            return f"{p['first_divergence']} (prompt {p['prompt']})"
    return "-"


def _largest_drift(prompts: list[dict]) -> tuple[str, bool]:
    """(description, whether every tensor is bit-identical)."""
    worst, identical = None, True
    for p in prompts:
        for t in p["tensors"]:
            if t["status"] == "allowed-missing":
                continue
            moved = t["status"] != "ok" or t["max_abs"] != 0 or t["nonfinite_mismatch"]
            identical = identical and not moved
            if moved and t["status"] == "ok" and (worst is None or t["max_abs"] > worst["max_abs"]):
                worst = t
    return (f"{worst['name']} max|d| {worst['max_abs']:.2e}" if worst else "-"), identical


def summarise(report: dict, report_dir: Path) -> list[SummaryRow]:
    """One row per compared engine of a case report (difftest.report/1)."""
    rows = []
    html = str(Path(report_dir) / f"{report['case'].replace('/', '_')}.html")
    engines = [e for e in report["engines"] if e != report["reference"]]
    for engine in engines:
        results = [r for r in report["checks"] if r["engine"] == engine]
        if not results:
            continue
        prompts = report["comparisons"].get(engine, [])
        ref_al, eng_al = _accept(results)
        drift, identical = _largest_drift(prompts)
        outcomes = {r["outcome"] for r in results}
        if "error" in outcomes:
            verdict = ERROR
        elif "failed" in outcomes:
            verdict = REGRESSED
        elif outcomes == {"skipped"}:
            verdict = SKIPPED
        elif identical and prompts and ref_al is not None and ref_al == eng_al:
            verdict = SAME
        else:
            verdict = DRIFTED
        rows.append(SummaryRow(report["case"], engine, report["reference"], ref_al, eng_al,
                               _first_divergence(prompts), drift, verdict, html))  # fmt: skip
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def render(rows: list[SummaryRow]) -> list[str]:
    """Plain-text table lines (terminal and `difftest run`)."""
    header = ("case", "engine", "reference", "ref AL", "engine AL", "first divergent tensor", "verdict", "report")
    table = [header] + [
        (r.case, r.engine, r.reference, _fmt(r.reference_accept), _fmt(r.engine_accept), r.first_divergence,
         r.verdict + (f" ({r.largest_drift})" if r.verdict == DRIFTED and r.largest_drift != "-" else ""), r.html)
        for r in rows
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in table]
