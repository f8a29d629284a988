"""The noise criterion in the reports: the JSON records the case's noise floor and, per prompt, where
the error is introduced, the first tensor above noise, the first that differs at all and the tie;
the end-of-session summary's verdicts (same / drifted / regressed) read them. No engine runs here:
the case's run stands on a stub pool and its comparisons are built by hand."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from difftest.records import EngineInfo
from difftest.compare import noise
from difftest.report import writer as report
from difftest.report import upgrade
from difftest.records.acceptance import AcceptStats
from difftest.compare.compare import CaptureDiff, TensorDiff
from difftest.records import AcceptLengthData, CheckResult, Report
from difftest.run.case_run import CaseRun
from difftest.run.phase_clock import PhaseClock


def diff(name, status="ok", err=0.0, threshold=1e-5, introduced=False, differs=None, max_abs=None) -> TensorDiff:
    differs = err > 0 if differs is None else differs
    return TensorDiff(
        name,
        status,
        [3, 4],
        12,
        max_abs=err if max_abs is None else max_abs,
        err=err,
        threshold=threshold,
        noise_floor=threshold / noise.SAFETY,
        excess=err / threshold,
        introduced=introduced,
        differs=differs,
        rows=3,
        rows_above=3 if status == "mismatch" else 0,
    )


def faulty() -> CaptureDiff:
    """target.h.1 moved within noise; draft.fc_in.0 is above noise but explained by nothing it is
    marked for; the error is marked introduced at draft.fc_out; the later steps are a tie."""
    return CaptureDiff(
        [
            diff("target.h.1", err=2e-6),
            diff("draft.fc_in.0", "mismatch", err=3e-5),
            diff("draft.fc_out", "mismatch", err=0.5, introduced=True),
            TensorDiff("draft.step1.logits", "tie", detail="not compared: a tie"),
        ],
        noise_source="measured: test",
        tie="the engine drafted token 5 and the reference 7 at step 0",
    )


FLOOR = noise.NoiseFloor(
    "float32",
    True,
    "measured: ref in float32 vs float64 over 1 prompts",
    {"draft.fc_out": noise.TensorFloor("draft.fc_out", 1e-6, 2e-6, 3, 1e-5)},
    ["prompt 0: draft steps > 0 (float64 drafted another token at step 0)"],
)


class StubPool:
    """The engines as a case's run asks them for its record: each says its name, none failed to start."""

    def __init__(self):
        spec = lambda i: SimpleNamespace(id=i, key=i, name=i)  # noqa: E731
        self.options = SimpleNamespace(engines=[spec("ref"), spec("eng")], reference=spec("ref"))
        self.clock = PhaseClock()

    def engine_info(self, spec):
        return EngineInfo(name=spec.id, version="0")

    def start_error(self, spec):
        return None

    def plan_record(self, case):
        return None  # no worker asked for: no memory plan made


class StubRun(CaseRun):
    """A case's run whose comparisons and noise floor are given (the floor may raise)."""

    def __init__(self, comparisons: dict, floor=FLOOR):
        super().__init__(StubPool(), None)  # type: ignore[arg-type]
        self._comparisons, self._stub_floor, self.floor_calls = comparisons, floor, 0

    def computed_comparisons(self):
        return self._comparisons

    def noise_floor(self):
        self.floor_calls += 1
        if isinstance(self._stub_floor, Exception):
            raise self._stub_floor
        return self._stub_floor


@pytest.fixture()
def case(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("target: t\n")
    return SimpleNamespace(name="c", path=str(path), dtype="float32", precision={})


def build(case, run: StubRun) -> dict:
    # through JSON, as `difftest report` and the summary read it
    run.case = case
    return json.loads(json.dumps(report.build(run.record([])).to_dict(), default=str))


def read(data: dict) -> Report:
    return Report.from_dict(data, "c.json")


# -- the JSON report ------------------------------------------------------------------------------------
def test_report_records_the_cases_noise_floor(case):
    r = build(case, StubRun({"eng": [faulty()]}))
    assert r["noise_floor"] == {
        "dtype": "float32",
        "measured": True,
        "source": "measured: ref in float32 vs float64 over 1 prompts",
        "excluded": ["prompt 0: draft steps > 0 (float64 drafted another token at step 0)"],
        "router_noise": {},
        "tensors": {
            "draft.fc_out": {
                "name": "draft.fc_out",
                "floor": 1e-6,
                "max": 2e-6,
                "rows": 3,
                "threshold": 1e-5,
                "measured": True,
                "source": "",
            }
        },
        # the criterion's constants (difftest.compare.noise), so a report says what it was judged by
        "constants": {
            "safety": 10.0,
            "floor_quantile": 0.9,
            "row_quorum": 0.1,
            "isolated_factor": 10.0,
            "jump": 10.0,
            "tie_factor": 2.0,
            "router_tie_factor": 4.0,
            "min_floor_rows": 20,
            "two_roundings": 2.0,
            "shift_margin": 2.0,
            "shift_min_rows": 10,
        },
    }
    assert r["noise_floor"]["tensors"]["draft.fc_out"]["threshold"] == 1e-5
    assert (r["schema"], r["schema_version"]) == ("difftest.report", 4)


TF32_SOURCE = "measured: ref[matmul=tf32] in float32 vs float64 over 1 prompts"


def test_report_names_each_declared_precision_floor_beside_the_cases_own(case):
    case.precision = {"eng": "tf32"}
    run = StubRun({"eng": [faulty()]})
    run._precision_floors["tf32"] = dataclasses.replace(FLOOR, source=TF32_SOURCE)  # as eng's checks measured it
    r = read(build(case, run))
    assert [(d.engine, d.precision, d.measured, d.source) for d in r.noise_floor.declared] == [
        ("eng", "tf32", True, TF32_SOURCE)
    ]
    assert r.noise_floor.source == FLOOR.source  # the case's own floor stays the section's first line
    assert (
        "- declared precision: `eng` in tf32 (the case's `precision:`), judged against that format's floor "
        f"(measured): {TF32_SOURCE}"
    ) in report.markdown(r).splitlines()


def test_a_declared_precision_no_check_measured_says_its_floor_was_not_measured(case):
    case.precision = {"eng": "bf16"}
    r = read(build(case, StubRun({"eng": [faulty()]})))
    [d] = r.noise_floor.declared
    assert (d.engine, d.precision, d.measured, d.source) == (
        "eng",
        "bf16",
        False,
        "not measured: no tensor check of it ran",
    )


def test_a_case_without_a_declared_precision_records_none(case):
    r = build(case, StubRun({"eng": [faulty()]}))
    assert "declared" not in r["noise_floor"] and "declared precision" not in report.markdown(read(r))


def test_report_records_why_the_noise_floor_could_not_be_computed(case):
    r = build(case, StubRun({"eng": [faulty()]}, floor=RuntimeError("ref cannot load the target\nsecond line")))
    nf = r["noise_floor"]
    assert (nf["measured"], nf["dtype"], nf["tensors"]) == (False, "float32", {})
    assert nf["error"] == "RuntimeError: ref cannot load the target\nsecond line"
    assert nf["source"] == "could not be computed (RuntimeError: ref cannot load the target)"


def test_report_without_comparisons_computes_no_noise_floor(case):
    run = StubRun({})
    r = build(case, run)
    assert r["noise_floor"] is None and run.floor_calls == 0


def test_report_prompt_names_introduced_first_above_noise_first_differs_and_tie(case):
    (p,) = build(case, StubRun({"eng": [faulty()]}))["comparisons"]["eng"]
    assert p["first_divergence"] == p["first_introduced"] == "draft.fc_out"  # what the summary table shows
    assert p["first_above_noise"] == "draft.fc_in.0"
    assert p["first_differs"] == "target.h.1"
    assert p["tie"] == "the engine drafted token 5 and the reference 7 at step 0"
    fc_out = next(t for t in p["tensors"] if t["name"] == "draft.fc_out")
    assert (fc_out["introduced"], fc_out["excess"], fc_out["threshold"]) == (True, 0.5 / 1e-5, 1e-5)


def test_report_first_divergence_falls_back_to_the_first_above_noise_when_none_is_marked_introduced(case):
    cd = CaptureDiff([diff("draft.fc_out", "mismatch", err=0.5), diff("draft.logits", "mismatch", err=0.6)])
    (p,) = build(case, StubRun({"eng": [cd]}))["comparisons"]["eng"]
    assert (p["first_divergence"], p["first_introduced"], p["first_above_noise"]) == (
        "draft.fc_out",
        None,
        "draft.fc_out",
    )


def test_report_prompt_within_noise_has_no_divergence_but_names_the_first_that_differs(case):
    cd = CaptureDiff([diff("target.h.1"), diff("draft.fc_out", err=3e-6)])
    (p,) = build(case, StubRun({"eng": [cd]}))["comparisons"]["eng"]
    assert (p["first_divergence"], p["first_above_noise"], p["first_differs"], p["tie"]) == (
        None,
        None,
        "draft.fc_out",
        "",
    )


def test_markdown_and_html_render_the_report_built_from_a_session(case):
    from difftest.report.html_report import render

    r = read(build(case, StubRun({"eng": [faulty()]})))
    md = report.markdown(r)
    assert "### `eng`, prompt 0: error introduced at `draft.fc_out`" in md
    assert (
        "noise floor (measured, float32): measured: ref in float32 vs float64 over 1 prompts; excluded: prompt 0" in md
    )
    assert "- prompt 0: 1 step tensors not compared: the engine drafted token 5" in md
    assert 'class="noise"' in render(r)


# -- the summary verdicts -------------------------------------------------------------------------------
PASSED = {"fc_inputs": "passed", "draft_logits": "passed", "top1_agreement": "passed", "accept_length": "passed"}


def summary(case, cd: CaptureDiff, outcomes=PASSED, accept=(2.5, 2.5)) -> upgrade.SummaryRow:
    r = read(build(case, StubRun({"eng": [cd]})))
    stats = lambda al: AcceptStats(num_verify=2, num_accepted=round((al - 1) * 2), num_draft_steps=3)  # noqa: E731
    r.checks = [
        CheckResult(
            "eng",
            c,
            o,
            "",
            AcceptLengthData(stats(accept[0]), stats(accept[1]), 0.2, 0.0) if c == "accept_length" else None,
        )
        for c, o in outcomes.items()
    ]
    (row,) = upgrade.summarise(r, Path("reports"))
    return row


def test_summary_bit_identical_is_same(case):
    row = summary(case, CaptureDiff([diff("target.h.1"), diff("draft.fc_out")]))
    assert (row.verdict, row.first_divergence, row.largest_drift) == ("same", "-", "-")


def test_summary_tie_skipped_steps_do_not_make_it_drift(case):
    cd = CaptureDiff(
        [diff("draft.fc_out"), TensorDiff("draft.step1.logits", "tie", detail="not compared")], tie="a tie"
    )
    assert summary(case, cd).verdict == "same"


def test_summary_drifted_names_the_largest_mover_by_excess_not_by_abs_diff(case):
    cd = CaptureDiff(
        [
            diff("target.h.1", err=1e-6, max_abs=0.5),  # large |diff|, 0.1x its threshold
            diff("draft.fc_out", err=5e-6, max_abs=1e-7),
        ]
    )  # small |diff|, 0.5x its threshold
    row = summary(case, cd)
    assert (row.verdict, row.first_divergence) == ("drifted", "-")
    assert row.largest_drift == "draft.fc_out 0.5x noise threshold, err 5.00e-06"
    assert "drifted (draft.fc_out 0.5x noise threshold, err 5.00e-06)" in upgrade.render([row])[1]


def test_summary_regressed_shows_the_introduced_tensor_as_first_divergent(case):
    row = summary(case, faulty(), {**PASSED, "draft_logits": "failed"})
    assert (row.verdict, row.first_divergence) == ("regressed", "draft.fc_out (prompt 0)")
