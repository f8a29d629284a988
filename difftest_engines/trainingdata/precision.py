"""Where difftest's counts cannot equal the trainer's own: the precision of the draft's weights.

`speculators train` (0.9.0 `train/checkpointer.py::SingleGPUCheckpointer.save_checkpoint`, float_dtype
bfloat16) saves every checkpoint in bfloat16, but the validation it logs ran on its float32 master weights
(`train/trainer.py::Trainer.val_epoch`, before the save rounds them). Scoring the saved draft therefore
scores weights each up to one bf16 unit of roundoff (u = 2^-8, relative) away from the ones the trainer
scored. That moves the draft's logits, and flips a prediction only where the top two logits are closer
than the move. Measured on a draft speculators trained here (tests/test_trainer_e2e.py, its float32
master weights kept): the largest logit move was 2.2 u of the row's largest |logit|, and every one of
the 49 flipped predictions in 9,720 had its top two logits within 1 u. A prediction counts as within
reach of the rounding when its top-2 gap is at most TIE_UNITS u of its row's largest |logit|; the
counts can differ from the trainer's by at most the counted positions with such a prediction at a step
<= k (StepCounts.near_ties), which `train-acc` prints. A draft stored in float32 and scored in float32
has no such gap: the counts are the trainer's exactly.

The trainer also validates under autocast in `--hidden-states-dtype` (default bfloat16; run.yaml records
a non-default): bfloat16 arithmetic is a further difference this bound does not cover, and is named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from difftest.api import stored_tensors
from difftest.api import ConfigError
from difftest_engines.trainingdata.split import run_data_settings

UNIT_ROUNDOFF = {"F64": 2.0**-53, "F32": 2.0**-24, "F16": 2.0**-11, "BF16": 2.0**-8}
NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
CODES = {v: k for k, v in NAMES.items()}
TIE_UNITS = 4  # > 2 x the 2.2 u largest logit move measured (module docstring): both top logits may move


@dataclass(frozen=True)
class Precision:
    stored: str  # the coarsest float dtype among the draft's weights (safetensors code)
    scored: str  # the dtype the draft is scored in (torch name)
    trainer_compute: str | None  # the trainer's autocast dtype when its run.yaml is beside the draft

    @property
    def coarsest(self) -> str:
        return max((self.stored, CODES[self.scored]), key=lambda c: UNIT_ROUNDOFF[c])

    @property
    def resolution(self) -> float | None:
        """The top-2 gap (a fraction of the row's largest |logit|) within which a prediction may differ from
        the trainer's float32 master weights; None when weights and scoring are float32 or finer."""
        u = UNIT_ROUNDOFF[self.coarsest]
        return TIE_UNITS * u if u > UNIT_ROUNDOFF["F32"] else None

    def line(self, near_ties: list[int], trainer: str = "") -> str:
        """One line for train-acc: the exact case, or why and by how much the trainer's counts can differ
        (`trainer`: the rules' name, e.g. "speculators>=0.7", for what that trainer is known to save)."""
        compute = ""
        if self.trainer_compute and self.trainer_compute != "float32":
            compute = (
                f"; the trainer validated under {self.trainer_compute} autocast (run.yaml hidden_states_dtype), "
                "a difference this bound does not cover"
            )
        if self.resolution is None:
            return (
                f"precision: weights stored in {NAMES[self.stored]}, scored in {self.scored}: no rounding between these counts "
                f"and float32 master weights{compute}"
            )
        why = f"weights stored in {NAMES[self.stored]}"
        if self.stored == "BF16" and trainer.startswith("speculators"):
            why += " (speculators saves bf16 checkpoints; its logged validation used the float32 master weights)"
        elif self.stored == "BF16":
            why += " (rounded from the weights the trainer validated with, when it trained in float32)"
        return (
            f"precision: {why}, scored in {self.scored}: {' '.join(map(str, near_ties))} counted positions per step "
            f"have a prediction whose top-2 logits are within {self.resolution:.2g} of the row's largest |logit| "
            f"({TIE_UNITS} {NAMES[self.coarsest]} units of roundoff): the trainer's correct counts can differ from "
            f"these by at most that{compute}"
        )


def draft_precision(draft: str | Path, scored: str) -> Precision:
    """The coarsest float dtype the draft's safetensors hold; without safetensors, its config's dtype."""
    tensors, _ = stored_tensors(Path(draft))
    floats = [t.dtype for t in tensors.values() if t.dtype in UNIT_ROUNDOFF]
    if floats:
        stored = max(floats, key=lambda c: UNIT_ROUNDOFF[c])
    else:
        try:
            cfg = json.loads((Path(draft) / "config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
        named = cfg.get("dtype") or cfg.get("torch_dtype") if isinstance(cfg, dict) else None
        stored = CODES.get(str(named), "F32")
    return Precision(stored, scored, trainer_compute(draft))


def trainer_compute(draft: str | Path) -> str | None:
    """`--hidden-states-dtype` of the `speculators train` run that saved the draft (its run.yaml omits the
    default, bfloat16), or None when no readable run.yaml is beside the draft."""
    try:
        found = run_data_settings(draft)
    except ConfigError:  # split.recorded_ratio names the unreadable file when a split needs it
        return None
    return None if found is None else str(found[0].get("hidden_states_dtype", "bfloat16"))
