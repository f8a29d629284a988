"""The checks a case runs per engine; each returns a verdict and the message a user reads.

  capture         (reference only) every prompt captures, no NaN/Inf upstream of logits
  lint            (reference only) the draft checkpoint's config: what engines would
                  silently do differently (difftest.checks.lint)
  fc_inputs       target hidden states and draft.fc_in (per chunk) match the reference
  draft_logits    everything the draft computes after fc matches, every draft step
  top1_agreement  the draft's greedy choices agree with the reference's
  accept_length   accept length and per-position acceptance within the measured noise of the reference's
                  (difftest.compare.accept_judge; a tolerance the case declares only widens it)

Engines contribute further checks through the `difftest.checks` entry points
(difftest.base.extensions), e.g. the training-data engine's `train_accuracy`.

A failing message names the first tensor in data-flow order that diverges, by how much,
and (for fc inputs) which reference tensor the engine actually fed. A failing
draft_logits re-runs the engine's draft on the reference's draft.fc_in (layerwise golden
inputs) to tell "captured the wrong hidden states" from "the draft computes differently".
"""

from __future__ import annotations

import torch

from difftest.compare import accept_judge

from difftest.compare import noise
from difftest.case.case import Case
from difftest.compare.compare import CaptureDiff, TensorDiff, aligned_rows, noise_summary
from difftest.records.tensor_diff import TensorStatus
from difftest.records.acceptance import AcceptStats
from difftest.compare.diagnose import diagnose_draft, diagnose_fc, diagnose_hidden, match_chunks, reduced_precision
from difftest.base.dtypes import matmul_unit_roundoff
from difftest.run.engine import EngineSpec
from difftest.base import definitions
from difftest.base.check_registry import ENGINE, REFERENCE, CheckSpec, items_for, runner
from difftest.checks.golden import golden_rerun
from difftest.checks.scopes import in_draft_scope as _in_draft_scope
from difftest.checks.scopes import in_fc_scope as _in_fc_scope
from difftest.base.errors import ConfigError, DifftestError, NotAvailable
from difftest.records.check_data import (
    AcceptLengthData,
    CaptureData,
    CheckData,
    ComparisonData,
    FixData,
    GoldenData,
    LintData,
    ServerAcceptData,
    Top1Data,
)
from difftest.base.fc_wiring import Wiring
from difftest.run.case_run import CaseRun
from difftest.checks.verdict import Verdict
from difftest.rules import engine_releases
from difftest.checks.layer_reading import engine_view
from difftest.checks.lint import trained_wiring
from difftest.checks.layer_reading import draft_config_seen
from difftest.checks.layer_reading import fix_lines
from difftest.rules.layer_rules import variant_siblings
from difftest.rules.draft_rules import ENGINES
from difftest.checks.lint import lint_case
from difftest.rules.engine_releases import engine_draft_rules, release as release_of
from difftest.rules.lint_checkpoint import flag_findings
from difftest.base.names import DRAFT_LOGITS, FC_IN, in_fc_in

DEFAULT_TOP1 = 0.98


def _comparison_data(verdict: Verdict) -> ComparisonData:
    """The comparison record every divergence verdict carries (see _divergence_report)."""
    if not isinstance(verdict.data, ComparisonData):
        raise TypeError(
            f"a divergence verdict carries {type(verdict.data).__name__}, not ComparisonData"
        )  # a harness bug
    return verdict.data


def _divergence_report(run: CaseRun, spec: EngineSpec, diffs: list[CaptureDiff], scope) -> Verdict:
    """Judged against the measured noise (difftest.compare.noise): a check fails when a tensor in its scope
    is above noise; the message leads with the tensor where the error is *introduced*, beside the
    first tensor above noise and the first that differs at all."""
    failing: list[tuple[int, TensorDiff]] = []
    for i, cd in enumerate(diffs):
        d = cd.first_divergence([x.name for x in cd.diffs if scope(x.name)])
        if d is not None:
            failing.append((i, d))
    ref = run.options.reference.id
    floor = run.noise_floor_for(spec)
    ties = [f"prompt {i}: {cd.tie}" for i, cd in enumerate(diffs) if cd.tie]
    if not failing:
        n = sum(1 for cd in diffs for d in cd.diffs if scope(d.name) and d.status != TensorStatus.TIE)
        moved = [d for cd in diffs for d in cd.diffs if scope(d.name) and d.by_noise and d.threshold > 0]
        worst = max(moved, key=lambda d: d.excess, default=None)
        msg = f"{n} tensor comparisons over {len(diffs)} prompts within noise of {ref} (noise floor {floor.source})"
        if worst is not None and worst.differs:
            msg += f"; largest: {worst.name} row error {worst.err:.3g} = {worst.excess:.2g}x its threshold {worst.threshold:.3g}"
        if ties:
            msg += "; " + "; ".join(ties)
        return Verdict(True, msg, ComparisonData(noise=floor.source, ties=ties))
    i, d = failing[0]
    cd = diffs[i]
    introduced = cd.first_introduced() or cd.first_divergence() or d
    drift = _precision_drift(run, spec, diffs, [p for p, _ in failing])
    if drift is not None:
        in_scope = [x.name for x in cd.diffs if scope(x.name) and not x.ok and x.status != TensorStatus.TIE]
        if set(in_scope) <= set(drift.explained):  # every divergence in this check's scope is the drift's
            return _precision_verdict(run, spec, diffs, failing, drift, floor.source, ties)
        introduced = cd.get(drift.beyond) or introduced  # the fault after the drift leads, with its cause
    first_above = cd.first_divergence()
    differs = cd.first_differs()
    lines = [
        f"{spec.id} diverges from {ref} on {len(failing)}/{len(diffs)} prompts; prompt {i}: error introduced at "
        f"{noise_summary(introduced)}"
    ]
    if d.name != introduced.name:
        lines.append(f"in this check's scope first at {noise_summary(d)}")
    if first_above is not None and first_above.name not in (introduced.name, d.name) and drift is None:
        lines.append(
            f"first tensor above noise: {first_above.name} (excess {first_above.excess:.3g}x, propagated "
            f"into {introduced.name}'s inputs below the jump of {noise.JUMP:g}x)"
        )
    if differs is not None:
        lines.append(f"first tensor that differs at all: {differs.summary()}")
    lines.append(f"noise floor: {floor.source}")
    data = ComparisonData(
        noise=floor.source,
        ties=ties,
        prompt=i,
        tensor=d.name,
        first_divergence=introduced.name,
        introduced=introduced.name,
        first_above_noise=first_above.name if first_above else None,
        first_differs=differs.name if differs else None,
    )
    ref_cap, cap = run.capture(run.options.reference, i), run.capture(spec, i)
    if in_fc_in(introduced.name):
        lines += diagnose_fc(ref_cap, cap, _draft_config(run, spec), floor)
        matches, similarity = match_chunks(ref_cap, cap, floor)
        data.fc_chunks, data.similarity = matches, similarity
        rule_lines, data.rule, data.rule_predicted, data.fix = _rule_lines(
            run, spec, [m.best if m.matched else None for m in matches]
        )
        lines += rule_lines
    elif introduced.name.startswith("target."):
        lines += diagnose_hidden(ref_cap, cap, introduced.name)
    else:
        lines += diagnose_draft(introduced.name)
    causes = _known_causes(run, spec, introduced.name)
    lines += [f"known cause (lint [{f.code}]): {f.message}" for f in causes]
    data.known_causes = [f.code for f in causes]
    if drift is not None:  # beside the fault, what moved every tensor before it
        data.precision = drift.finding(spec.id)
        lines.append(f"beside it: {data.precision}")
    lines += _upgrade_lines(run, spec)
    return Verdict(False, "\n".join(lines), data)


def _precision_drift(run: CaseRun, spec: EngineSpec, diffs: list[CaptureDiff], failing: list[int]):
    """The reduced-precision signature (difftest.compare.diagnose.reduced_precision) when every failing
    prompt shows it, from the first; None otherwise. The fc chunks may carry the drift only where each
    matches the layer the reference fed (a miswired chunk is a fault, whatever the precision)."""
    dtype = run.prepared.dtype
    floor = run.noise_floor_for(spec)
    found = []
    for i in failing:
        drift = reduced_precision(diffs[i], dtype, wired_right=False)
        entry = diffs[i].first_introduced()
        fc_open = (drift is None and entry is not None and in_fc_in(entry.name)) or (
            drift is not None and drift.beyond is not None and in_fc_in(drift.beyond)
        )
        if fc_open:
            matches = match_chunks(run.capture(run.options.reference, i), run.capture(spec, i), floor)[0]
            if matches and all(m.correct for m in matches):
                drift = reduced_precision(diffs[i], dtype, wired_right=True)
        if drift is None:
            return None
        found.append(drift)
    return found[0] if found else None


def _precision_verdict(run, spec, diffs, failing, drift, source: str, ties: list[str]) -> Verdict:
    """A float32 engine whose every divergence in scope is reduced-precision drift: the finding leads
    (the check still fails: nothing is accepted silently; a case that declares the precision is judged
    against that precision's floor, difftest.run.case_run)."""
    i = failing[0][0]
    entry = diffs[i].get(drift.entry)
    lines = [
        drift.finding(spec.id),
        f"on {len(failing)}/{len(diffs)} prompts; prompt {i}: error enters at {noise_summary(entry)}",
        f"drift explains {len(drift.explained)} diverging tensors (none introduces error of its own; largest "
        f"row error {drift.worst_err:.3g} at {drift.worst}, {drift.worst_err / matmul_unit_roundoff(drift.precision):.2g}x "
        f"the {drift.precision} unit roundoff)",
        f"noise floor: {source}",
    ]
    data = ComparisonData(
        noise=source,
        ties=ties,
        prompt=i,
        tensor=failing[0][1].name,
        first_divergence=drift.entry,
        introduced=drift.entry,
        precision=drift.finding(spec.id),
    )
    return Verdict(False, "\n".join(lines), data)


def _upgrade_lines(run: CaseRun, spec: EngineSpec) -> list[str]:
    """When the reference is another release of the same engine (`--engines=sglang@OLD,sglang`, or a
    baseline saved on it): each recorded behaviour change between the two releases that this draft
    meets (difftest.rules.engine_releases), with both releases' readings and the change cited."""

    reference = run.options.reference
    old, new = run.case_engine_info(reference), run.pool.engine_info(spec)
    if old is None or new is None:
        return []
    engine = new.name
    if engine not in engine_releases.SUPPORTED or old.name != engine:
        return []
    a, b = engine_releases.release(old.version), engine_releases.release(new.version)
    if a == b:
        return []
    try:
        view = _view(run, spec)  # the target's family, L, fc width and the config the new release is given
        if view is None:
            return []
        old_cfg = _draft_config(run, reference) if reference.name == engine else view.draft_config
        diff = engine_releases.layer_difference(
            engine, view.rule.family, a, b, old_cfg or {}, view.L, view.fc_chunks, view.draft_config
        )
        return ([diff.line()] if diff is not None else []) + engine_releases.flag_differences(
            engine, a, b, view.draft_config
        )
    except (ConfigError, KeyError, ValueError, OSError):  # a diagnosis never fails on it
        return []


def _view(run: CaseRun, spec: EngineSpec):

    prepared = run.engine_case(spec)
    try:
        trained = trained_wiring(prepared)
    except ConfigError:
        trained = None
    return engine_view(prepared, spec.name, trained, _release(run, spec), _variant(run, spec))


def _release(run: CaseRun, spec: EngineSpec) -> str | None:
    """The engine release a spec ran (its worker's own report), for the rules of that release."""
    info = run.pool.engine_info(spec)
    return info.version if info is not None and info.name == spec.name else None


def _unrecorded(run: CaseRun, spec: EngineSpec) -> str | None:
    """The line for an engine release with no rules on record (its reading measured, not predicted)."""

    info = run.pool.engine_info(spec)
    if info is None or info.name not in engine_releases.SUPPORTED or engine_releases.on_record(info.name, info.version):
        return None
    return engine_releases.unrecorded(info.name, info.version)


def _variant(run: CaseRun, spec: EngineSpec) -> str:
    """The code path a spec's worker ran (EngineInfo.variant, e.g. "runner v2"), for its own rules."""
    info = run.pool.engine_info(spec)
    return info.variant if info is not None and info.name == spec.name else ""


def _draft_config(run: CaseRun, spec: EngineSpec) -> dict | None:
    """The draft config as this engine was given it (fixtures resolved, its overrides merged); None
    when it cannot be read (a diagnosis never fails on it)."""

    return draft_config_seen(run.engine_case(spec), spec.name)


def _rule_lines(
    run: CaseRun, spec: EngineSpec, fed: list[str | None]
) -> tuple[list[str], str | None, list[str] | None, FixData | None]:
    """Why the engine fed what it fed (its layer-id rule, difftest.rules.layer_rules) and the config edit
    that makes it feed what training fed; says so when the rule model did not predict the feed.
    (lines, the rule explained, the feed it predicts, the edit)"""

    view = _view(run, spec)
    if view is None:
        unrecorded = _unrecorded(run, spec)
        return ([unrecorded] if unrecorded else []), None, None, None
    lines = [view.rule_line()] + _sibling_lines(view)
    predicted = view.reading.fed_names()
    if None not in fed and list(fed) != predicted:
        lines.append(
            f"the rule model predicted {predicted} but the engine fed {fed}: {view.rule.label}'s rule differs "
            "from difftest.rules.layer_rules (another version?); the fix below may not hold"
        )
    edit = view.edit()
    lines += fix_lines(view, edit)
    fix = None
    if edit is not None:
        fix = FixData(
            patch=edit.patch,
            ids=edit.ids,
            impossible=edit.impossible,
            fc_order=edit.fc_order,
            alternatives=list(edit.alternatives),
            side_effects=list(edit.side_effects),
        )
    return lines, view.reading.explain(), predicted, fix


def _sibling_lines(view) -> list[str]:
    """The same release's other code paths (difftest.rules.layer_rules.VARIANT_RULES: vLLM's other runner)
    reading the same config: which of them feeds what, and which matches training."""

    out = []
    for other in variant_siblings(view.rule):
        r = other.predict(view.draft_config, view.L, view.fc_chunks)
        if (r.fed, r.refusal) == (view.reading.fed, view.reading.refusal):
            continue
        fed = "[" + ", ".join(f"h{k}" for k in r.fed) + "]"
        verdict = (
            "as trained"
            if view.trained is not None and r.fed == view.trained and r.refusal is None
            else "not as trained"
            if view.trained is not None
            else ""
        )
        out.append(
            f"the same release's other path: {other.label} reads {r.ids} ({r.place}) and feeds {fed}"
            + (f" ({verdict})" if verdict else "")
            + (f"; fails: {r.refusal}" if r.refusal else "")
        )
    return out


def explain_engine_error(run: CaseRun, spec: EngineSpec, error: str) -> str:
    """An engine error whose cause the layer-id rule predicts (the default fallback making fc
    narrower than its weight, an id the model cannot capture): the cause first, the raw error beneath."""
    try:
        view = _view(run, spec)
    except Exception:  # explaining must never hide the error itself
        return error
    if view is not None and view.reading.refusal is not None and view.rule.words() not in error:
        return f"predicted by the layer-id rule: {view.reading.explain()}\n{error}"
    try:
        causes = [f for f in _engine_findings(run, spec) if _explains(f, error)]
    except Exception:  # explaining must never hide the error itself
        return error
    return "\n".join([f"known cause (lint [{f.code}]): {f.message}" for f in causes] + [error])


def _explains(finding, error: str) -> bool:
    """A lint finding that accounts for an engine's error: it names a checkpoint tensor the error names
    (a loader refusing a weight), or the engine cannot read the checkpoint's format at all."""
    return any(w in error for w in finding.weights) or finding.code == "checkpoint-format"


def _known_causes(run: CaseRun, spec: EngineSpec, introduced: str) -> list:
    """The lint's errors that name this engine (difftest.rules.draft_rules), the one whose first changed
    tensor is where the error was introduced first: the static reason for a divergence just seen."""
    hits = [f for f in _engine_findings(run, spec) if f.severity == "error"]
    return sorted(hits, key=lambda f: f.tensor != introduced)


def _engine_findings(run: CaseRun, spec: EngineSpec) -> list:
    """The lint's findings that name this engine, under the rules of the release it runs."""

    if spec.name not in ENGINES:
        return []
    try:
        findings = lint_case(run.prepared)
    except ConfigError:
        return []  # the lint item reports it

    release = _release(run, spec)
    if release and release_of(release) != ENGINES[spec.name].version:
        # the lint speaks for the pinned release; this engine runs another: its own flag rules

        raw = _draft_config(run, spec) or {}
        rules = engine_draft_rules(spec.name, release)
        try:
            own = flag_findings(raw, [rules]) if rules is not None else []
        except ConfigError:
            own = []
        findings = [f for f in findings if f.code != "flag-ignored"] + own
    return [f for f in findings if spec.name in f.engines]


def check_capture(run: CaseRun, spec: EngineSpec) -> Verdict:
    problems, n = [], 0
    for i in range(len(run.prompt_ids())):
        cap = run.capture(spec, i)
        for name in cap.names():
            t = cap.get(name)
            n += 1
            if not name.endswith("logits_target") and not bool(torch.isfinite(t).all()):
                problems.append(f"prompt {i}: {name} has {int((~torch.isfinite(t)).sum())} NaN/Inf values")
        if FC_IN not in cap.tensors or DRAFT_LOGITS not in cap.tensors:
            problems.append(f"prompt {i}: capture lacks {FC_IN} or {DRAFT_LOGITS}")
    if problems:
        return Verdict(False, "; ".join(problems[:5]), CaptureData())
    wiring = run.capture(spec, 0).meta.wiring or Wiring(source="not recorded")
    inferred = run.inference()
    if inferred is not None:  # `wiring: infer`: say so, with the margin, wherever the wiring is shown
        margin = f", margin {inferred.margin:.3f} over the runner-up" if inferred.margin is not None else ""
        message = (
            f"{n} tensors captured; fc wiring {wiring.inputs} (inferred by `wiring: infer`{margin})\n"
            + "wiring inferred: "
            + "\n".join(inferred.lines())
        )
        return Verdict(True, message, CaptureData(wiring_inference=inferred))
    return Verdict(True, f"{n} tensors captured; fc wiring {wiring.inputs} ({wiring.source})", CaptureData())


def _needs_tensors(run: CaseRun, spec: EngineSpec, check: str) -> None:
    if run.pool.is_live(spec):
        raise NotAvailable(
            f"{check}: not available for {spec.id}: a running server exposes no tensors "
            "(only its acceptance is checked)"
        )


def check_fc_inputs(run: CaseRun, spec: EngineSpec) -> Verdict:
    _needs_tensors(run, spec, "fc_inputs")
    verdict = _divergence_report(run, spec, run.comparisons(spec), _in_fc_scope)
    data = _comparison_data(verdict)
    # what the engine fed fc, by value: the reference's feed when every chunk matched it, else each
    # chunk's best match (None: no reference tensor matches it); the version table reads it
    if data.fc_chunks:
        data.fed = [m.best if m.matched else None for m in data.fc_chunks]
    elif verdict.passed:
        wiring = run.capture(run.options.reference, 0).meta.wiring
        data.fed = list(wiring.inputs) if wiring and wiring.inputs else None
    unrecorded = _unrecorded(run, spec) if verdict.passed else None  # a failure's diagnosis says it already
    if unrecorded:
        verdict.message += "\n" + unrecorded
    return verdict


def check_draft_logits(run: CaseRun, spec: EngineSpec) -> Verdict:
    _needs_tensors(run, spec, "draft_logits")
    diffs = run.comparisons(spec)
    verdict = _divergence_report(run, spec, diffs, _in_draft_scope)
    data = _comparison_data(verdict)
    golden: GoldenData | None
    if not verdict.passed:
        first = data.prompt or 0  # a failing verdict names the first prompt that diverges
        lines, golden = golden_rerun(run, spec, first, diffs[first])
        verdict.message += "".join("\n" + ln for ln in lines)
        data.golden = golden
    elif spec.name != run.options.reference.name:
        # a real engine that can take golden inputs: prompt 0 re-run on the reference's draft.fc_in,
        # so the report shows the engine's draft computing the reference's function on the same input;
        # a confirmation only: a re-run that cannot be made is said, and the passing verdict stands
        try:
            supported = run.capture_golden(spec, 0) is not None
            lines, golden = golden_rerun(run, spec, 0, diffs[0], own_passed=True) if supported else ([], None)
        except DifftestError as e:
            lines, golden = (
                [f"golden inputs (prompt 0): could not be run: {str(e).splitlines()[0]}"],
                GoldenData("error"),
            )
        verdict.message += "".join("\n" + ln for ln in lines)
        if golden is not None:
            data.golden = golden
    return verdict


def check_lint(run: CaseRun, spec: EngineSpec) -> Verdict:
    # each engine read on the code path the run's specs take (vllm[runner=v1]: Model Runner V1) as well as its default
    findings = lint_case(run.prepared, [(s.name, dict(s.params)) for s in run.options.engines])
    errors = [f for f in findings if f.severity == "error"]
    data = LintData(findings=list(findings))
    if not findings:
        return Verdict(True, "draft config: layer ids, norm flags, vocab map and fc width are unambiguous", data)
    head = f"{len(errors)} error(s), {len(findings) - len(errors)} warning(s) in the draft config"
    return Verdict(not errors, head + "\n" + "\n".join(map(str, findings)), data)


def _inputs_moved_by_events(cd: CaptureDiff) -> torch.Tensor | None:
    """Rows of draft.fc_in (whole or any chunk) above noise by an excused numerical event, when the
    fc inputs are within noise as a whole (None otherwise: a diverging input is the wiring's)."""
    fc = [d for d in cd.diffs if in_fc_in(d.name)]
    if not fc or not all(d.ok for d in fc):
        return None
    moved = [rows for name, rows in cd.excused_rows.items() if in_fc_in(name)]
    if not moved:
        return None
    n = max(rows.numel() for rows in moved)
    out = torch.zeros(n, dtype=torch.bool)
    for rows in moved:
        out |= aligned_rows(rows, n)
    return out


def check_top1(run: CaseRun, spec: EngineSpec) -> Verdict:
    """Agreement of the draft's greedy choices, over positions where the reference's choice is clear.

    A position whose reference top-1 margin is within what the measured noise can move
    (difftest.compare.noise.tie_rows) is a tie: either choice is correct, so it is counted apart and
    reported, not judged. Draft steps after a tie that the engine resolved the other way compute
    on another token and are left out (difftest.compare.compare). So is a position whose draft input
    (draft.fc_in, within noise as a whole) is above noise at that row because of a numerical event
    upstream that the comparison excused (an MoE router near-tie sending the token to other
    experts, or target rows the target's own verdict took as noise: CaptureDiff.excused_rows):
    the draft computed there, correctly, on another input. Only the token's own row is left out,
    and none when draft.fc_in diverges: then every disagreement is the wiring's."""
    _needs_tensors(run, spec, "top1_agreement")
    threshold = float(run.case.expect.get("top1_agreement", DEFAULT_TOP1))
    floor = run.noise_floor_for(spec)
    agree = total = ties = tie_agree = skipped = excused = 0
    for i, cd in enumerate(run.comparisons(spec)):
        ref, other = run.capture(run.options.reference, i), run.capture(spec, i)
        inputs_moved = _inputs_moved_by_events(cd)
        for name in (n for n in ref.names() if n.endswith("logits_target")):
            d = cd.get(name)
            if name not in other or (d is not None and d.status == TensorStatus.TIE):
                skipped += 1
                continue
            a, b = ref.get(name), other.get(name)
            if a.shape != b.shape:
                continue
            a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]).to(a.device)
            same = a2.argmax(-1) == b2.argmax(-1)
            tie = noise.tie_rows(a2, floor.threshold(name)).to(same.device)
            event = torch.zeros_like(same)
            if inputs_moved is not None:
                event = aligned_rows(inputs_moved, same.numel()).to(same.device) & ~tie
            judged = ~tie & ~event
            agree += int((same & judged).sum())
            total += int(judged.sum())
            ties += int(tie.sum())
            tie_agree += int((same & tie).sum())
            excused += int(event.sum())
    rate = agree / total if total else 0.0
    msg = (
        f"draft top-1 agreement with {run.reference_label()}: {agree}/{total} = {rate:.3f} over positions with a "
        f"clear reference choice (threshold {threshold}); ties within noise: {ties} ({tie_agree} agree)"
    )
    if excused:
        msg += (
            f"; {excused} positions left out: their {FC_IN} row is above noise by a numerical event the "
            "comparison excused (an MoE router near-tie upstream, or target rows within its noise)"
        )
    if skipped:
        msg += f"; {skipped} step tensors not compared (after a tie the engine resolved the other way)"
    data = Top1Data(
        agree=agree, total=total, rate=rate, ties=ties, ties_agree=tie_agree, noise=floor.source, excused=excused
    )
    if total == 0:
        return Verdict(
            ties > 0,
            msg + ("; every position is a tie: agreement cannot be judged here" if ties else "; nothing to compare"),
            data,
        )
    return Verdict(rate >= threshold, msg, data)


def check_accept_length(run: CaseRun, spec: EngineSpec) -> Verdict:
    """Accept length and per-position acceptance against the reference's, within the noise of the
    measurement (difftest.compare.accept_judge: sampling spread over the verify steps plus the reference's
    measured float64 move), widened only by a tolerance the case declares."""
    tol = run.case.expect.get("accept_length") or None
    if run.pool.is_live(spec):  # a running server is judged by the check its engine contributes (run_check)
        raise NotAvailable(
            f"accept_length: no check for {spec.id}, a running server, is registered "
            "(reinstall difftest: pip install -e .)"
        )
    ref_stats = run.speculate(run.options.reference)
    stats = run.speculate(spec)
    same_tokens, parted = _reference_on_engine_tokens(run, ref_stats, stats)
    if same_tokens is not None:
        # the same tokens on both sides: what differs is the draft's alone (no trajectory, no numerical move)
        ref_stats = same_tokens
        gate = accept_judge.judge(ref_stats, stats, None, tol, "on the engine's own tokens")
    else:
        # the measured numerical move only widens what is allowed, so it is measured (a float64 speculative
        # run of the reference: minutes on a deep target) only when the sampling spread alone fails
        gate = accept_judge.judge(
            ref_stats,
            stats,
            None,
            tol,
            "within the sampling spread alone (the numerical move, which only widens it, not needed)",
        )
        if not gate.ok:
            # an engine whose outputs are the reference's shares every token with it, so its numerical
            # allowance is measured over those tokens (the float64 reference replayed on them), not over
            # the float64 run's own trajectory, which parts at a near-tie (CaseRun.accept_noise)
            same = stats.outputs if stats.outputs and stats.outputs == ref_stats.outputs else None
            numerical, noise_source = run.accept_noise(same)
            gate = accept_judge.judge(ref_stats, stats, numerical, tol, noise_source)
    return Verdict(
        gate.ok,
        accept_judge.message(gate, ref_stats, stats) + parted,
        AcceptLengthData(reference=ref_stats, engine=stats, allowed=gate.allowed_accept, spread=gate.spread, gate=gate),
    )


def _reference_on_engine_tokens(run: CaseRun, ref: AcceptStats, eng: AcceptStats) -> tuple[AcceptStats | None, str]:
    """(the reference's acceptance on the engine's own tokens, what the message adds), or (None, "") where
    the engine's outputs are the reference's (or not reported).

    Greedy speculation is lossless, so an engine's outputs are its target's greedy continuation. Where
    its target resolves a near-tie the other way (bf16 logits one ulp apart: indep-llama bf16, vLLM
    on CPU, docs/verdict.md), every later token differs, and a draft fitted to the reference's
    continuations accepts less there: 1.957 against the reference's simulation's 2.556, while the
    reference draft on vLLM's very tokens accepts exactly vLLM's counts (47 verifies, 45 accepted).
    Counts over different tokens measure the trajectory, not the draft, so the reference replays the
    engine's tokens (Engine.replay, as for a running server) and the gate compares like with like."""
    prompts = run.prompt_ids(speculative=True)
    if not eng.outputs or len(eng.outputs) != len(prompts) or eng.outputs == ref.outputs:
        return None, ""
    if any(not o for o in eng.outputs):
        return None, ""
    if "tree" in ref.source:  # the replay would be a chain or the reference's tree, not the engine's own topk
        return None, "; not judged on the engine's own tokens: the reference simulated a tree"
    ref_spec = run.options.reference
    try:
        rows = run.replay(ref_spec, list(zip(prompts, eng.outputs)), eng.num_draft_steps, 1, eng.num_draft_steps + 1)
    except DifftestError as e:
        return None, f"; not judged on the engine's own tokens: {e}"
    # a near-tie parts trajectories once: given the engine's prefix, the reference target agrees with every
    # later engine token. Where it disagrees more than once in a prompt the engine's outputs are not its
    # target's greedy continuation as the reference computes it (a target that departs, or outputs that are
    # not plain continuations): a replay would measure the reference draft on tokens no target chose, so the
    # simulation comparison stands (found on SGLang 0.5.16's norm_before_fc case: a replay hid the collapse)
    off = [(i, r.target_mismatches) for i, r in enumerate(rows) if r.target_mismatches > 1]
    if off:
        where = ", ".join(f"prompt {i}: {n} tokens" for i, n in off[:3])
        return None, (
            f"; not judged on the engine's own tokens: the reference target picks other tokens than the engine's "
            f"more than once in a prompt ({where}), not a single near-tie"
        )
    total = AcceptStats(0, 0, eng.num_draft_steps, [0] * eng.num_draft_steps, 0, "")
    for r in rows:
        total = total.merge(r.stats)
    parted = [(i, r.first_mismatch) for i, r in enumerate(rows) if r.target_mismatches]
    where = ", ".join(f"prompt {i} at output token {k}" for i, k in parted)
    total.source = f"{run.reference_label()} replay of the engine's own tokens"
    differ = sum(1 for i, o in enumerate(eng.outputs) if i >= len(ref.outputs) or ref.outputs[i] != o)
    note = f"; judged on the engine's own tokens (the reference's simulation accepts {ref.accept_length:.3f}"
    note += f" on its own, {differ} of {len(prompts)} outputs differ): " if ref.outputs else " on its own): "
    if parted:
        note += (
            f"the reference target's greedy token differs from the engine's at {where} (a near-tie in the "
            "target's logits resolved the other way: the engine's target left the reference's trajectory there)"
        )
    else:
        note += "the reference target agrees with every engine token given the engine's prefix"
    return total, note


# The core's checks, registered as an engine registers its own (difftest.base.check_registry.BUILTIN
# names these; an engine's come through the `difftest.checks` entry points).
CAPTURE_CHECK = CheckSpec(
    "capture", check_capture, REFERENCE, "every prompt captures, no NaN/Inf upstream of logits", data=CaptureData
)
LINT_CHECK = CheckSpec(
    "lint", check_lint, REFERENCE, "the draft checkpoint's config: what engines would do differently", data=LintData
)
FC_INPUTS_CHECK = CheckSpec(
    "fc_inputs",
    check_fc_inputs,
    ENGINE,
    "target hidden states and draft.fc_in (per chunk) match the reference",
    data=ComparisonData,
)
DRAFT_LOGITS_CHECK = CheckSpec(
    "draft_logits",
    check_draft_logits,
    ENGINE,
    "everything the draft computes after fc matches, every draft step",
    data=ComparisonData,
)
TOP1_CHECK = CheckSpec(
    "top1_agreement",
    check_top1,
    ENGINE,
    "the draft's greedy choices agree with the reference's",
    data=Top1Data,
    figures=lambda data: [definitions.TOP1],
)


def _accept_figures(data: CheckData | None) -> list[str]:
    """Accept length and per-position acceptance, with each side's own figures converted to them."""
    if not isinstance(data, (AcceptLengthData, ServerAcceptData)):
        return []
    return [definitions.ACCEPT_LENGTH, definitions.PER_POSITION, *data.reference.native, *data.engine.native]


ACCEPT_LENGTH_CHECK = CheckSpec(
    "accept_length",
    check_accept_length,
    ENGINE,
    "accept length and per-position acceptance within the measured noise of the reference's",
    data=AcceptLengthData,
    figures=_accept_figures,
)


def checks_for(case: Case, is_reference: bool, engine: str | None = None) -> tuple[str, ...]:
    """The items a case gets per engine (difftest.base.check_registry.items_for)."""
    return items_for(case, is_reference, engine)


def run_check(name: str, run: CaseRun, spec: EngineSpec) -> Verdict:
    """The item's check, or an engine's replacement of it (e.g. a running server's accept_length)
    where it registered one."""
    return runner(name, spec.name).run(run, spec)
