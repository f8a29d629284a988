"""The noise criterion (difftest.compare.noise) as a specification: rows, floors, quorum, localisation, ties."""

from __future__ import annotations

import math

import pytest
import torch

from difftest.compare import noise
from difftest.records.acceptance import AcceptStats, accept_length_spread
from difftest.records.capture import Capture
from difftest.compare.compare import compare_captures
from difftest.compare.noise import NoiseFloor, TensorFloor
from difftest.records.tolerance import TolerancePair

H, N, V = 8, 6, 32


def _capture(seed: int = 0, draft_tokens=(3, 4)) -> Capture:
    g = torch.Generator().manual_seed(seed)
    t = {f"target.h.{k}": torch.randn(N, H, generator=g) for k in range(4)}
    t["target.final_norm"] = torch.randn(N, H, generator=g)
    t["target.logits"] = torch.randn(N, V, generator=g)
    t["draft.fc_in"] = torch.cat([t["target.h.1"], t["target.h.2"]], -1)
    for name in (
        "draft.embeds",
        "draft.fc_out",
        "draft.layer0.attn_out",
        "draft.layer0.mlp_out",
        "draft.hidden_prenorm",
    ):
        t[name] = torch.randn(N, H, generator=g)
    t["draft.layer0.attn_in"] = torch.randn(N, 2 * H, generator=g)
    t["draft.logits"] = torch.randn(N, V, generator=g) * 4
    t["draft.logits_target"] = t["draft.logits"].clone()
    for name in ("embeds", "layer0.attn_in", "layer0.attn_out", "layer0.mlp_out", "hidden_prenorm"):
        t[f"draft.step1.{name}"] = t[f"draft.{name}"][-1:].clone()
    t["draft.step1.logits"] = t["draft.logits"][-1:].clone()
    t["draft.step1.logits_target"] = t["draft.logits"][-1:].clone()
    meta = {
        "wiring": {"inputs": ["target.h.1", "target.h.2"]},
        "num_layers": 3,
        "target_hidden_size": H,
        "draft_tokens": list(draft_tokens),
    }
    return Capture(t, meta)


def _floor(threshold: float = 1e-5) -> NoiseFloor:
    names = _capture().names()
    return NoiseFloor(
        "float32", True, "test", {n: TensorFloor(n, threshold / 10, threshold / 5, N, threshold) for n in names}
    )


def _perturbed(cap: Capture, rel: float, names, rows=None, seed: int = 1) -> Capture:
    g = torch.Generator().manual_seed(seed)
    t = dict(cap.tensors)
    for n in names:
        x = t[n].clone()
        sel = slice(None) if rows is None else rows
        x[sel] = x[sel] + rel * x[sel].norm(dim=-1, keepdim=True) / math.sqrt(x.shape[-1]) * torch.randn(
            x[sel].shape, generator=g
        )
        t[n] = x
    return Capture(t, cap.meta.replace())


def test_row_error_is_the_relative_norm_of_each_row():
    ref = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    other = torch.tensor([[3.0, 4.5], [1.0, 0.0]])
    assert noise.row_rel_err(other, ref).tolist() == pytest.approx([0.1, 0.0])


def test_equal_infinities_are_equal_and_a_nan_makes_the_row_infinitely_wrong():
    ref = torch.tensor([[-math.inf, 1.0], [2.0, 1.0]])
    other = torch.tensor([[-math.inf, 1.0], [math.nan, 1.0]])
    err = noise.row_rel_err(other, ref)
    assert err[0] == 0 and math.isinf(err[1])


def test_a_few_rows_slightly_above_threshold_are_noise_but_one_row_far_above_is_not():
    threshold = 1e-3
    errs = torch.full((40,), 1e-4)
    errs[7] = 2e-3  # one row 2x over: an isolated numerical event
    assert not noise.judge_rows(errs, threshold).diverges
    errs[7] = 1.0  # one row 1000x over: a real fault
    assert noise.judge_rows(errs, threshold).diverges


def test_most_rows_above_threshold_diverge():
    errs = torch.full((40,), 5e-3)
    j = noise.judge_rows(errs, 1e-3)
    assert j.diverges and j.rows_above == 40 and j.excess == pytest.approx(5.0)


def test_the_floor_is_a_quantile_of_the_reference_against_float64_and_sets_the_threshold():
    cap = _capture()
    exact = _capture()
    exact = Capture({n: t.double() for n, t in exact.tensors.items()}, exact.meta.replace())
    noisy = _perturbed(cap, 1e-6, ["draft.fc_out"])
    # prompts enough for noise.MIN_FLOOR_ROWS rows of each step-0 tensor
    floor = noise.measure_floor([(noisy, exact)] * -(-noise.MIN_FLOOR_ROWS // N), "float32", "test")
    f = floor.tensors["draft.fc_out"]
    assert f.measured and f.rows >= noise.MIN_FLOOR_ROWS
    assert 1e-7 < f.floor < 1e-5 and f.threshold == pytest.approx(noise.SAFETY * f.floor)
    # an exact tensor still gets a threshold: the safety factor 10 x float32's unit roundoff 2^-24
    assert floor.tensors["target.h.0"].threshold == pytest.approx(10 * 2.0**-24)


def test_draft_steps_after_the_float64_run_drafted_another_token_are_left_out_of_the_floor():
    cap, exact = _capture(draft_tokens=(3, 4)), _capture(draft_tokens=(5, 4))
    floor = noise.measure_floor([(cap, exact)], "float32", "test")
    assert "draft.step1.logits" not in floor.tensors and "draft.logits" in floor.tensors
    assert floor.excluded and "step 0" in floor.excluded[0]


def test_noise_below_the_threshold_passes_every_tensor():
    ref = _capture()
    other = _perturbed(ref, 1e-7, [n for n in ref.tensors if not n.startswith("draft.fc_in")])
    cd = compare_captures(ref, other, "float32", floor=_floor(1e-5))
    assert cd.ok and cd.first_divergence() is None
    assert cd.first_differs() is not None  # it differs, within noise


def test_error_is_introduced_where_it_jumps_not_where_it_propagates():
    ref = _capture()
    # noise everywhere, then a real fault in the MLP output that propagates downstream
    other = _perturbed(ref, 1e-7, ["draft.fc_out", "draft.layer0.attn_out"])
    other = _perturbed(
        other, 0.5, ["draft.layer0.mlp_out", "draft.hidden_prenorm", "draft.logits", "draft.logits_target"]
    )
    cd = compare_captures(ref, other, "float32", floor=_floor(1e-5))
    assert cd.first_introduced().name == "draft.layer0.mlp_out"
    assert not cd.get("draft.hidden_prenorm").introduced and not cd.get("draft.hidden_prenorm").ok
    assert cd.get("draft.fc_out").ok


def test_a_wrong_fc_chunk_is_introduced_at_the_chunk_when_the_target_matches():
    ref = _capture()
    t = dict(ref.tensors)
    t["draft.fc_in"] = torch.cat([ref.tensors["target.h.2"], ref.tensors["target.h.3"]], -1)  # off by one
    t["draft.fc_out"] = ref.tensors["draft.fc_out"] + 1.0
    cd = compare_captures(ref, Capture(t, ref.meta.replace()), "float32", floor=_floor(1e-5))
    assert cd.first_introduced().name == "draft.fc_in.0"
    assert not cd.get("draft.fc_out").introduced


def test_a_target_layer_that_diverges_is_introduced_there_and_the_fc_chunk_that_copies_it_is_not():
    ref = _capture()
    other = _perturbed(ref, 0.3, ["target.h.2", "target.h.3"])
    t = dict(other.tensors)
    t["draft.fc_in"] = torch.cat([other.tensors["target.h.1"], other.tensors["target.h.2"]], -1)
    cd = compare_captures(ref, Capture(t, ref.meta.replace()), "float32", floor=_floor(1e-5))
    assert cd.first_introduced().name == "target.h.2"
    assert not cd.get("draft.fc_in.1").introduced and not cd.get("draft.fc_in.1").ok


def test_a_case_tolerance_judges_its_tensors_elementwise():
    ref = _capture()
    other = _perturbed(ref, 1e-7, ["draft.fc_out"])
    cd = compare_captures(
        ref, other, "float32", {"draft.fc_out": TolerancePair(atol=0.0, rtol=0.0)}, floor=_floor(1e-5)
    )
    d = cd.get("draft.fc_out")
    assert d.criterion.startswith("elementwise") and d.status == "mismatch"


def test_a_drafted_token_that_differs_at_a_reference_tie_leaves_later_steps_uncompared():
    ref = _capture(draft_tokens=(3, 4))
    t = dict(ref.tensors)
    tied = torch.zeros(1, V)
    tied[0, 3], tied[0, 9] = 5.0, 5.0 - 1e-7  # the reference's top-1 by a hair
    t["draft.logits_target"] = torch.cat([ref.tensors["draft.logits_target"][:-1], tied])
    ref = Capture(t, ref.meta.replace())
    other = Capture({**t, "draft.step1.embeds": t["draft.step1.embeds"] + 1}, ref.meta.replace(draft_tokens=[9, 4]))
    cd = compare_captures(ref, other, "float32", floor=_floor(1e-5))
    assert cd.get("draft.step1.embeds").status == "tie" and cd.ok and "tie" in cd.tie


def test_a_drafted_token_that_differs_where_the_reference_is_clear_is_not_a_tie():
    ref = _capture(draft_tokens=(3, 4))
    t = dict(ref.tensors)
    clear = torch.zeros(1, V)
    clear[0, 3] = 5.0
    t["draft.logits_target"] = torch.cat([ref.tensors["draft.logits_target"][:-1], clear])
    ref = Capture(t, ref.meta.replace())
    other = Capture({**t, "draft.step1.embeds": t["draft.step1.embeds"] + 1}, ref.meta.replace(draft_tokens=[9, 4]))
    cd = compare_captures(ref, other, "float32", floor=_floor(1e-5))
    assert cd.get("draft.step1.embeds").status == "mismatch" and not cd.tie


def test_top1_margins_ignore_the_infinities_outside_the_draft_vocab():
    logits = torch.tensor([[2.0, -math.inf, 1.5, 0.0]])
    margin, rms = noise.top1_margins(logits)
    assert float(margin[0]) == pytest.approx(0.5)
    assert float(rms[0]) == pytest.approx(math.sqrt((4 + 2.25) / 3))


def test_a_margin_within_noise_is_a_tie_and_a_clear_one_is_not():
    logits = torch.tensor([[1.0, 1.0 - 1e-6, 0.0], [3.0, 0.0, 0.0]])
    assert noise.tie_rows(logits, 1e-5).tolist() == [True, False]


def test_accept_length_spread_is_zero_when_every_verify_accepts_the_same():
    stats = AcceptStats(num_verify=10, num_accepted=20, num_draft_steps=3, accepted_per_pos=[10, 10, 0])
    assert accept_length_spread(stats) == 0


def test_accept_length_spread_of_one_bernoulli_position_is_its_standard_error():
    stats = AcceptStats(num_verify=100, num_accepted=50, num_draft_steps=1, accepted_per_pos=[50])
    assert accept_length_spread(stats) == pytest.approx(0.5 / 10)


def test_an_unmeasured_floor_says_so_and_uses_the_dtype_guess():
    floor = noise.unmeasured("bfloat16", "the reference is a training dump")
    assert not floor.measured and "not measured" in floor.source
    assert floor.threshold("draft.fc_out") == 5e-2  # bf16 keeps 8 bits: a few roundings of 2^-8 each


def test_floor_round_trips_through_its_dict():
    floor = _floor()
    assert NoiseFloor.from_dict(floor.to_dict()).tensors == floor.tensors


def _jump_row(cap: Capture, names, row: int, rel: float = 0.5) -> Capture:
    t = dict(cap.tensors)
    for n in names:
        x = t[n].clone()
        x[row] = x[row] + rel * x[row].norm() / math.sqrt(x.shape[-1])
        t[n] = x
    return Capture(t, cap.meta.replace())


def test_one_target_row_that_jumps_is_a_discrete_numerical_event_not_a_divergence():
    # an MoE router choosing another expert at a near-tie moves one position of later layers
    ref = _capture()
    other = _jump_row(ref, ["target.h.2", "target.h.3", "target.final_norm", "target.logits"], row=4)
    cd = compare_captures(ref, other, "float32", floor=_floor(1e-5))
    assert cd.ok and cd.get("target.h.2").rows_above == 1


def test_a_draft_row_inherited_from_such_a_target_row_is_not_a_divergence_either():
    ref = _capture()
    other = _jump_row(ref, ["target.h.2", "target.h.3"], row=4)
    t = dict(other.tensors)
    t["draft.fc_in"] = torch.cat([other.tensors["target.h.1"], other.tensors["target.h.2"]], -1)
    other = _jump_row(Capture(t, ref.meta.replace()), ["draft.fc_out", "draft.layer0.attn_in"], row=4)
    cd = compare_captures(ref, other, "float32", floor=_floor(1e-5))
    assert cd.ok, [d.noise_summary() for d in cd.diffs if not d.ok]


def test_one_draft_row_far_above_noise_that_starts_in_the_draft_is_a_divergence():
    ref = _capture()
    other = _jump_row(ref, ["draft.layer0.attn_out"], row=2)
    cd = compare_captures(ref, other, "float32", floor=_floor(1e-5))
    assert cd.first_introduced().name == "draft.layer0.attn_out"


def test_an_upstream_event_reaches_every_later_position_through_attention():
    # a token re-routed at row 2 changes what rows 3.. attend to: they move too, and are excused
    ref = _capture()
    other = _jump_row(ref, ["target.h.2", "target.h.3"], row=2)
    other = _jump_row(other, ["target.h.3"], row=4, rel=0.2)
    cd = compare_captures(ref, other, "float32", floor=_floor(1e-5))
    assert cd.get("target.h.3").rows_above == 2 and cd.get("target.h.3").ok


def test_a_verdict_judged_against_the_dtypes_guess_does_not_call_its_floor_measured():
    # the Llama-3.1-8B shape in bf16, where the float64 calibration did not fit: every threshold was
    # the guess, and the verdict line said "10 x measured floor 0.005"
    from difftest.compare.compare import noise_summary

    ref = _capture()
    other = _perturbed(ref, 0.5, ["draft.layer0.attn_out"])
    cd = compare_captures(ref, other, "bfloat16", floor=noise.unmeasured("bfloat16", "it did not fit"))
    line = noise_summary(cd.get("draft.layer0.attn_out"))
    assert "measured floor" not in line
    assert "10 x the bfloat16 guess (floor not measured) 0.005" in line


def test_a_verdict_judged_against_a_measured_floor_says_measured():
    from difftest.compare.compare import noise_summary

    ref = _capture()
    other = _perturbed(ref, 0.5, ["draft.layer0.attn_out"])
    cd = compare_captures(ref, other, "float32", floor=_floor(1e-5))
    assert "10 x measured floor 1e-06" in noise_summary(cd.get("draft.layer0.attn_out"))
