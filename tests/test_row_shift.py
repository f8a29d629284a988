"""The row shift (difftest.compare.noise, "Why a row shift as well") as a specification: a draft tensor
whose rows all moved by a few floors diverges though no row reaches the threshold; two roundings'
worth does not; the draft is judged on what it adds to what draft.fc_in carries; a quantile needs
rows, a measured floor, and rows no discrete event excused."""

from __future__ import annotations

import torch

from difftest.compare import noise
from difftest.compare.compare import compare_captures, noise_summary
from difftest.compare.noise import NoiseFloor, TensorFloor
from difftest.records.capture import Capture

H, V = 16, 48
FLOOR = 1e-4  # every tensor's measured floor; its threshold is noise.SAFETY times it
DRAFT = ("draft.fc_out", "draft.layer0.attn_out", "draft.layer0.mlp_out", "draft.hidden_prenorm")
AFTER_MLP = ("draft.layer0.mlp_out", "draft.hidden_prenorm", "draft.logits", "draft.logits_target")


def _capture(rows: int, seed: int = 0) -> Capture:
    g = torch.Generator().manual_seed(seed)
    t = {f"target.h.{k}": torch.randn(rows, H, generator=g) for k in range(4)}
    t["draft.fc_in"] = torch.cat([t["target.h.1"], t["target.h.2"]], -1)
    t["draft.embeds"] = torch.randn(rows, H, generator=g)
    for name in DRAFT:
        t[name] = torch.randn(rows, H, generator=g)
    t["draft.layer0.attn_in"] = torch.randn(rows, 2 * H, generator=g)
    t["draft.logits"] = torch.randn(rows, V, generator=g) * 4
    t["draft.logits_target"] = t["draft.logits"].clone()
    meta = {"wiring": {"inputs": ["target.h.1", "target.h.2"]}, "num_layers": 3, "target_hidden_size": H}
    return Capture(t, meta)


def _floor(ref: Capture, measured: bool = True) -> NoiseFloor:
    def one(n: str) -> TensorFloor:
        if measured or not n.startswith("draft.") or n == "draft.fc_in":
            return TensorFloor(n, FLOOR, 2 * FLOOR, 40, noise.SAFETY * FLOOR)
        return TensorFloor(n, FLOOR, 2 * FLOOR, 4, noise.SAFETY * FLOOR, measured=False, source="measured on 4 rows")

    return NoiseFloor("bfloat16", True, "test", {n: one(n) for n in ref.names()})


def _moved(cap: Capture, floors: float, names, rows=None, seed: int = 1) -> Capture:
    """Each chosen row of each named tensor moved by exactly `floors` x FLOOR relative error."""
    g = torch.Generator().manual_seed(seed)
    t = dict(cap.tensors)
    for n in names:
        x = t[n].clone()
        d = torch.randn(x.shape, generator=g)
        d = d / d.norm(dim=-1, keepdim=True) * x.norm(dim=-1, keepdim=True) * floors * FLOOR
        chosen = torch.zeros(x.shape[0], dtype=torch.bool)
        chosen[slice(None) if rows is None else rows] = True
        t[n] = torch.where(chosen[:, None], x + d, x)
    return Capture(t, cap.meta.replace())


def _everywhere(cap: Capture, floors: float) -> Capture:
    """Every compared tensor moved by `floors` floors: a correct engine's own rounding."""
    return _moved(cap, floors, [n for n in cap.names() if n != "draft.embeds" and not n.startswith("draft.fc_in")])


def _fc_in_follows_the_target(cap: Capture) -> Capture:
    t = dict(cap.tensors)
    t["draft.fc_in"] = torch.cat([t["target.h.1"], t["target.h.2"]], -1)
    return Capture(t, cap.meta.replace())


def test_every_draft_row_moved_by_a_few_floors_diverges_though_no_row_reaches_the_threshold():
    ref = _capture(20)
    other = _moved(_fc_in_follows_the_target(_everywhere(ref, 1.0)), 5.0, AFTER_MLP, seed=2)
    cd = compare_captures(ref, other, "bfloat16", floor=_floor(ref))
    mlp = cd.get("draft.layer0.mlp_out")
    assert mlp.rows_above == 0 and not mlp.ok
    assert cd.first_introduced().name == "draft.layer0.mlp_out"
    assert "its rows shifted as a whole" in noise_summary(mlp)


def test_two_roundings_worth_of_shift_is_noise():
    ref = _capture(20)
    other = _fc_in_follows_the_target(_everywhere(ref, noise.TWO_ROUNDINGS * 0.9))
    cd = compare_captures(ref, other, "bfloat16", floor=_floor(ref))
    assert cd.ok, [noise_summary(d) for d in cd.diffs if not d.ok]


def test_a_draft_tensor_is_judged_on_what_it_adds_to_what_draft_fc_in_carries():
    # a target that rounds differently (within its threshold) carries its move into every draft tensor
    ref = _capture(20)
    other = _fc_in_follows_the_target(_everywhere(ref, 6.0))
    cd = compare_captures(ref, other, "bfloat16", floor=_floor(ref))
    assert cd.ok, [noise_summary(d) for d in cd.diffs if not d.ok]


def test_the_same_move_on_the_draft_alone_diverges():
    ref = _capture(20)
    other = _fc_in_follows_the_target(_moved(_everywhere(ref, 1.0), 6.0, DRAFT))
    cd = compare_captures(ref, other, "bfloat16", floor=_floor(ref))
    assert cd.first_introduced().name == "draft.fc_out"


def test_too_few_rows_for_a_quantile_leave_the_shift_unjudged():
    ref = _capture(noise.SHIFT_MIN_ROWS - 1)
    other = _moved(_fc_in_follows_the_target(_everywhere(ref, 1.0)), 5.0, AFTER_MLP, seed=2)
    cd = compare_captures(ref, other, "bfloat16", floor=_floor(ref))
    assert cd.ok, [noise_summary(d) for d in cd.diffs if not d.ok]


def test_a_floor_measured_on_too_few_rows_judges_no_shift():
    ref = _capture(20)
    other = _moved(_fc_in_follows_the_target(_everywhere(ref, 1.0)), 5.0, AFTER_MLP, seed=2)
    cd = compare_captures(ref, other, "bfloat16", floor=_floor(ref, measured=False))
    assert cd.get("draft.layer0.mlp_out").ok


def test_rows_a_discrete_event_upstream_reached_are_left_out_of_the_shift():
    # a token re-routed at row 24 of 30 (target.h.2, far above its threshold, one row: an event) is
    # read by the draft's attention at every later position: those rows move far in the draft only
    ref = _capture(30)
    other = _moved(_everywhere(ref, 1.0), 30.0, ["target.h.2"], rows=slice(24, 25))
    other = _moved(_fc_in_follows_the_target(other), 30.0, ["draft.fc_out", "draft.layer0.attn_in"], rows=slice(24, 25))
    other = _moved(other, 30.0, ["draft.layer0.attn_out", *AFTER_MLP], rows=slice(24, None), seed=3)
    cd = compare_captures(ref, other, "bfloat16", floor=_floor(ref))
    assert cd.ok, [noise_summary(d) for d in cd.diffs if not d.ok]
    assert int(cd.excused_rows["draft.layer0.mlp_out"].sum()) == 6
