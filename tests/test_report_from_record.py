"""A report is built from a case's record alone (difftest.records.case_record.CaseRecord), never from
a live run: a record stored as JSON and read back, with no engine, no worker and no case object that
could compute, builds the same report, Markdown and HTML as the record it was written from."""

from __future__ import annotations

import json
from dataclasses import replace

from difftest.compare import noise
from difftest.records import CheckResult, ComparisonData, EngineEntry, EngineInfo, PromptComparison, TensorDiff
from difftest.records.case_record import CaseRecord
from difftest.records.timings import PhaseTime, Timings
from difftest.report import writer as report
from difftest.report.html_report import render as render_html

FLOOR = noise.NoiseFloor(
    "float32",
    True,
    "measured: ref in float32 vs float64 over 1 prompts",
    {"draft.fc_out": noise.TensorFloor("draft.fc_out", 1e-6, 2e-6, 3, 1e-5)},
    [],
)


def _tensor(name: str, status: str, err: float, introduced: bool = False) -> TensorDiff:
    return TensorDiff(
        name,
        status,
        [3, 4],
        12,
        max_abs=err,
        err=err,
        threshold=1e-5,
        noise_floor=1e-6,
        excess=err / 1e-5,
        introduced=introduced,
        differs=err > 0,
        rows=3,
        rows_above=3 if status == "mismatch" else 0,
    )


def _record(case_file: str) -> CaseRecord:
    prompt = PromptComparison(
        prompt=0,
        first_divergence="draft.fc_out",
        first_introduced="draft.fc_out",
        first_above_noise="draft.fc_out",
        first_differs="target.h.1",
        tie="",
        tensors=[_tensor("target.h.1", "ok", 2e-6), _tensor("draft.fc_out", "mismatch", 0.5, introduced=True)],
    )
    failed = CheckResult(
        "eng",
        "draft_logits",
        "failed",
        "eng diverges from ref on 1/1 prompts; prompt 0: error introduced at draft.fc_out",
        ComparisonData(noise=FLOOR.source, prompt=0, tensor="draft.fc_out", introduced="draft.fc_out"),
    )
    return CaseRecord(
        case="c",
        case_file=case_file,
        case_yaml="target: t\n",
        reference="ref",
        engine_ids=["ref", "eng"],
        engines={"ref": EngineEntry(info=EngineInfo(name="ref", version="1")), "eng": EngineEntry(error="not started")},
        checks=[CheckResult("ref", "capture", "passed", "12 tensors captured"), failed],
        comparisons={"eng": [prompt]},
        noise_floor=FLOOR.record(),
        timings=Timings([PhaseTime("check", "harness", 1.5, 1)], harness_seconds=1.5, engine_seconds=0.0),
    )


def _stored(record: CaseRecord, tmp_path) -> CaseRecord:
    path = tmp_path / "c.record.json"
    path.write_text(json.dumps(record.to_dict()))
    return CaseRecord.from_dict(json.loads(path.read_text()), str(path))


def _without_time(data: dict) -> dict:
    return {k: v for k, v in data.items() if k != "created"}


def test_a_stored_record_builds_the_same_report_as_the_live_one(tmp_path):
    record = _record(str(tmp_path / "c.yaml"))
    live, stored = report.build(record), report.build(_stored(record, tmp_path))
    assert _without_time(stored.to_dict()) == _without_time(live.to_dict())
    assert report.markdown(stored) == report.markdown(live)
    # built a moment apart, across a second's boundary now and then (a fresh CI run, stop 54): the creation
    # time the page shows is the one thing allowed to differ
    assert render_html(replace(stored, created=live.created)) == render_html(live)


def test_the_report_shows_what_the_record_holds(tmp_path):
    r = report.build(_stored(_record(str(tmp_path / "c.yaml")), tmp_path))
    assert (r.case, r.reference, r.case_yaml) == ("c", "ref", "target: t\n")
    assert r.engines["eng"].error == "not started" and r.engines["ref"].info.version == "1"
    assert r.result("eng", "draft_logits").outcome == "failed"
    assert r.noise_floor is not None and r.noise_floor.source == FLOOR.source
    assert r.comparisons["eng"][0].first_divergence == "draft.fc_out"
    assert r.timings is not None and r.timings.harness_seconds == 1.5
    assert r.reproduce == f"difftest run {tmp_path / 'c.yaml'} --engines=ref,eng"
    assert "### `eng`, prompt 0: error introduced at `draft.fc_out`" in report.markdown(r)
