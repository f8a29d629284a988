"""The float64 run that calibrates a half-precision case (noise floor, the accept gate's numerical
move) computes the model the engines run: the checkpoint's weights rounded to the case's dtype,
then computed exactly. A float32 checkpoint served in bfloat16 is one rounded model for every
engine; calibrating on the unrounded weights measured a different model (on an independent Llama
target and draft: accept length 3.59 against the bf16 run's 2.56, a "numerical move" of 1.04
that hid collapses; on the rounded weights, 2.56 at every position)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch
from helpers import TINY_CASE
from safetensors.torch import load_file, save_file

from difftest.case.case import load_case
from difftest.run.engine import parse_spec
from difftest.run.case_run import calibration_case
from difftest_engines.ref.engine import RefEngine

IDS = [1, 5, 9, 33, 77, 101, 7]


def case_file(root: Path, target: Path, draft: Path, dtype: str) -> Path:
    path = root / f"{dtype}.yaml"
    path.write_text(TINY_CASE.format(target=target, draft=draft) + f"dtype: {dtype}\n")
    return path


def rounded_copy(src: Path, dst: Path, dtype: torch.dtype) -> Path:
    """The checkpoint with its float weights rounded to `dtype` and stored back in their own dtype."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        t = load_file(str(f))
        save_file({k: v.to(dtype).to(v.dtype) if v.is_floating_point() else v for k, v in t.items()}, str(f))
    return dst


def test_a_bf16_cases_calibration_rounds_the_weights_to_bf16(models, tmp_path):
    case = load_case(str(case_file(tmp_path, *models, "bfloat16")))
    exact = calibration_case(case)
    assert (exact.dtype, exact.weights_dtype) == ("float64", "bfloat16")


def test_a_float32_cases_calibration_keeps_the_weights_as_stored(models, tmp_path):
    assert calibration_case(load_case(str(case_file(tmp_path, *models, "float32")))).weights_dtype is None


def test_the_rounded_calibration_is_cached_apart_from_the_unrounded_one(models, tmp_path):
    exact = calibration_case(load_case(str(case_file(tmp_path, *models, "bfloat16"))))
    assert exact.fingerprint() != dataclasses.replace(exact, weights_dtype=None).fingerprint()


def test_the_calibration_run_computes_the_checkpoint_rounded_to_the_cases_dtype(models, tmp_path):
    target, draft = models
    exact = calibration_case(load_case(str(case_file(tmp_path, target, draft, "bfloat16"))))
    rt, rd = rounded_copy(target, tmp_path / "rt", torch.bfloat16), rounded_copy(draft, tmp_path / "rd", torch.bfloat16)
    stored_rounded = dataclasses.replace(exact, target=str(rt), draft=str(rd), weights_dtype=None)
    unrounded = dataclasses.replace(exact, weights_dtype=None)
    engine = RefEngine(parse_spec("ref"))
    a, b, c = (engine.capture(k, IDS) for k in (exact, stored_rounded, unrounded))
    for name in ("target.h.3", "draft.fc_in", "draft.logits"):
        assert a.tensors[name].dtype == torch.float64
        assert torch.equal(a.tensors[name], b.tensors[name]), name
        assert not torch.equal(a.tensors[name], c.tensors[name]), name
