"""`wiring: infer` in a case: infer the training wiring once per case, before anything else runs.

The evidence is a capture of every prompt of the case (its `prompts` and `speculative.prompts`)
holding every `target.h.{k}`: the reference engine `ref` captures all of them whatever the
draft's wiring, so it is asked first with a placeholder wiring (only the target's tensors are
read). When `ref` cannot hold the target, the session's reference takes its place (a training
dump read by `train` holds the layers the trainer dumped, identified by content; an engine
capture holds what that engine exposes), and the inference says which source it used and
searches only the tensors that source holds.

The inferred wiring replaces `wiring: infer` in the case every engine is sent (difftest.run.case_run
CaseRun.prepared), so checks, diagnosis and reports run on it; `CaseRun.inference()` keeps
the full result for the capture item and the report. When the evidence is too weak the case
stops with one line saying so: a guess would make every verdict after it meaningless.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


from difftest.case.case import Case
from difftest.base.registry import calibration_engine
from difftest.run.engine import EngineSpec
from difftest.base.errors import ConfigError, DifftestError, EngineUnavailable
from difftest.base.extensions import draft_loader
from difftest.rules.infer_wiring import WiringInference, evidence_from_captures, infer_from_evidence
from difftest.rules.wiring import trained_layer_ids
from difftest.base.jsonfile import read_json_object

INFER = "infer"


def wants_inference(case: Case) -> bool:
    return isinstance(case.wiring, str) and case.wiring == INFER


def target_family(target: str | Path) -> str:
    cfg = read_json_object(Path(target) / "config.json", "target config")
    kind = str(cfg.get("model_type") or (cfg.get("text_config") or {}).get("model_type") or "")
    return "deepseek" if "deepseek" in kind or "kimi" in kind else "llama"


def evidence_case(case: Case, num_slots: int) -> Case:
    """The case the evidence is captured with: every prompt, a placeholder wiring."""
    prompts, seen = [], set()
    for p in [*case.prompts, *case.spec_prompts]:
        key = json.dumps(dataclasses.asdict(p), sort_keys=True)
        if key not in seen:
            seen.add(key)
            prompts.append(p)
    return dataclasses.replace(
        case,
        path=f"{case.path}#infer-wiring",
        wiring=["h0"] * num_slots,
        layer_ids=None,
        prompts=prompts,
        spec_prompts=[],
    )


def infer_for_case(session, case: Case) -> WiringInference:
    """`case` has its fixtures resolved; `session` gives the run's options and a capture of any case
    (difftest.run.case_run: the case run's evidence source over the engine pool)."""
    loaded = draft_loader().load(case.draft, case.target)
    ev_case = evidence_case(case, loaded.config.num_aux)
    n = len(ev_case.prompts)
    calibration = EngineSpec(calibration_engine())
    sources = [calibration]
    if session.options.reference.id != calibration.id:
        sources.append(session.options.reference)
    errors = []
    for spec in sources:
        try:
            caps = [session.capture(ev_case, spec, i) for i in range(n)]
        except (EngineUnavailable, DifftestError) as e:
            errors.append(f"{spec.id}: {str(e).splitlines()[0]}")
            continue
        if not any(k.startswith("target.h.") for k in caps[0].tensors):
            errors.append(f"{spec.id}: its capture holds no target.h.*")
            continue
        what = (
            "reference target"
            if spec.name == calibration.name
            else f"{spec.id}'s capture ({calibration.id} could not run the target)"
        )
        evidence = evidence_from_captures(caps, f"{what}, {n} prompts (case prompts and speculative prompts)")
        cfg = loaded.config
        ids, _ = trained_layer_ids(case.layer_ids, cfg.layer_ids_eagle_config, cfg.layer_ids_top)
        return infer_from_evidence(loaded.model, ids, evidence, target_family(case.target))
    raise ConfigError(f"{case.path}: wiring: infer: no capture with the target's hidden states ({'; '.join(errors)})")


def inferred_case(session, case: Case) -> tuple[Case, WiringInference]:
    result = infer_for_case(session, case)
    if not result.decided:
        raise ConfigError(f"{case.path}: wiring: infer: {result.headline()}; state `wiring:` explicitly")
    return dataclasses.replace(case, wiring=list(result.wiring)), result
