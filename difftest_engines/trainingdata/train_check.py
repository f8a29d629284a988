"""The `train_accuracy` check: the draft's training accuracy with an engine's fc wiring.

Runs for every non-reference engine of a case that names training data
(`engines: {train: {data: ...}}`). It asks the `train` engine for the trainer's accuracy on
the dump (fc exactly as training built it) and again with fc rebuilt as the engine under
test feeds it (its capture's wiring, else its fc chunks matched to the reference target),
and fails when the engine-wired accuracy at TTT step 0 drops by more than
`expect.train_accuracy.atol` (default 0.05): the seed's 74.7% in training vs 34.1% when
fed the way SGLang fed it. It also fails when the accuracy under the trainer's *own* wiring is
below `expect.train_accuracy.min` (default 0.05): then no comparison means anything (0 vs 0
would pass), and the cause is the data or the verifier, not the engine. Only capture requests
travel to engines; the core imports none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from difftest.api import Case
from difftest.api import Definition, trainer_figures
from difftest.api import match_fc_chunks
from difftest.api import EngineSpec
from difftest.api import ConfigError
from difftest.api import ENGINE, CheckSpec
from difftest.api import CheckData
from difftest.api import CaseRun
from difftest.api import Verdict
from difftest.api import FINAL_NORM, hidden_index
from difftest.api import short_name

TRAIN = "train"
DEFAULT_ATOL = 0.05
DEFAULT_MIN = 0.05  # a trained draft scores far above this under its own wiring; chance is 1/draft_vocab
EXPECT_KEYS = ("atol", "min")  # `expect.train_accuracy`: the case parser accepts these (CheckSpec.expect)
STEP0 = Definition(
    "difftest.train_accuracy",
    "the trainer's step-0 accuracy on its own training data, recomputed "
    "with the trainer's rules (full_acc[0]: draft's first prediction equals the target's next token)",
    "as is",
)


@dataclass
class TrainAccuracyData(CheckData):
    """The trainer's accuracy under its own fc wiring and under the engine's (each the train engine's
    `train_accuracy` capture meta: rules, wiring, full_acc / cond_acc per TTT step, ...)."""

    KIND: ClassVar[str] = "train_accuracy"
    trainer: dict[str, object]
    engine: dict[str, object]
    engine_wiring: list[str]  # the canonical tensors the engine fed its fc
    identification: dict[str, object]  # which target layer each dumped tensor is (layer_identity)
    skipped: int  # unusable samples in the dump


def applies(case: Case) -> bool:
    return bool(case.engine_settings(TRAIN).get("data"))


def _trainer_spec(run: CaseRun) -> EngineSpec:
    """The run's own train engine (it may carry data=... parameters), else a plain one."""
    for e in run.options.engines:
        if e.name == TRAIN and e.param("wiring") is None:
            return e
    return EngineSpec(TRAIN)


def engine_wiring(run: CaseRun, spec: EngineSpec) -> tuple[list[str], str]:
    """The canonical names an engine fed its fc with, and how that was found."""
    cap = run.capture(spec, 0)
    names = cap.meta.wiring.inputs if cap.meta.wiring else []
    if names and all(hidden_index(n) is not None or n == FINAL_NORM for n in names):
        return list(names), "the engine's capture"
    ref = run.capture(run.options.reference, 0)
    matches = match_fc_chunks(ref, cap)
    if not matches or any(m.cosine < 0.9999 for m in matches):
        raise ConfigError(
            f"{spec.id}: cannot tell which target tensors its fc chunks are (no exact match in the reference capture)"
        )
    return [m.best for m in matches], "its fc chunks matched to the reference target"


def check_train_accuracy(run: CaseRun, spec: EngineSpec) -> Verdict:
    case = run.case
    expect = case.expect.get("train_accuracy") or {}
    unknown = sorted(set(expect) - set(EXPECT_KEYS))
    if unknown:
        raise ConfigError(
            f"{case.path}: expect.train_accuracy.{unknown[0]}: unknown key (known: {', '.join(EXPECT_KEYS)})"
        )
    atol = float(expect.get("atol", DEFAULT_ATOL))
    floor = float(expect.get("min", DEFAULT_MIN))
    base = _trainer_spec(run)
    trained = run.capture(base, 0).meta.extra
    acc_t = trained["train_accuracy"]
    names, how = engine_wiring(run, spec)
    short = [short_name(n) for n in names]
    rewired = EngineSpec(
        base.name, base.label, tuple(p for p in base.params if p[0] != "wiring") + (("wiring", "+".join(short)),)
    )
    acc_e = run.capture(rewired, 0).meta.extra["train_accuracy"]
    a, b = acc_t["full_acc"][0], acc_e["full_acc"][0]
    fmt = lambda xs: "[" + " ".join(f"{x:.3f}" for x in xs) + "]"  # noqa: E731
    td = trained["train_data"]
    lines = [
        f"training accuracy (TTT step 0, {acc_t['rules']} rules) {b:.3f} with {spec.id}'s fc [{', '.join(short)}] "
        f"({how}) vs {a:.3f} with the trainer's fc [{', '.join(short_name(n) for n in acc_t['wiring'])}]; allowed drop {atol}",
        f"full_acc per step {fmt(acc_e['full_acc'])} vs {fmt(acc_t['full_acc'])}; cond_acc {fmt(acc_e['cond_acc'])} vs {fmt(acc_t['cond_acc'])}",
        f"{td['identification']['summary']}",
        f"training data {td['path']} ({td['format']}): {td['samples']} samples, {td['skipped']} skipped",
    ]
    data = TrainAccuracyData(
        trainer=acc_t,
        engine=acc_e,
        engine_wiring=list(names),
        identification=td["identification"],
        skipped=td["skipped"],
    )
    if not a >= floor:  # NaN (nothing counted) fails too
        lines.insert(
            0,
            (
                f"training accuracy under the trainer's own wiring is {a:.3f} (below expect.train_accuracy.min {floor}): "
                f"the data does not reproduce what the draft learned, so no engine can be judged by it; likely causes: the "
                f"verifier tensor (identification below) is not the one the draft was trained against, the dump does not match the "
                f"draft (other target, other layers, other trainer version: scored with {acc_t['rules']} rules, set "
                f"train[trainer=...]), or the draft is untrained"
            ),
        )
        return Verdict(False, "\n".join(lines), data)
    if b < a - atol:
        lines[0] = "training accuracy collapses under this engine's wiring: " + lines[0]
    return Verdict(b >= a - atol, "\n".join(lines), data)


# registered under the `difftest.checks` entry points (pyproject.toml): every non-reference engine
# of a case that names training data gets the item
def figures(data: CheckData | None) -> list[str]:
    """The figures a result reports (none without a record): the step-0 accuracy and the figures its
    trainer logs."""
    trainer = getattr(data, "trainer", None)
    if not isinstance(trainer, dict):
        return []
    return [STEP0.name, *trainer_figures(str(trainer.get("rules", "")))]


CHECK = CheckSpec(
    "train_accuracy",
    check_train_accuracy,
    ENGINE,
    "the draft's training accuracy with this engine's fc wiring vs the trainer's",
    when=applies,
    data=TrainAccuracyData,
    expect=EXPECT_KEYS,
    figures=figures,
    definitions=(STEP0,),
)
