"""Layerwise golden inputs: the orchestration half of the draft_logits check.

When an engine's draft diverges, its draft is re-run on the *reference's* draft.fc_in (a new
capture through the case's run) and compared again, to tell "the engine captured the wrong hidden
states" from "its draft computes differently". difftest.checks.checks judges; this module asks the
case's run for the extra capture and returns the lines and data the verdict adds.
"""

from __future__ import annotations

from difftest.compare.compare import CaptureDiff, compare_captures, noise_summary
from difftest.base.names import in_fc_in
from difftest.compare.diagnose import PRECISION_NAMES, diagnose_draft, reduced_precision
from difftest.run.engine import EngineSpec
from difftest.records.check_data import GoldenData
from difftest.checks.scopes import in_draft_scope, in_fc_scope
from difftest.run.case_run import CaseRun


def golden_rerun(
    run: CaseRun, spec: EngineSpec, i: int, diff: CaptureDiff, own_passed: bool = False
) -> tuple[list[str], GoldenData]:
    """Re-run the engine's draft on the reference's draft.fc_in and say which side is at fault
    (`own_passed`: the engine's own run is within noise; the re-run is then a confirmation)."""
    ref_spec = run.options.reference
    golden = run.capture_golden(spec, i)
    if golden is None:
        return [
            f"golden-input re-run: not supported by {spec.id}, so wrong hidden states and a draft that "
            "computes differently cannot be told apart"
        ], GoldenData("unsupported")
    ref = run.capture(ref_spec, i)
    case = run.prepared
    scope = [n for n in ref.names() if in_draft_scope(n)]
    gdiff = compare_captures(
        ref, golden, case.dtype, case.tolerances, ["target.*", *case.allow_missing], floor=run.noise_floor_for(spec)
    )
    g_first = gdiff.first_introduced(scope) or gdiff.first_divergence(scope)
    fc_ok = all(d.ok for d in diff.diffs if in_fc_scope(d.name))
    data = GoldenData(
        "diverges" if g_first else "matches",
        g_first.name if g_first else None,
        [d.name for d in gdiff.diffs if d.name in scope and not d.ok],
    )
    if own_passed:
        if g_first is None:
            return [
                f"golden inputs (prompt {i}): on the reference's draft.fc_in, {spec.id}'s draft matches "
                f"{ref_spec.id} on every draft tensor, as its own run does"
            ], data
        return [
            f"golden inputs (prompt {i}): on the reference's draft.fc_in, {spec.id}'s draft diverges at "
            f"{noise_summary(g_first)} although its own run is within noise"
        ], data
    if g_first is None and not fc_ok:
        return [
            f"golden inputs: on the reference's draft.fc_in, {spec.id}'s draft matches {ref_spec.id} on every draft "
            "tensor: the engine captured the wrong hidden states; its draft computes correctly"
        ], data
    if g_first is None:
        return [
            f"golden inputs: on the reference's draft.fc_in, {spec.id}'s draft matches, yet its own run diverges with "
            "matching fc inputs: nondeterminism, or a capture that is not what the draft consumed"
        ], data
    drift = reduced_precision(gdiff, case.dtype)
    if drift is not None and drift.beyond is None:  # the draft's own matmuls in a reduced format, no fault
        own_drift = reduced_precision(diff, case.dtype)
        wrong_states = own_drift is not None and own_drift.beyond is not None and in_fc_in(own_drift.beyond)
        moved = (
            f"golden inputs: on the reference's draft.fc_in, {spec.id}'s draft moves only as "
            f"{PRECISION_NAMES[drift.precision]} matmuls do (rel err {drift.err:.3g} at {drift.entry}, "
            f"{drift.worst_err:.3g} at most)"
        )
        if wrong_states:
            return [f"{moved}: the engine captured the wrong hidden states; its draft computes correctly"], data
        return [f"{moved}: its draft computes the reference's function, in reduced precision"], data
    fault = gdiff.get(drift.beyond) if drift is not None and drift.beyond is not None else None
    if fault is not None:  # the fault after the drift leads, not the drift's entry
        g_first, data.first_divergence = fault, fault.name
    where = f"error introduced at {noise_summary(g_first)}"
    lines = [
        f"golden inputs: on the reference's draft.fc_in, {spec.id}'s draft still diverges, {where}: the engine's "
        "draft computes differently"
    ]
    own = diff.first_introduced() or diff.first_divergence([d.name for d in diff.diffs if in_draft_scope(d.name)])
    return lines + ([] if own is not None and own.name == g_first.name else diagnose_draft(g_first.name)), data
