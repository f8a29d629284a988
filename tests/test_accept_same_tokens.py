"""The accept gate's numerical move, measured over the same tokens (issue 45 item 1; docs/verdict.md,
"Measured at stop 53").

The gate allows 3 x the sampling spread + the reference's measured float64 move. In half precision
the float64 run parts from the case's own at a near-tie, and a draft fitted to one trajectory accepts
less on the other: measured over each run's own trajectory that move was 0.65-0.69 on the bf16
Qwen3 and DeepSeek-V3 targets, and it hid the collapse of their ids exports. An engine whose outputs
are the reference's is compared over those very tokens, so its numerical allowance is the float64
reference replayed on them (CaseRun.accept_noise with the outputs): 0.000-0.090. An engine whose
outputs differ is judged on the reference's replay of its tokens, with no float64 move at all.
"""

from __future__ import annotations

from types import SimpleNamespace

import independent_models as im
import pytest

from difftest.checks.checks import check_accept_length
from difftest.compare import accept_judge
from difftest.records.acceptance import AcceptStats
from difftest.run.case_run import CaseRun

OUTPUTS = [[1] * 12, [2] * 12]
# the shape of the bf16 Qwen3 cell's off_by_one export (bf16 fit): the reference accepts 3.23, the
# export 2.02 on the same outputs; the float64 run's own trajectory accepts 3.92, on these tokens 3.23
REF = AcceptStats(20, 45, 3, [17, 15, 13], 2, "ref simulation", outputs=OUTPUTS)
EXPORT = AcceptStats(41, 42, 3, [22, 12, 8], 2, "vllm counters", outputs=OUTPUTS)
OWN_TRAJECTORY = AcceptStats(13, 38, 3, [13, 13, 12], 2, "ref in float64", outputs=[[3] * 12, [2] * 12])
SAME_TOKENS = AcceptStats(20, 45, 3, [17, 15, 13], 2, "ref in float64, replayed on given outputs")


class _Run:
    """The CaseRun surface check_accept_length reads; accept_noise answers as CaseRun.accept_noise does:
    over the same tokens where it is given them, else over each run's own trajectory."""

    def __init__(self, ref: AcceptStats, eng: AcceptStats):
        self.case = SimpleNamespace(expect={})
        self.pool = SimpleNamespace(is_live=lambda spec: False)
        self.options = SimpleNamespace(reference="ref")
        self._stats = {"ref": ref, "vllm": eng}
        self.asked: list = []

    def speculate(self, spec):
        return self._stats[spec]

    def prompt_ids(self, speculative: bool = False):
        return [[5, 6, 7], [8, 9, 10]]

    def accept_noise(self, outputs=None):
        self.asked.append(outputs)
        if outputs is not None:
            return (REF, SAME_TOKENS), "numerical move measured: ref in bfloat16 vs float64 on the same tokens"
        return (
            REF,
            OWN_TRAJECTORY,
        ), "numerical move measured: ref in bfloat16 vs float64, each over its own trajectory"


def test_an_engine_whose_outputs_are_the_references_is_allowed_the_move_measured_on_those_tokens():
    run = _Run(REF, EXPORT)
    verdict = check_accept_length(run, "vllm")
    assert run.asked == [OUTPUTS]
    assert verdict.data.gate.numerical_accept == pytest.approx(0.0)
    assert "on the same tokens" in verdict.message


def test_the_same_token_move_makes_the_ids_export_that_the_trajectory_move_hid_collapse():
    # over the float64 run's own trajectory the allowance takes 0.69 more, and the drop of 1.2 passes
    hidden = accept_judge.judge(REF, EXPORT, (REF, OWN_TRAJECTORY))
    assert hidden.accept_ok
    verdict = check_accept_length(_Run(REF, EXPORT), "vllm")
    assert not verdict.passed and verdict.message.startswith("accept length collapsed")


def test_an_engine_whose_outputs_are_not_reported_keeps_the_move_over_each_runs_own_trajectory():
    eng = AcceptStats(EXPORT.num_verify, EXPORT.num_accepted, 3, EXPORT.accepted_per_pos, 2, "server counters")
    run = _Run(REF, eng)
    verdict = check_accept_length(run, "vllm")
    assert run.asked == [None]
    assert "each over its own trajectory" in verdict.message


# -- CaseRun.accept_noise: which float64 run it compares with -----------------------------------


class _Calibration:
    def __init__(self):
        self.replayed: list = []

    def speculate(self, spec):
        return OWN_TRAJECTORY

    def replay_accept(self, spec, requests, steps):
        self.replayed.append((spec, requests, steps))
        return SAME_TOKENS


def _case_run(own: AcceptStats) -> tuple[CaseRun, _Calibration]:
    run = CaseRun(SimpleNamespace(calibration_spec=lambda: SimpleNamespace(id="ref")), SimpleNamespace())
    run._prepared = SimpleNamespace(dtype="bfloat16")
    calibration = _Calibration()
    run.speculate = lambda spec: own
    run.calibration = lambda: calibration
    run.prompt_ids = lambda speculative=False: [[5, 6, 7], [8, 9, 10]]
    return run, calibration


def test_given_the_outputs_the_float64_reference_is_replayed_on_them():
    run, calibration = _case_run(REF)
    pair, source = run.accept_noise(OUTPUTS)
    assert pair == (REF, SAME_TOKENS)
    assert calibration.replayed[0][1:] == ([([5, 6, 7], OUTPUTS[0]), ([8, 9, 10], OUTPUTS[1])], 3)
    assert "on the same tokens (float64 replayed on the bfloat16 run's own outputs)" in source


def test_outputs_the_calibration_engine_did_not_generate_fall_back_to_its_own_trajectory_saying_why():
    run, calibration = _case_run(REF)
    pair, source = run.accept_noise([[9] * 12, [2] * 12])
    assert pair == (REF, OWN_TRAJECTORY) and calibration.replayed == []
    assert "each over its own trajectory (not on the same tokens: ref's outputs in bfloat16 are not" in source


# -- the criterion on a target it was not derived on: DeepSeek-V3 (MLA + MoE), bf16, in-process ------


@pytest.fixture(scope="module")
def deepseek_bf16(tmp_path_factory):
    """The bf16 DeepSeek-V3 case's reference run, its float64 run replayed on the same tokens, and the
    reference serving the permuted-ids miswiring (ref[wiring=reversed]), all in-process."""
    from gate_power import one_thread

    name = "indep-deepseek-v3"
    with one_thread():
        return _deepseek_runs(tmp_path_factory, name, im.TARGETS[name])


def _deepseek_runs(tmp_path_factory, name, spec):
    from difftest.case.case import load_case
    from difftest.run.case_run import calibration_case
    from difftest.run.engine import parse_spec
    from difftest_engines.ref.engine import RefEngine

    case = load_case(str(im.write_cases(tmp_path_factory.mktemp("ds"), [name], ["bfloat16"], lambda _: None)[0].path))
    _, prompts = im.prompts(spec)
    k, n = case.num_steps, case.max_new_tokens
    ref = RefEngine(parse_spec("ref")).speculate(case, prompts, k, n)
    rows = RefEngine(parse_spec("ref")).replay(calibration_case(case), list(zip(prompts, ref.outputs)), k, 1, k + 1)
    same = AcceptStats(0, 0, k, [0] * k, 0, "float64 on the same tokens")
    for r in rows:
        same = same.merge(r.stats)
    own_replay = AcceptStats(0, 0, k, [0] * k, 0, "bf16 one-pass replay")
    for r in RefEngine(parse_spec("ref")).replay(case, list(zip(prompts, ref.outputs)), k, 1, k + 1):
        own_replay = own_replay.merge(r.stats)
    permuted = next(m for m in im.MISWIRES if m.name == "permutation").engine_spec(spec)
    miswired = RefEngine(parse_spec(permuted)).speculate(case, prompts, k, n)
    return SimpleNamespace(ref=ref, same=same, own_replay=own_replay, miswired=miswired)


def test_a_permuted_draft_on_bf16_deepseek_v3_collapses_against_the_same_token_move(deepseek_bf16):
    # measured: 2.714 -> 1.938 (bf16), the permuted draft -0.727; over the float64 run's own trajectory
    # the gate allowed 0.765 ("position 2"), on the same tokens 0.655
    d = deepseek_bf16
    assert d.miswired.outputs == d.ref.outputs  # judged over the same tokens, as an engine would be
    gate = accept_judge.judge(d.ref, d.miswired, (d.ref, d.same))
    assert gate.collapsed, accept_judge.message(gate, d.ref, d.miswired)


def test_the_correct_draft_computed_another_way_on_the_same_tokens_still_passes(deepseek_bf16):
    # the reference's draft over one full-sequence bf16 forward (the replay) rather than the incremental
    # verify: the same draft and tokens, another computation
    d = deepseek_bf16
    gate = accept_judge.judge(d.ref, d.own_replay, (d.ref, d.same))
    assert gate.ok, accept_judge.message(gate, d.ref, d.own_replay)
