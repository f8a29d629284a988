"""The draft's top-1 agreement judges the draft where its inputs agree: a position whose logits are
above noise because of a numerical event upstream that the comparison excused (an MoE router
near-tie sending the token to other experts: seen on a bf16 DeepSeek-V3 target in vLLM, 54/56
agreement on a correctly wired draft) is counted apart, and a flip that starts in the draft is not."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from test_noise import _capture, _floor, _jump_row

from difftest.case.case import Case
from difftest.checks.checks import check_top1
from difftest.compare.compare import compare_captures
from difftest.run.engine import EngineSpec

REF, ENG = EngineSpec("ref"), EngineSpec("vllm")
EVENT_ROW = 4  # target.h rows N-1 .. : _capture has N rows


def flipped_logits(cap, row: int):
    """The draft's logits at `row` with another top-1 (its first choice pushed far below)."""
    t = dict(cap.tensors)
    for name in ("draft.logits", "draft.logits_target"):
        x = t[name].clone()
        x[row, x[row].argmax()] -= 100.0
        t[name] = x
    return type(cap)(t, cap.meta.replace())


def after_target_event(ref, row: int):
    """A token re-routed at `row`: its target rows jump, and the draft computes on that input there."""
    other = _jump_row(ref, ["target.h.2", "target.h.3"], row=row)
    t = dict(other.tensors)
    t["draft.fc_in"] = torch.cat([other.tensors["target.h.1"], other.tensors["target.h.2"]], -1)
    chain = [
        "draft.fc_out",
        "draft.layer0.attn_in",
        "draft.layer0.attn_out",
        "draft.layer0.mlp_out",
        "draft.hidden_prenorm",
    ]
    other = _jump_row(type(ref)(t, ref.meta.replace()), chain, row=row)
    return flipped_logits(other, row)


@dataclass
class FakeRun:
    """What check_top1 reads of a case's run: one prompt's captures, their comparison and the floor."""

    ref: object
    other: object
    floor: object = field(default_factory=lambda: _floor(1e-5))

    @dataclass
    class options:
        reference = REF

    class pool:
        @staticmethod
        def is_live(spec) -> bool:
            return False

    @property
    def case(self):
        return CASE

    def noise_floor(self):
        return self.floor

    def noise_floor_for(self, spec):  # the floor an engine is judged against (no precision declared here)
        return self.floor

    def comparisons(self, spec):
        return [compare_captures(self.ref, self.other, "float32", floor=self.floor)]

    def capture(self, spec, i):
        return self.ref if spec == REF else self.other

    def reference_label(self) -> str:
        return REF.id


CASE = Case(name="c", path="c.yaml", target="t", draft="d")


def test_logits_rows_after_an_excused_target_event_are_marked_excused():
    ref = _capture()
    cd = compare_captures(ref, after_target_event(ref, EVENT_ROW), "float32", floor=_floor(1e-5))
    assert cd.excused_rows["draft.logits_target"].nonzero().flatten().tolist() == [EVENT_ROW]


def test_a_flip_that_starts_in_the_draft_marks_nothing_excused():
    ref = _capture()
    cd = compare_captures(ref, flipped_logits(ref, EVENT_ROW), "float32", floor=_floor(1e-5))
    assert "draft.logits_target" not in cd.excused_rows


def test_top1_leaves_out_a_position_after_an_excused_event_and_says_so():
    ref = _capture()
    verdict = check_top1(FakeRun(ref, after_target_event(ref, EVENT_ROW)), ENG)
    assert verdict.passed and verdict.data.excused >= 1 and verdict.data.rate == 1.0
    assert "positions left out" in verdict.message and "MoE router near-tie" in verdict.message


def test_top1_still_counts_a_flip_that_starts_in_the_draft():
    ref = _capture()
    verdict = check_top1(FakeRun(ref, flipped_logits(ref, EVENT_ROW)), ENG)
    assert verdict.data.excused == 0 and verdict.data.agree == verdict.data.total - 1
