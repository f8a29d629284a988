"""The typed records (difftest.records): CaptureMeta, CheckResult with its per-check data kinds, and
Report. Each round-trips through JSON, writes its schema version, and refuses on load an unknown,
missing or wrong-typed field in one line that names the file and the field. The readers (the
summary, the Markdown and HTML, bundle, baselines) take records."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from difftest.report import writer as report_mod
from difftest.report import report_files
from difftest.report import upgrade
from difftest.records.acceptance import AcceptStats
from difftest.records.capture import Capture
from difftest.records.chunk_match import MATCH_REL_DIFF, ChunkMatch, Similarity
from difftest.compare.compare import TensorDiff
from difftest.base.errors import ConfigError
from difftest.records.finding import Finding
from difftest.records import (
    AcceptLengthData,
    CaptureData,
    CaptureMeta,
    CheckResult,
    ComparisonData,
    EngineEntry,
    EngineInfo,
    ExpectedFailureRecord,
    FixData,
    GoldenData,
    LintData,
    NoiseFloorRecord,
    PromptComparison,
    Report,
    ServerAcceptData,
    TensorStatus,
    Top1Data,
    Wiring,
)
from difftest.records import meta as meta_mod
from difftest.records.wiring_inference import Reading, SlotContrast, WiringInference
from difftest_engines.trainingdata.train_check import TrainAccuracyData

STATS = AcceptStats(
    num_verify=4,
    num_accepted=6,
    num_draft_steps=3,
    accepted_per_pos=[3, 2, 1],
    num_prompts=2,
    source="ref simulation",
    outputs=[[1, 2], [3]],
)


def meta() -> CaptureMeta:
    return CaptureMeta(
        engine="ref[wiring=vllm]",
        engine_version="ref-1",
        versions={"torch": "2.13.0"},
        kernels="torch",
        device="cpu",
        dtype="float32",
        prompt_ids=[1, 5, 9],
        target_next_token=7,
        draft_tokens=[3, 4],
        num_layers=6,
        target_hidden_size=64,
        wiring=Wiring(["target.h.2", "target.h.3"], "vllm preset"),
        partial=["target.*"],
        compat=["patched"],
        checkpoints={"draft": "/d"},
        notes=["n"],
        extra={"consistency": {"ok": True}},
    )


DATA = [
    CaptureData(
        wiring_inference=WiringInference(
            decided=True,
            wiring=["target.h.0"],
            agreement=0.9,
            runner_up=None,
            runner_up_agreement=None,
            margin=0.5,
            margin_z=None,
            readings=[Reading("vllm", ["target.h.0"], 0.9), Reading("sglang", None, None)],
            slots=[SlotContrast(0, "target.h.0", "target.h.1", 0.4, 0.5, 4.0, 3.5)],
            shuffled_agreement=0.1,
            shuffled_z=5.0,
            positions=10,
            forwards=3,
            grid_size=9,
            source="s",
            label_source="l",
        )
    ),
    LintData([Finding("layer-ids", "error", "ids differ", ("vllm", "sglang"), "draft.fc_in")]),
    ComparisonData(noise="measured", ties=["prompt 1: a tie"]),
    ComparisonData(
        noise="measured",
        prompt=0,
        tensor="draft.fc_in.0",
        first_divergence="draft.fc_in.0",
        introduced="draft.fc_in.0",
        first_above_noise="draft.fc_in.0",
        first_differs="draft.embeds",
        fc_chunks=[ChunkMatch(0, "target.h.1", "target.h.2", 1.0, 0.99, 0.0, 0.0, 1.0, 0.1, 1.2)],
        similarity=Similarity(["chunk 0"], ["target.h.1", "target.h.2"], [[0.3, None]]),
        rule="vLLM: h[k]",
        rule_predicted=["target.h.2"],
        fix=FixData({"eagle_config": {}}, [1, 2], None, [1, 0], ["x"], ["y"]),
        known_causes=["layer-ids"],
        golden=GoldenData("matches", None, []),
    ),
    Top1Data(agree=9, total=10, rate=0.9, ties=2, ties_agree=1, noise="measured"),
    AcceptLengthData(reference=STATS, engine=STATS, allowed=0.3, spread=0.1),
    ServerAcceptData(
        reference=STATS,
        engine=STATS,
        allowed=0.3,
        spread=0.1,
        server_settings={"topk": 1},
        flags=["f"],
        per_request=[{"judged": True}],
        numbers="exact",
        verdict="PASS",
    ),
    TrainAccuracyData(
        trainer={"full_acc": [0.7]},
        engine={"full_acc": [0.3]},
        engine_wiring=["target.h.2"],
        identification={"summary": "s"},
        skipped=1,
    ),
]


def sample_report() -> Report:
    results = [
        CheckResult("ref", "capture", "passed", "ok", DATA[0]),
        CheckResult("eng", "fc_inputs", "failed", "diverges", DATA[3]),
        CheckResult(
            "eng",
            "accept_length",
            "xfailed",
            "collapsed",
            DATA[5],
            ExpectedFailureRecord("eng", "accept_length", "collapsed"),
        ),
        CheckResult("eng", "draft_logits", "error", "engine crashed"),
    ]
    tensors = [
        TensorDiff(
            "draft.fc_in.0",
            "mismatch",
            [3, 4],
            12,
            max_abs=0.5,
            cosine=0.7,
            err=0.4,
            threshold=1e-5,
            excess=4e4,
            introduced=True,
        )
    ]
    return Report(
        case="tiny",
        case_file="cases/tiny.yaml",
        created="2026-01-01T00:00:00",
        reference="ref",
        accept_length_definition="accepted draft tokens + 1 per verify step",
        engines={"ref": EngineEntry(info=EngineInfo(name="ref", version="1")), "eng": EngineEntry(error="not started")},
        checks=results,
        noise_floor=NoiseFloorRecord("float32", True, "measured"),
        comparisons={
            "eng": [PromptComparison(0, "draft.fc_in.0", "draft.fc_in.0", "draft.fc_in.0", None, "", tensors)]
        },
        environment={"torch": "2.13.0"},
        reproduce="difftest run cases/tiny.yaml --engines=ref,eng",
        case_yaml="target: t\n",
    )


def through_json(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))


def refusal(call) -> str:
    with pytest.raises(ConfigError) as e:
        call()
    message = str(e.value)
    assert "\n" not in message, message
    return message


# -- round trips and versions ----------------------------------------------------------------------------
def test_capture_meta_round_trips_through_json_with_its_schema_version():
    d = through_json(meta().to_dict())
    assert d["schema_version"] == meta_mod.SCHEMA_VERSION == 2
    assert CaptureMeta.from_dict(d, "m.json") == meta()


def test_capture_meta_leaves_fields_at_their_defaults_out_of_the_json():
    d = CaptureMeta(engine="ref", num_layers=6).to_dict()
    assert d == {"schema_version": 2, "engine": "ref", "num_layers": 6}


def test_capture_round_trips_its_typed_meta_through_the_manifest(tmp_path):
    loaded = Capture.load(Capture({"draft.logits": torch.zeros(2, 3)}, meta()).save(tmp_path / "cap"))
    assert loaded.meta == meta() and loaded.meta.wiring.inputs == ["target.h.2", "target.h.3"]


@pytest.mark.parametrize("data", DATA, ids=lambda d: d.kind)
def test_each_check_data_kind_round_trips_inside_a_check_result(data):
    result = CheckResult("eng", "x", "failed", "m", data)
    d = through_json(result.to_dict())
    assert d["schema_version"] == 2 and d["data"]["kind"] == data.kind
    assert CheckResult.from_json(d, "r.json", "checks[0]") == result


def test_accept_stats_in_check_data_keep_their_derived_numbers_in_the_json():
    d = AcceptLengthData(STATS, STATS, 0.3, 0.1).to_dict()
    assert d["engine"]["accept_length"] == 2.5 and d["engine"]["acceptance_rate_per_pos"] == [
        0.75,
        0.5,
        0.25,
    ]


def test_a_chunk_match_keeps_its_noise_bound_and_runner_up_in_the_json():
    m = ChunkMatch(
        0, "target.h.29", "target.h.30", 0.99, 0.98, 1.2e-3, 0.1, 40.0, 2.0, 40.0, 5.5e-3, "target.h.29", 2e-2
    )
    d = through_json(ComparisonData(fc_chunks=[m]).to_dict())
    assert (d["fc_chunks"][0]["bound"], d["fc_chunks"][0]["also"], d["fc_chunks"][0]["matched"]) == (
        5.5e-3,
        "target.h.29",
        False,
    )
    assert ComparisonData.from_json(d, "r.json", "data").fc_chunks == [m]


def test_a_chunk_match_written_before_its_bound_reads_as_the_fixed_bound():
    d = through_json(ComparisonData(fc_chunks=[ChunkMatch(0, "t", "t", 1.0, 1.0, 5e-4, 0.0, 1.0, 0.1)]).to_dict())
    assert not {"bound", "also", "also_rel_diff"} & set(d["fc_chunks"][0])  # the keys older reports hold
    read = ComparisonData.from_json(d, "r.json", "data").fc_chunks[0]
    assert read.bound == MATCH_REL_DIFF and read.matched


def test_report_round_trips_through_json_with_schema_and_version():
    d = through_json(sample_report().to_dict())
    assert (d["schema"], d["schema_version"]) == ("difftest.report", 4)
    assert Report.from_dict(d, "r.json") == sample_report()


def test_a_reports_timings_round_trip_as_a_typed_record():
    from difftest.records.timings import PhaseTime, Timings

    timings = Timings(
        [
            PhaseTime("engine.capture", "engine", 2.5, 4, "ref", "float64"),
            PhaseTime("transfer.read", "harness", 0.01, 4, "ref", "float32", 1 << 20),
        ],
        0.01,
        2.5,
        "scope",
    )
    report = dataclasses.replace(sample_report(), timings=timings)
    assert Report.from_dict(through_json(report.to_dict()), "r.json").timings == timings


def test_a_phase_owned_by_neither_harness_nor_engine_is_refused_naming_the_field():
    from difftest.records.timings import PhaseTime, Timings

    d = through_json(
        dataclasses.replace(
            sample_report(), timings=Timings([PhaseTime("compare", "harness", 1.0, 1)], 1.0, 0.0)
        ).to_dict()
    )
    d["timings"]["phases"][0]["owner"] = "user"
    assert (
        refusal(lambda: Report.from_dict(d, "r.json"))
        == "r.json: timings.phases[0].owner: 'user' is not one of 'harness', 'engine'"
    )


def test_report_json_keeps_the_keys_readers_of_reports_use():
    d = through_json(sample_report().to_dict())
    assert d["engines"]["eng"] == {"error": "not started"}  # no "info": null beside the error
    failed = d["checks"][1]
    assert (failed["engine"], failed["check"], failed["outcome"], failed["data"]["tensor"]) == (
        "eng",
        "fc_inputs",
        "failed",
        "draft.fc_in.0",
    )
    assert d["checks"][2]["data"]["engine"]["accept_length"] == 2.5  # 6 accepted over 4 verify steps, + 1
    assert "data" not in d["checks"][3]  # an error has no data


# -- older versions ----------------------------------------------------------------------------------------
def test_report_of_schema_version_1_is_refused_naming_the_version_and_the_rerun(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(
        json.dumps(
            {"schema": "difftest.report/1", "case": "tiny", "reproduce": "difftest run cases/tiny.yaml --engines=ref"}
        )
    )
    message = refusal(lambda: Report.load(path))
    assert message.startswith(f"{path}: schema_version: report schema version 1 (difftest.report/1")
    assert "this difftest reads version 4" in message and "`difftest run cases/tiny.yaml --engines=ref`" in message


def test_report_of_a_newer_schema_version_is_refused_naming_it():
    d = {**sample_report().to_dict(), "schema_version": 5}
    assert (
        refusal(lambda: Report.from_dict(d, "r.json"))
        == "r.json: schema_version: report schema version 5; this difftest reads 4"
    )


def test_report_of_schema_version_2_is_read_without_routing_or_floor_row_counts():
    d = {**sample_report().to_dict(), "schema_version": 2}
    report = Report.from_dict(d, "r.json")
    assert report.case == sample_report().case


def test_capture_meta_without_schema_version_is_read_as_version_1_its_own_keys_in_extra():
    legacy = {
        "engine": "sglang",
        "num_layers": 6,
        "wiring": {"inputs": ["target.h.1"], "source": "s", "verifier": None},
        "hot_token_id_source": "d2t",
        "consistency": {"ok": True},
    }
    m = CaptureMeta.from_dict(legacy, "manifest.json")
    assert (m.engine, m.num_layers, m.wiring.inputs) == ("sglang", 6, ["target.h.1"])
    assert m.extra == {"hot_token_id_source": "d2t", "consistency": {"ok": True}}


def test_capture_meta_version_1_core_keys_are_still_checked():
    assert (
        refusal(lambda: CaptureMeta.from_dict({"num_layers": "6"}, "manifest.json"))
        == "manifest.json: meta.num_layers: expected an integer or null, got a string"
    )


def test_capture_meta_of_an_unknown_version_is_refused_naming_it():
    message = refusal(lambda: CaptureMeta.from_dict({"schema_version": 9}, "manifest.json"))
    assert message.startswith(
        "manifest.json: meta.schema_version: capture meta schema version 9; this difftest reads 2"
    )


# -- validation: one line naming file and field ------------------------------------------------------------
def _mutated(edit) -> dict:
    d = through_json(sample_report().to_dict())
    edit(d)
    return d


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda d: d.pop("case"), "r.json: case: field missing"),
        (lambda d: d.update(casee="x"), "r.json: casee: unknown field (did you mean 'case'?)"),
        (lambda d: d.update(checks={}), "r.json: checks: expected a list, got an object"),
        (lambda d: d["checks"][1].pop("outcome"), "r.json: checks[1].outcome: field missing"),
        (lambda d: d["checks"][1].update(outcome="fine"), "r.json: checks[1].outcome: 'fine' is not one of 'passed', "),
        (lambda d: d["checks"][1].pop("schema_version"), "r.json: checks[1].schema_version: field missing"),
        (lambda d: d["checks"][1]["data"].pop("kind"), "r.json: checks[1].data.kind: field missing"),
        (
            lambda d: d["checks"][1]["data"].update(kind="comparision"),
            "r.json: checks[1].data.kind: unknown kind 'comparision' (did you mean 'comparison'?)",
        ),
        (
            lambda d: d["checks"][1]["data"].update(prompt="0"),
            "r.json: checks[1].data.prompt: expected an integer or null, got a string",
        ),
        (
            lambda d: d["checks"][1]["data"]["fix"].update(ids=[1, "2"]),
            "r.json: checks[1].data.fix.ids[1]: expected an integer, got a string",
        ),
        (
            lambda d: d["checks"][2]["data"].update(allowed=True),
            "r.json: checks[2].data.allowed: expected a number, got a boolean",
        ),
        (
            lambda d: d["checks"][2]["data"]["engine"].pop("num_verify"),
            "r.json: checks[2].data.engine.num_verify: field missing",
        ),
        (
            lambda d: d["checks"][2]["data"]["engine"].update(num_verfy=1),
            "r.json: checks[2].data.engine.num_verfy: unknown field (did you mean 'num_verify'?)",
        ),
        (
            lambda d: d["checks"][2]["expected_failure"].pop("cause"),
            "r.json: checks[2].expected_failure.cause: field missing",
        ),
        (
            lambda d: d["engines"]["ref"].update(info=[]),
            "r.json: engines.ref.info: expected an object or null, got a list",
        ),
        (
            lambda d: d["comparisons"]["eng"][0].update(prompt=None),
            "r.json: comparisons.eng[0].prompt: expected an integer, got null",
        ),
        (
            lambda d: d["comparisons"]["eng"][0].update(tensorz=[]),
            "r.json: comparisons.eng[0].tensorz: unknown field (did you mean 'tensors'?)",
        ),
        (
            lambda d: d["checks"][1]["data"]["fc_chunks"][0].pop("best"),
            "r.json: checks[1].data.fc_chunks[0].best: field missing",
        ),
        (
            lambda d: d["checks"][1]["data"]["similarity"].update(cosine=[["x"]]),
            "r.json: checks[1].data.similarity.cosine[0][0]: expected a number or null, got a string",
        ),
        (lambda d: d.update(interrupted="yes"), "r.json: interrupted: expected a boolean, got a string"),
    ],
    ids=[
        "missing",
        "unknown",
        "wrong-type",
        "result-missing",
        "outcome-choice",
        "result-version",
        "kind-missing",
        "kind-unknown",
        "data-type",
        "nested-list-item",
        "bool-as-number",
        "stats-missing",
        "stats-unknown",
        "expected-failure",
        "engine-info",
        "comparison-null",
        "comparison-unknown",
        "chunk-missing",
        "similarity-item",
        "interrupted",
    ],
)
def test_bad_report_field_is_refused_in_one_line_naming_file_and_field(edit, expected):
    assert refusal(lambda: Report.from_dict(_mutated(edit), "r.json")).startswith(expected)


@pytest.mark.parametrize(
    "meta_json, expected",
    [
        ({"schema_version": 2, "engnie": "ref"}, "meta.engnie: unknown field (did you mean 'engine'?)"),
        (
            {"schema_version": 2, "wiring": {"inputs": "target.h.1"}},
            "meta.wiring.inputs: expected a list, got a string",
        ),
        ({"schema_version": 2, "prompt_ids": [1, True]}, "meta.prompt_ids[1]: expected an integer, got a boolean"),
        ({"schema_version": 2, "golden_fc_in": 1}, "meta.golden_fc_in: expected a boolean, got an integer"),
        ([], "meta: expected an object, got a list"),
    ],
    ids=["unknown", "nested", "list-item", "bool", "not-an-object"],
)
def test_bad_capture_meta_in_a_manifest_is_refused_naming_the_manifest_and_field(tmp_path, meta_json, expected):
    directory = Capture({"draft.logits": torch.zeros(2, 3)}).save(tmp_path / "cap")
    manifest = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps({**manifest, "meta": meta_json}))
    assert refusal(lambda: Capture.load(directory)) == f"{directory / 'manifest.json'}: {expected}"


def test_adapter_meta_with_an_unknown_key_is_refused_naming_the_engine():
    message = refusal(lambda: Capture({}, {"engine": "sglang", "consistancy": {}}))
    assert message == "capture meta of sglang: consistancy: unknown field (known: " + message.split("(known: ")[1]


# -- the readers read records ---------------------------------------------------------------------------
def test_summary_reads_accept_lengths_and_verdict_from_the_records():
    report = sample_report()
    report.checks = [
        CheckResult("eng", "accept_length", "passed", "ok", AcceptLengthData(STATS, AcceptStats(4, 2, 3), 0.3, 0.1))
    ]
    (row,) = upgrade.summarise(report, Path("reports"))
    assert (row.reference_accept, row.engine_accept) == (2.5, 1.5)
    assert row.first_divergence == "draft.fc_in.0 (prompt 0)"


def test_summary_calls_a_failed_expected_failure_a_changed_expectation():
    report = sample_report()
    report.checks[2].outcome = "failed"
    (row,) = upgrade.summarise(report, Path("reports"))
    assert row.verdict == upgrade.CHANGED


def test_markdown_and_html_render_from_a_report_record():
    from difftest.report.html_report import render

    report = sample_report()
    report.checks.append(
        CheckResult("eng", "fc_inputs", "failed", "m", ComparisonData(rule="SGLang rule", fix=FixData({"a": 1})))
    )
    md = report_mod.markdown(report)
    assert "| `eng` | fc_inputs | failed | diverges |" in md and "## Fix" in md and "SGLang rule" in md
    html = render(report)
    assert "error introduced at <code>draft.fc_in.0</code>" in html and "schema difftest.report version 4" in html


def test_written_report_reads_back_as_the_same_record(tmp_path):
    path = report_files.write(sample_report(), tmp_path)
    assert Report.load(path) == sample_report()
    assert report_mod.is_complete(path)


def test_an_unreadable_previous_report_is_not_complete(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"schema": "difftest.report/1", "case": "tiny"}))
    assert not report_mod.is_complete(path)


def test_bundle_loads_a_report_record(tmp_path):
    from difftest.report import bundle

    path = report_files.write(sample_report(), tmp_path)
    assert bundle.load(path) == sample_report()


def test_report_command_refuses_a_version_1_report_in_one_line(tmp_path, capsys):
    from difftest.cli import main

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"schema": "difftest.report/1", "case": "tiny"}))
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"difftest report: {path}: schema_version: report schema version 1 (difftest.report/1, before typed "
        "records); this difftest reads version 4"
    )


# -- tensor rows: a typed record, the JSON reports were written with -----------------------------------
# Rows exactly as difftest wrote them before the rows were typed (dataclasses.asdict of the
# comparison; the first from a shipped run's catalogue_d2t_missing report), inside a report of the
# same schema version.
ROW_MISMATCH = {
    "name": "draft.step1.logits",
    "status": "mismatch",
    "shape": [1, 512],
    "numel": 512,
    "mismatched": 512,
    "max_abs": 8.413053512573242,
    "max_abs_index": [0, 487],
    "ref_value": -1.4122788906097412,
    "other_value": 7.00077486038208,
    "max_rel": 280.7458801269531,
    "mean_abs": 1.9521583318710327,
    "cosine": 0.4890461075705989,
    "rel_diff": 0.5109547634571722,
    "nonfinite_mismatch": 0,
    "tolerance": "atol=0.0001, rtol=0.0001 (float32 default)",
    "detail": "",
    "nan_ref": 0,
    "nan_other": 0,
    "inf_ref": 0,
    "inf_other": 0,
    "rows": 1,
    "rows_mismatched": 1,
    "worst_row": 0,
    "row_max_abs": [8.413053512573242],
    "row_mismatched": [512],
    "row_cosine": [0.4890461075705989],
    "topk": 5,
    "top1_agree": 0,
    "topk_member": 1,
    "kl_mean": 2.7873947769252614,
    "kl_max": 2.7873947769252614,
    "tv_mean": 0.8165450692176819,
    "tv_max": 0.8165450692176819,
    "criterion": "noise",
    "err": 1.0118506885830794,
    "err_q": 1.0118506885830794,
    "noise_floor": 4.1149027214431495e-07,
    "threshold": 4.114902721443149e-06,
    "rows_above": 1,
    "excess": 245899.0545050383,
    "introduced": False,
    "row_err": [1.0118506885830794],
    "differs": True,
}
ROW_MISSING = '{"name": "draft.fc_out", "status": "missing", "shape": [], "numel": 0, "mismatched": 0, "max_abs": 0.0, "max_abs_index": [], "ref_value": 0.0, "other_value": 0.0, "max_rel": 0.0, "mean_abs": 0.0, "cosine": 1.0, "rel_diff": 0.0, "nonfinite_mismatch": 0, "tolerance": "", "detail": "not captured by the engine", "nan_ref": 0, "nan_other": 0, "inf_ref": 0, "inf_other": 0, "rows": 0, "rows_mismatched": 0, "worst_row": -1, "row_max_abs": [], "row_mismatched": [], "row_cosine": [], "topk": 0, "top1_agree": 0, "topk_member": 0, "kl_mean": 0.0, "kl_max": 0.0, "tv_mean": 0.0, "tv_max": 0.0, "criterion": "noise", "err": Infinity, "err_q": 0.0, "noise_floor": 0.0, "threshold": 0.0, "rows_above": 0, "excess": Infinity, "introduced": false, "row_err": [], "differs": false}'


def _report_with_rows(rows: list) -> dict:
    d = through_json(sample_report().to_dict())
    d["comparisons"]["eng"][0]["tensors"] = rows
    return d


def test_a_report_written_before_typed_rows_loads_them_as_records_and_writes_the_same_json(tmp_path):
    path = tmp_path / "old.json"
    written = _report_with_rows([ROW_MISMATCH, json.loads(ROW_MISSING)])
    path.write_text(json.dumps(written))
    loaded = Report.load(path)
    mismatch, missing = loaded.comparisons["eng"][0].tensors
    assert isinstance(mismatch, TensorDiff) and mismatch.status is TensorStatus.MISMATCH
    assert (mismatch.name, mismatch.excess, mismatch.row_err, mismatch.differs) == (
        "draft.step1.logits",
        245899.0545050383,
        [1.0118506885830794],
        True,
    )
    assert missing.status is TensorStatus.MISSING and missing.err == float("inf") and not missing.ok
    assert json.loads(json.dumps(loaded.to_dict())) == json.loads(path.read_text())


def test_a_computed_row_is_written_as_the_fields_with_the_status_as_its_value():
    row = TensorDiff("draft.fc_out", TensorStatus.TIE, detail="not compared: a tie")
    d = json.loads(
        json.dumps(
            dataclasses.replace(
                sample_report(), comparisons={"eng": [PromptComparison(0, None, None, None, None, "a tie", [row])]}
            ).to_dict()
        )
    )
    written = d["comparisons"]["eng"][0]["tensors"][0]
    # every field, but floor_basis where it is the default (absent reads as measured, as in older reports)
    fields = [f.name for f in dataclasses.fields(TensorDiff) if f.name != "floor_basis"]
    assert written["status"] == "tie" and list(written) == fields


def test_a_tensor_row_with_an_unknown_status_is_refused_naming_the_closest():
    d = _report_with_rows([{**ROW_MISMATCH, "status": "mismatched"}])
    assert refusal(lambda: Report.from_dict(d, "r.json")) == (
        "r.json: comparisons.eng[0].tensors[0].status: 'mismatched' is not one of 'ok', 'mismatch', 'missing', "
        "'allowed-missing', 'shape', 'tie' (did you mean 'mismatch'?)"
    )


def test_a_tensor_row_with_an_unknown_field_is_refused_naming_the_closest():
    d = _report_with_rows([{**ROW_MISMATCH, "exess": 1.0}])
    assert refusal(lambda: Report.from_dict(d, "r.json")).startswith(
        "r.json: comparisons.eng[0].tensors[0].exess: unknown field (did you mean 'excess'?)"
    )


def test_a_row_without_noise_numbers_reads_as_not_judged_by_noise_and_differs_by_its_diff():
    moved = TensorDiff.from_json({"name": "draft.fc_out", "status": "ok", "max_abs": 3e-7}, "r.json", "t")
    still = TensorDiff.from_json({"name": "draft.fc_out", "status": "ok", "max_abs": 0.0}, "r.json", "t")
    assert (moved.has_noise_numbers, moved.by_noise, moved.differs, still.differs) == (False, False, True, False)


def test_the_status_vocabulary_says_which_verdicts_pass_and_which_are_above_noise():
    assert {s.value for s in TensorStatus if s.passes} == {"ok", "allowed-missing", "tie"}
    assert {s.value for s in TensorStatus if s.above_noise} == {"mismatch", "missing", "shape"}
    assert {s.value for s in TensorStatus if s.compared} == {"ok", "mismatch"}


def test_an_accept_gate_is_kept_as_a_record_with_each_positions_z_in_the_json():
    from difftest.compare.accept_judge import AcceptGate, judge

    ref = AcceptStats(num_verify=10, num_accepted=15, num_draft_steps=3, accepted_per_pos=[9, 5, 1])
    eng = AcceptStats(num_verify=10, num_accepted=2, num_draft_steps=3, accepted_per_pos=[2, 0, 0])
    data = AcceptLengthData(ref, eng, 0.3, 0.1, gate=judge(ref, eng, noise="not measured"))
    written = through_json(data.to_dict())
    assert [p["z"] for p in written["gate"]["positions"]] == [p.z for p in data.gate.positions]
    back = CheckResult.from_json(
        through_json(CheckResult("e", "accept_length", "failed", "m", data).to_dict()), "r.json", "c"
    )
    assert isinstance(back.data.gate, AcceptGate) and back.data.gate == data.gate and not back.data.gate.ok


def test_a_replay_row_crosses_the_worker_as_json_and_comes_back_a_record():
    from difftest.records import ReplayRow

    row = ReplayRow(AcceptStats(num_verify=4, num_accepted=6, num_draft_steps=3, accepted_per_pos=[3, 2, 1]), 2, 5)
    back = ReplayRow.from_json(through_json(row.to_dict()), "ref's replay", "replays[0]")
    assert back == row and back.stats.accept_length == row.stats.accept_length
    bad = {**through_json(row.to_dict()), "first_mismatch": "5"}
    assert refusal(lambda: ReplayRow.from_json(bad, "ref's replay", "replays[0]")) == (
        "ref's replay: replays[0].first_mismatch: expected an integer or null, got a string"
    )
