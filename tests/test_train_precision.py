"""What `train-acc` says where its counts cannot equal the trainer's logged ones: the draft's stored precision
(near ties) and speculators' packed rows (cond denominators). Checked against the real trainer's logged
numbers in tests/test_trainer_e2e.py; these tests pin the counting rules by hand."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from difftest_engines.trainingdata.precision import TIE_UNITS, draft_precision
from difftest_engines.trainingdata.train_accuracy import RULES, packing_line, score_steps

SPEC = RULES["speculators"]


def test_a_near_tie_counts_at_its_step_and_every_later_step_of_its_origin():
    N = 6  # origins 0..4; step k target at i+k+1
    targets = torch.arange(N)
    preds = [torch.arange(1, N) + k for k in range(3)]  # always right
    mask = torch.ones(N, dtype=torch.bool)
    near = [torch.zeros(N - 1, dtype=torch.bool) for _ in range(3)]
    near[0][1] = True  # origin 1 may flip at step 0
    near[2][0] = True  # origin 0 may flip at step 2
    c = score_steps(preds, targets, mask, SPEC, near=near)
    assert c.counted == [5, 4, 3]  # origins 0..4, 0..3, 0..2
    assert c.near_ties == [1, 1, 2]  # origin 1 at steps 0, 1, 2; origin 0 from step 2


def test_packed_cond_denominators_add_the_origins_whose_target_lies_past_the_sample_end():
    N = 6
    targets = torch.arange(N)
    preds = [torch.arange(1, N) + k for k in range(3)]  # right wherever the target exists
    mask = torch.ones(N, dtype=torch.bool)
    c = score_steps(preds, targets, mask, SPEC)
    assert c.cond_counted == [5, 4, 3]
    # step 1: origin 4 (its step-1 target is the next sample's) was right at step 0: known, counted packed
    # step 2: origin 3 (steps 0, 1 inside) known; origin 4 also needs a right step 1 on the next sample
    assert c.packed_cond_extra == [0, 1, 1] and c.packed_cond_extra_max == [0, 1, 2]
    assert c.lead_masked == [0, 1, 2]  # the sample's first targets carry loss: packed full counts can gain
    line = packing_line(c)
    assert "cond counted [5, 5, 4] packed, up to [5, 5, 5]" in line and "can gain up to [0, 1, 2]" in line


def test_full_counts_are_packing_free_when_each_sample_starts_with_prompt():
    mask = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool)
    preds = [torch.zeros(5, dtype=torch.long) for _ in range(3)]
    c = score_steps(preds, torch.zeros(6, dtype=torch.long), mask, SPEC)
    assert c.lead_masked == [0, 0, 0] and "full counts are the same packed" in packing_line(c)


def test_specforge_rules_have_no_packing_line():
    c = score_steps(
        [torch.zeros(5, dtype=torch.long)],
        torch.zeros(6, dtype=torch.long),
        torch.ones(6, dtype=torch.bool),
        RULES["specforge"],
    )
    assert packing_line(c) is None


def _draft(tmp_path, dtype, run_yaml=None):
    d = tmp_path / "ckpt" / "0"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({}))
    save_file(
        {"fc.weight": torch.zeros(2, 2, dtype=dtype), "d2t": torch.zeros(2, dtype=torch.long)},
        str(d / "model.safetensors"),
    )
    if run_yaml is not None:
        (tmp_path / "ckpt" / "run.yaml").write_text(run_yaml)
    return d


def test_a_float32_draft_scored_in_float32_has_no_precision_gap(tmp_path):
    p = draft_precision(
        _draft(tmp_path, torch.float32, "train:\n  data:\n    hidden_states_dtype: float32\n"), "float32"
    )
    assert p.resolution is None and "no rounding between these counts" in p.line([])


def test_a_bf16_draft_reports_its_near_ties_and_the_trainers_bf16_autocast(tmp_path):
    p = draft_precision(
        _draft(tmp_path, torch.bfloat16, "train:\n  seed: 0\n"), "float32"
    )  # run.yaml omits the bf16 default
    assert p.resolution == TIE_UNITS * 2.0**-8 and p.trainer_compute == "bfloat16"
    line = p.line([3, 5, 8], "speculators>=0.7")
    assert line.startswith("precision: weights stored in bfloat16 (speculators saves bf16 checkpoints")
    assert "3 5 8 counted positions per step" in line and "bfloat16 autocast (run.yaml hidden_states_dtype)" in line


def test_a_bf16_draft_of_another_trainer_is_not_said_to_be_speculators(tmp_path):
    p = draft_precision(_draft(tmp_path, torch.bfloat16), "float32")
    line = p.line([3], "specforge")
    assert line.startswith("precision: weights stored in bfloat16 (rounded from the weights the trainer validated")
    assert "speculators" not in line


def test_a_float32_draft_scored_in_bf16_counts_near_ties_at_bf16_resolution(tmp_path):
    p = draft_precision(_draft(tmp_path, torch.float32), "bfloat16")
    assert p.resolution == TIE_UNITS * 2.0**-8 and p.trainer_compute is None
