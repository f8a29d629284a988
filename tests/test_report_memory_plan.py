"""The report's environment section says which memory plan the run followed (difftest.run.memory_plan,
handed over by difftest.run.pool.EnginePool.plan_record): every worker side by side, or one after
another, and why (the budget and each engine's estimated need); in the JSON (schema 4), the Markdown
and the HTML. Reports of schema 2 and 3, which recorded no plan, are still read and say so."""

from __future__ import annotations

import json

import pytest

from difftest.case.case import Case
from difftest.records import CheckResult, EngineEntry, EngineInfo, Report
from difftest.records.case_record import CaseRecord
from difftest.records.memory_plan import EngineNeed, MemoryPlanRecord
from difftest.report import writer
from difftest.report.html_report import render as render_html
from difftest.run import memory_plan as mp

from test_memory_plan import serve_case, stub_pool, two_checkpoint_case


@pytest.fixture
def tiny(tmp_path, monkeypatch) -> Case:
    """A case of two 4000-byte checkpoints, the fake engine beside the reference (their factors:
    0.8 GB each with their overheads)."""
    return two_checkpoint_case(tmp_path, monkeypatch)


def _report(plan: MemoryPlanRecord | None) -> Report:
    record = CaseRecord(
        case="tiny",
        case_file="tiny.yaml",
        case_yaml="target: t\n",
        reference="ref",
        engine_ids=["ref"],
        engines={"ref": EngineEntry(info=EngineInfo(name="ref", version="1"))},
        checks=[CheckResult("ref", "capture", "passed", "12 tensors captured")],
        memory_plan=plan,
    )
    return writer.build(record)


def _planned(case: Case, budget: str) -> MemoryPlanRecord:
    pool = stub_pool(budget, [])
    serve_case(pool, case)
    plan = pool.plan_record(case)
    assert plan is not None
    return plan


ONE_AFTER_ANOTHER = (
    "memory plan: one after another: estimated needs ref 0.8 GB, fake[mode=same] 0.8 GB (1.6 GB together) "
    "exceed 1.2 GB in DIFFTEST_MEMORY_BUDGET"
)


def test_engines_that_do_not_fit_together_are_reported_one_after_another_with_the_budget_and_each_need(tiny):
    r = _report(_planned(tiny, "1.2GB"))
    assert ONE_AFTER_ANOTHER in writer.markdown(r).splitlines()
    assert "<td>memory plan</td><td>" + ONE_AFTER_ANOTHER.removeprefix("memory plan: ") in render_html(r)


def test_engines_that_fit_are_reported_side_by_side_with_the_measured_budget(tiny):
    plan = _planned(tiny, "10GB")
    plan.budget_source = "available"  # as measured on the machine (the stub pool declares its budget)
    said = writer.markdown(_report(plan))
    assert (
        "memory plan: every worker side by side: estimated needs ref 0.8 GB, fake[mode=same] 0.8 GB "
        "(1.6 GB together) fit 10.0 GB available"
    ) in said.splitlines()


def test_a_gpu_engines_need_and_the_gpu_budget_are_both_named():
    plan = MemoryPlanRecord(
        all_at_once=False,
        needs=[EngineNeed("ref", 2 * 10**9), EngineNeed("vllm", 10**9, 80 * 10**9)],
        budget_host_bytes=100 * 10**9,
        budget_gpu_bytes=70 * 10**9,
    )
    assert plan.said() == (
        "one after another: estimated needs ref 2.0 GB, vllm 1.0 GB + 80.0 GB GPU (3.0 GB + 80.0 GB GPU together) "
        "exceed 100.0 GB and 70.0 GB of GPU memory available"
    )


def test_the_plan_record_reads_the_plan_the_pool_made_and_makes_none_itself(tiny):
    pool = stub_pool("1.2GB", [])
    assert pool.plan_record(tiny) is None  # no worker asked for: no plan made, none reported
    serve_case(pool, tiny)
    plan = pool.plan_record(tiny)
    assert plan is not None and not plan.all_at_once
    assert [(n.engine, n.host_bytes > 0, n.gpu_bytes) for n in plan.needs] == [
        ("ref", True, 0),
        ("fake[mode=same]", True, 0),
    ]
    assert (plan.budget_host_bytes, plan.budget_gpu_bytes, plan.budget_source) == (1.2e9, None, mp.BUDGET_ENV)


def test_the_plan_round_trips_through_the_report_json_as_schema_4(tiny, tmp_path):
    r = _report(_planned(tiny, "1.2GB"))
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(r.to_dict()))
    back = Report.load(path)
    assert json.loads(path.read_text())["schema_version"] == 4
    assert back.memory_plan == r.memory_plan and writer.markdown(back) == writer.markdown(r)


@pytest.mark.parametrize("version", [2, 3])
def test_an_older_report_without_a_plan_is_read_and_says_none_was_recorded(tmp_path, version):
    data = _report(None).to_dict()
    data.pop("memory_plan")
    path = tmp_path / "old.json"
    path.write_text(json.dumps({**data, "schema_version": version}))
    r = Report.load(path)
    assert r.memory_plan is None
    assert f"memory plan: {writer.NO_MEMORY_PLAN}" in writer.markdown(r).splitlines()
    assert writer.NO_MEMORY_PLAN in render_html(r)
