"""The accept-length gate (difftest.compare.accept_judge): per position, against the measurement's noise.

Judged on simulated speculative runs: chains whose position j is accepted with a known conditional
probability, sampled with seeded generators, so the gate's false-alarm rate and its power are
measured here, not assumed.
"""

from __future__ import annotations

import random

import pytest

from difftest.compare import accept_judge
from difftest.records.acceptance import AcceptStats
from difftest.records.tolerance import TolerancePair


def chains(cond: list[float], verifies: int, seed: int) -> AcceptStats:
    """`verifies` verify steps of a k-token chain; position j accepted with probability cond[j] given
    positions < j were (the chain stops at the first rejection)."""
    rng = random.Random(seed)
    per_pos, accepted = [0] * len(cond), 0
    for _ in range(verifies):
        for j, c in enumerate(cond):
            if rng.random() >= c:
                break
            per_pos[j] += 1
            accepted += 1
    return AcceptStats(verifies, accepted, len(cond), per_pos, 1, source="simulated")


def exact(rates: list[float], verifies: int) -> AcceptStats:
    per_pos = [round(r * verifies) for r in rates]
    return AcceptStats(verifies, sum(per_pos), len(rates), per_pos, 1, source="exact")


def test_z_limit_is_three_sigma_for_one_position_and_bonferroni_for_more():
    assert accept_judge.z_limit(1) == pytest.approx(3.0)
    assert accept_judge.z_limit(3) == pytest.approx(3.32, abs=0.01)
    assert accept_judge.z_limit(5) > accept_judge.z_limit(3)


def test_identical_runs_pass_with_every_position_within_noise():
    s = chains([0.8, 0.7, 0.6], 200, seed=1)
    gate = accept_judge.judge(s, s)
    assert gate.ok and gate.first_failing_position() is None
    assert "every position within noise" in gate.summary()


def test_a_regression_at_one_deep_position_fails_naming_it_though_the_mean_moved_under_ten_percent():
    ref = exact([0.9, 0.8, 0.7], 400)
    eng = exact([0.9, 0.8, 0.35], 400)
    assert abs(eng.accept_length - ref.accept_length) / ref.accept_length < 0.11  # a fixed 10% gate passes it
    gate = accept_judge.judge(ref, eng)
    assert not gate.ok
    bad = gate.first_failing_position()
    assert bad.position == 2 and bad.engine == pytest.approx(0.35) and bad.reference == pytest.approx(0.7)
    message = accept_judge.message(gate, ref, eng)
    assert "position 2 acceptance fell to 0.350 from 0.700" in message


def test_a_mean_collapse_is_named_as_a_collapse():
    ref, eng = exact([0.9, 0.8, 0.7], 200), exact([0.2, 0.05, 0.0], 200)
    gate = accept_judge.judge(ref, eng)
    assert gate.collapsed and accept_judge.message(gate, ref, eng).startswith("accept length collapsed: ")


def test_two_samples_of_one_draft_raise_false_alarms_at_the_design_rate():
    # 600 pairs of independent short runs (40 verify steps) of the same acceptance: the design rate
    # is FAMILY_ALPHA (0.27%) per gate, plus the accept-length test's; allow up to 2%
    cond = [0.8, 0.6, 0.5]
    alarms = sum(not accept_judge.judge(chains(cond, 40, 2 * i), chains(cond, 40, 2 * i + 1)).ok for i in range(600))
    assert alarms / 600 <= 0.02, alarms


def test_a_real_ten_point_drop_at_position_zero_is_caught_on_a_long_run():
    # 1600 verify steps: the drop is ~6.5 standard errors, so the 3.3-sigma gate catches nearly all
    caught = sum(
        not accept_judge.judge(chains([0.8, 0.6, 0.5], 1600, 2 * i), chains([0.7, 0.6, 0.5], 1600, 2 * i + 1)).ok
        for i in range(50)
    )
    assert caught >= 48, caught


def test_the_measured_numerical_move_widens_each_position_by_exactly_that_much():
    ref, eng = exact([0.8, 0.6], 100), exact([0.8, 0.6], 100)
    dtype_run, f64_run = exact([0.8, 0.6], 100), exact([0.75, 0.5], 100)
    gate = accept_judge.judge(ref, eng, (dtype_run, f64_run))
    assert [p.numerical for p in gate.positions] == pytest.approx([0.05, 0.1])
    assert [p.allowed - gate.z * p.se for p in gate.positions] == pytest.approx([0.05, 0.1])
    assert gate.numerical_accept == pytest.approx(0.15)
    assert "numerical move measured" in gate.noise


def test_without_a_measurement_the_gate_says_the_numerical_move_was_not_measured():
    s = exact([0.5], 50)
    assert "not measured" in accept_judge.judge(s, s).noise


def test_a_declared_tolerance_widens_the_accept_length_but_not_the_positions():
    ref, eng = exact([0.9, 0.8, 0.7], 400), exact([0.9, 0.8, 0.35], 400)
    gate = accept_judge.judge(ref, eng, tolerance=TolerancePair(atol=0.5, rtol=0.0))
    assert gate.accept_ok and not gate.ok
    assert accept_judge.message(gate, ref, eng).startswith("acceptance collapsed at position 2: ")


def test_an_engine_without_per_position_counts_gets_no_per_position_verdict():
    ref = exact([0.9, 0.8], 100)
    eng = AcceptStats(100, ref.num_accepted, 2, [], 1, source="totals only")
    gate = accept_judge.judge(ref, eng)
    assert gate.positions == [] and gate.ok
    assert "per-position counts not reported by the engine" in gate.noise


def test_an_engine_drafting_fewer_positions_fails_at_the_first_missing_one():
    ref, eng = exact([0.9, 0.8, 0.7], 200), exact([0.9], 200)
    bad = accept_judge.judge(ref, eng).first_failing_position()
    assert bad.position == 1 and bad.engine == 0.0


def test_gate_round_trips_to_a_dict_with_each_positions_z():
    ref, eng = exact([0.9, 0.8, 0.7], 400), exact([0.9, 0.8, 0.35], 400)
    d = accept_judge.judge(ref, eng).to_dict()
    assert d["positions"][2]["z"] > d["z"] and d["positions"][0]["z"] == 0.0
