"""The checks a case runs per engine; each returns a verdict and the message a user reads.

  capture         (reference only) every prompt captures, no NaN/Inf upstream of logits
  fc_inputs       target hidden states and draft.fc_in (per chunk) match the reference
  draft_logits    everything the draft computes after fc matches, every draft step
  top1_agreement  the draft's greedy choices agree with the reference's
  accept_length   simulated/engine accept length is within tolerance of the reference's

A failing message names the first tensor in data-flow order that diverges, by how much,
and (for fc inputs) which reference tensor the engine actually fed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from difftest.case import Case
from difftest.compare import CaptureDiff, TensorDiff, top1_agreement
from difftest.diagnose import diagnose_fc
from difftest.engine import EngineSpec
from difftest.names import split_draft
from difftest.session import Session

REFERENCE_CHECKS = ("capture",)
ENGINE_CHECKS = ("fc_inputs", "draft_logits", "top1_agreement", "accept_length")

DEFAULT_TOP1 = 0.98
DEFAULT_ACCEPT = {"atol": 0.2, "rtol": 0.1}


@dataclass
class Verdict:
    passed: bool
    message: str
    data: dict = field(default_factory=dict)


def _in_fc_scope(name: str) -> bool:
    return name.startswith("target.") or name.startswith("draft.fc_in")


def _in_draft_scope(name: str) -> bool:
    d = split_draft(name)
    return d is not None and not d[1].startswith("fc_in") and d[1] != "embeds"


def _divergence_report(session: Session, case: Case, spec: EngineSpec, diffs: list[CaptureDiff], scope) -> Verdict:
    failing: list[tuple[int, TensorDiff]] = []
    for i, cd in enumerate(diffs):
        d = cd.first_divergence([x.name for x in cd.diffs if scope(x.name)])
        if d is not None:
            failing.append((i, d))
    ref = session.options.reference.id
    if not failing:
        n = sum(1 for cd in diffs for d in cd.diffs if scope(d.name))
        return Verdict(True, f"{n} tensor comparisons over {len(diffs)} prompts match {ref}")
    i, d = failing[0]
    cd = diffs[i]
    first = cd.first_divergence()
    lines = [f"{spec.id} diverges from {ref} on {len(failing)}/{len(diffs)} prompts; prompt {i}: {d.summary()}"]
    if first is not None and first.name != d.name:
        lines.append(f"first divergence in data-flow order: {first.summary()}")
    if (first or d).name.startswith("draft.fc_in"):
        lines += diagnose_fc(session.capture(case, session.options.reference, i), session.capture(case, spec, i))
    return Verdict(False, "\n".join(lines), {"prompt": i, "tensor": d.name, "first_divergence": (first or d).name})


def check_capture(session: Session, case: Case, spec: EngineSpec) -> Verdict:
    problems, n = [], 0
    for i in range(len(session.prompt_ids(session.prepare(case)))):
        cap = session.capture(case, spec, i)
        for name in cap.names():
            t = cap.get(name)
            n += 1
            if not name.endswith("logits_target") and not bool(torch.isfinite(t).all()):
                problems.append(f"prompt {i}: {name} has {int((~torch.isfinite(t)).sum())} NaN/Inf values")
        if "draft.fc_in" not in cap.tensors or "draft.logits" not in cap.tensors:
            problems.append(f"prompt {i}: capture lacks draft.fc_in or draft.logits")
    if problems:
        return Verdict(False, "; ".join(problems[:5]))
    wiring = session.capture(case, spec, 0).meta.get("wiring", {})
    return Verdict(True, f"{n} tensors captured; fc wiring {wiring.get('inputs')} ({wiring.get('source')})")


def check_fc_inputs(session: Session, case: Case, spec: EngineSpec) -> Verdict:
    return _divergence_report(session, case, spec, session.comparisons(case, spec), _in_fc_scope)


def check_draft_logits(session: Session, case: Case, spec: EngineSpec) -> Verdict:
    return _divergence_report(session, case, spec, session.comparisons(case, spec), _in_draft_scope)


def check_top1(session: Session, case: Case, spec: EngineSpec) -> Verdict:
    threshold = float(case.expect.get("top1_agreement", DEFAULT_TOP1))
    agree = total = 0
    for i in range(len(case.prompts)):
        ref, other = session.capture(case, session.options.reference, i), session.capture(case, spec, i)
        names = [n for n in ref.names() if n.endswith("logits_target")]
        a, t = top1_agreement(ref, other, names)
        agree, total = agree + a, total + t
    rate = agree / total if total else 0.0
    msg = f"draft top-1 agreement with {session.options.reference.id}: {agree}/{total} = {rate:.3f} (threshold {threshold})"
    return Verdict(total > 0 and rate >= threshold, msg, {"agree": agree, "total": total, "rate": rate})


def check_accept_length(session: Session, case: Case, spec: EngineSpec) -> Verdict:
    tol = {**DEFAULT_ACCEPT, **(case.expect.get("accept_length") or {})}
    ref_stats = session.speculate(case, session.options.reference)
    stats = session.speculate(case, spec)
    a, b = ref_stats.accept_length, stats.accept_length
    allowed = tol["atol"] + tol["rtol"] * abs(a)
    change = (b - a) / a * 100 if a else float("nan")
    msg = (
        f"accept length {b:.3f} ({stats.source}) vs reference {a:.3f} ({ref_stats.source}): "
        f"{change:+.1f}%, allowed |diff| <= {allowed:.3f}; per-position acceptance "
        f"{[round(x, 3) for x in stats.acceptance_rate_per_pos]} vs {[round(x, 3) for x in ref_stats.acceptance_rate_per_pos]}"
    )
    if b < a - allowed:
        msg = "accept length collapsed: " + msg
    return Verdict(abs(b - a) <= allowed, msg, {"reference": ref_stats.to_dict(), "engine": stats.to_dict()})


CHECKS = {
    "capture": check_capture,
    "fc_inputs": check_fc_inputs,
    "draft_logits": check_draft_logits,
    "top1_agreement": check_top1,
    "accept_length": check_accept_length,
}
