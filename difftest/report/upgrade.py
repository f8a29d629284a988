"""The end-of-session summary: per case x compared engine, reference vs engine accept length,
the tensor where the error is introduced and a verdict, from the per-case reports alone.

Verdicts (difftest.compare.noise judges the tensors):
  same        every compared tensor is bit-identical and the accept lengths are equal
  drifted     every check passes, but some tensor or the accept length moved within noise; the
              largest mover is named by its excess (row error / noise threshold)
  regressed   a check failed: a tensor above noise, top-1 agreement or accept length
  error / skipped   the engine could not be compared (its message is in the report)
  passed      a running server (`server[url=...]`): its accept length meets the reference's
              prediction; it has no tensors to call same or drifted

The "first divergent tensor" column is the tensor where the error is *introduced* (the report's
`first_divergence`), what a failing check leads with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from difftest.records import (
    AcceptLengthData,
    CheckResult,
    PromptComparison,
    Report,
    ServerAcceptData,
    TensorDiff,
    TensorStatus,
)

SAME, DRIFTED, REGRESSED, ERROR, SKIPPED = "same", "drifted", "regressed", "error", "skipped"
PASSED = "passed"
# A case's declared expected failure (difftest.case.expected_failure): still caught as declared, or changed
# (it vanished or its cause moved: an engine upgrade fixed or changed a known behaviour).
KNOWN, CHANGED = "known-failure", "expectation-changed"


@dataclass
class SummaryRow:
    case: str
    engine: str
    reference: str
    reference_accept: float | None
    engine_accept: float | None
    first_divergence: str  # the introduced-error tensor and its prompt; "-" when nothing is above noise
    largest_drift: str  # the tensor with the largest excess among those within noise, or "-"
    verdict: str
    html: str
    release: str = "-"  # the engine's release and code path ("0.32.0 runner v2"), "-" when unknown


def _accept(results: list[CheckResult]) -> tuple[float | None, float | None]:
    for r in results:
        if r.check == "accept_length" and isinstance(r.data, (AcceptLengthData, ServerAcceptData)):
            return r.data.reference.accept_length, r.data.engine.accept_length
    return None, None


def _first_divergence(prompts: list[PromptComparison]) -> str:
    """The tensor where the error is introduced, in the first prompt that has one (the report's
    `first_divergence` is that tensor; reports before the noise criterion named the first failing one)."""
    for p in prompts:
        name = p.first_divergence
        if name:
            return f"{name} (prompt {p.prompt})"
    return "-"


def _drift_key(t: TensorDiff) -> tuple:
    # Movers judged against noise rank by excess (noise units); elementwise or older entries after
    # them, by |diff|.
    return (1, t.excess) if t.by_noise else (0, t.max_abs)


def _describe(t: TensorDiff) -> str:
    if t.by_noise:
        return f"{t.name} {t.excess:.2g}x noise threshold, err {t.err:.2e}"
    return f"{t.name} max|d| {t.max_abs:.2e}"


def _largest_drift(prompts: list[PromptComparison]) -> tuple[str, bool]:
    """(the largest mover within noise, by excess, or "-"; whether every compared tensor is bit-identical).
    Tensors not compared (`tie`) or allowed missing do not count."""
    worst: TensorDiff | None = None
    identical = True
    for p in prompts:
        for t in p.tensors:
            if t.status in (TensorStatus.ALLOWED_MISSING, TensorStatus.TIE):
                continue
            moved = t.status != TensorStatus.OK or t.differs
            identical = identical and not moved
            if moved and t.status == TensorStatus.OK and (worst is None or _drift_key(t) > _drift_key(worst)):
                worst = t
    return (_describe(worst) if worst else "-"), identical


def summarise(report: Report, report_dir: Path) -> list[SummaryRow]:
    """One row per compared engine of a case report (difftest.records.Report)."""
    rows = []
    html = str(Path(report_dir) / f"{report.case.replace('/', '_')}.html")
    engines = [e for e in report.engines if e != report.reference]
    for engine in engines:
        results = report.results(engine)
        if not results:
            continue
        prompts = report.comparisons.get(engine, [])
        ref_al, eng_al = _accept(results)
        drift, identical = _largest_drift(prompts)
        outcomes = {r.outcome for r in results}
        if any(r.expected_failure and r.outcome == "failed" for r in results):
            verdict = CHANGED
        elif "error" in outcomes:
            verdict = ERROR
        elif "failed" in outcomes:
            verdict = REGRESSED
        elif outcomes == {"skipped"}:
            verdict = SKIPPED
        elif not prompts and outcomes - {"not available"} == {"passed"}:
            verdict = PASSED  # a running server: acceptance only, no tensors to call same or drifted
        elif "xfailed" in outcomes:
            verdict = KNOWN
        elif identical and prompts and ref_al is not None and ref_al == eng_al:
            verdict = SAME
        else:
            verdict = DRIFTED
        entry = report.engines.get(engine)
        info = entry.info if entry is not None else None
        release = "-" if info is None else f"{info.version}" + (f" {info.variant}" if info.variant else "")
        rows.append(
            SummaryRow(
                report.case,
                engine,
                report.reference,
                ref_al,
                eng_al,
                _first_divergence(prompts),
                drift,
                verdict,
                html,
                release,
            )
        )
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def render(rows: list[SummaryRow]) -> list[str]:
    """Plain-text table lines (terminal and `difftest run`)."""
    # the release last: it may hold spaces ("0.32.0 runner v2"), and the columns before it are read by position
    header = (
        "case",
        "engine",
        "reference",
        "ref AL",
        "engine AL",
        "first divergent tensor",
        "verdict",
        "report",
        "release",
    )
    table = [header] + [
        (
            r.case,
            r.engine,
            r.reference,
            _fmt(r.reference_accept),
            _fmt(r.engine_accept),
            r.first_divergence,
            r.verdict + (f" ({r.largest_drift})" if r.verdict == DRIFTED and r.largest_drift != "-" else ""),
            r.html,
            r.release,
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in table]
