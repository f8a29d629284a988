"""End to end through the plugin: golden-input verdicts, the lint item, tree accept length and
the HTML report, from one `pytest cases/` run with several deliberately wrong engines."""

from __future__ import annotations

import re

import pytest

from difftest.compare.noise import MIN_FLOOR_ROWS
from difftest.records import GoldenData

from helpers import TINY_CASE, make_tiny_pair, run_pytest

CASE = TINY_CASE
ENGINES = (
    "ref,ref[wiring=sglang],ref[norm_before_residual=true],fake[mode=diverge,golden=no],ref[topk=2,num_draft_tokens=5]"
)


@pytest.fixture(scope="module")
def wrong_engines_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("models"))
    (root / "cases").mkdir()
    (root / "cases" / "tiny.yaml").write_text(CASE.format(target=target, draft=draft))
    return run_pytest(root, "cases/", f"--engines={ENGINES}", env={"DIFFTEST_CACHE": str(root / "cache")})


def test_golden_inputs_blame_the_captured_hidden_states(wrong_engines_run):
    r = wrong_engines_run.outcome("tiny", "ref[wiring=sglang]", "draft_logits")
    assert r.outcome == "failed" and r.data.golden.outcome == "matches"
    assert (
        "golden inputs: on the reference's draft.fc_in, ref[wiring=sglang]'s draft matches ref on every draft tensor: "
        "the engine captured the wrong hidden states; its draft computes correctly"
    ) in r.message


def test_golden_inputs_blame_the_draft_computation(wrong_engines_run):
    r = wrong_engines_run.outcome("tiny", "ref[norm_before_residual=true]", "draft_logits")
    golden = r.data.golden
    assert (golden.outcome, golden.first_divergence) == ("diverges", "draft.layer0.mlp_out")
    # the tensors that differ on golden inputs: the introduced one and what it feeds, never the fed-in fc_in
    assert "draft.layer0.mlp_out" in golden.tensors and "draft.logits" in golden.tensors
    assert not [t for t in golden.tensors if t.startswith("draft.fc_in") or not t.startswith("draft.")]
    assert (
        "suspect: the residual or MLP differs after matching attention: norm_before_residual handled differently?"
        in r.message
    )
    assert (
        "golden inputs: on the reference's draft.fc_in, ref[norm_before_residual=true]'s draft still diverges, error "
        "introduced at draft.layer0.mlp_out"
    ) in r.message
    assert "the engine's draft computes differently" in r.message
    assert wrong_engines_run.outcome("tiny", "ref[norm_before_residual=true]", "fc_inputs").outcome == "passed"


def test_engine_without_golden_support_says_so(wrong_engines_run):
    r = wrong_engines_run.outcome("tiny", "fake[mode=diverge,golden=no]", "draft_logits")
    assert r.data.golden == GoldenData(outcome="unsupported")  # nothing else recorded
    assert "golden-input re-run: not supported by fake[mode=diverge,golden=no]" in r.message


def test_lint_is_a_reference_item(wrong_engines_run):
    r = wrong_engines_run.outcome("tiny", "ref", "lint")
    assert r.outcome == "passed"
    assert [f.code for f in r.data.findings] == ["layer-ids-training"]  # SGLang & co. read [1, 2, 3] as h2..h4
    assert "0 error(s), 1 warning(s) in the draft config" in r.message


def test_tree_drafting_reports_per_position_acceptance(wrong_engines_run):
    r = wrong_engines_run.outcome("tiny", "ref[topk=2,num_draft_tokens=5]", "accept_length")
    engine = r.data.engine
    assert engine.source.startswith("ref tree simulation (topk 2, num_draft_tokens 5)")
    assert len(engine.acceptance_rate_per_pos) == 3
    assert r.data.reference.source.startswith("ref simulation")


def test_html_report_is_written_with_plots_and_reproduce_command(wrong_engines_run):
    html = (wrong_engines_run.root / "reports" / "tiny.html").read_text()
    assert len(re.findall(r'src="data:image/png;base64,', html)) >= 4
    assert "difftest run" in html and "--engines=ref,ref[wiring=sglang]" in html
    report = wrong_engines_run.report("tiny")
    assert report.environment["torch"] and report.case_yaml.startswith("target:")
    assert report.reproduce.startswith("difftest run ")


def test_report_records_the_measured_noise_floor(wrong_engines_run):
    nf = wrong_engines_run.report("tiny").noise_floor
    assert nf.measured is True and nf.dtype == "float32"
    assert nf.source.startswith("measured: ref in float32 vs float64 over 2 prompts (float64 streamed layer by layer)")
    assert nf.tensors["draft.layer0.mlp_out"].threshold > 0


def test_report_says_which_floors_stand_on_too_few_rows(wrong_engines_run):
    """Two prompts give the later draft steps a handful of rows: each such floor says so, and the
    case's source counts them (the step-0 tensors stand on enough rows and count as measured)."""
    nf = wrong_engines_run.report("tiny").noise_floor
    thin = {name: t for name, t in nf.tensors.items() if not t.measured}
    assert thin and all(
        t.rows < MIN_FLOOR_ROWS and t.source.startswith(f"measured on {t.rows} rows (too few") for t in thin.values()
    )
    assert nf.tensors["draft.layer0.mlp_out"].measured
    assert f"{len(thin)} tensors measured on too few rows (under {MIN_FLOOR_ROWS})" in nf.source


def test_report_names_where_the_error_is_introduced_per_prompt(wrong_engines_run):
    comparisons = wrong_engines_run.report("tiny").comparisons
    for p in comparisons["ref[norm_before_residual=true]"]:
        assert p.first_divergence == p.first_introduced == p.first_above_noise == "draft.layer0.mlp_out"
        assert p.first_differs == "draft.layer0.mlp_out"  # (`tie` is a required field: Report.load checked it)
    for p in comparisons["ref[wiring=sglang]"]:
        assert p.first_divergence == p.first_introduced == "draft.fc_in.0"


def test_html_report_plots_error_against_noise_per_engine(wrong_engines_run):
    html = (wrong_engines_run.root / "reports" / "tiny.html").read_text()
    compared = wrong_engines_run.report("tiny").comparisons
    assert len(compared) == 4 and html.count('<svg class="noise"') == len(compared)
    assert "noise floor (measured, float32): measured: ref in float32 vs float64 over 2 prompts" in html
    assert "error introduced: draft.layer0.mlp_out" in html and "top-1 ties within noise:" in html


def test_markdown_report_tabulates_error_against_noise(wrong_engines_run):
    md = (wrong_engines_run.root / "reports" / "tiny.md").read_text()
    assert "### `ref[norm_before_residual=true]`, prompt 0: error introduced at `draft.layer0.mlp_out`" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| `draft.layer0.mlp_out` |"))
    assert row.endswith("| above noise | **<- introduced** |")


def test_summary_shows_the_introduced_tensor_and_the_verdict(wrong_engines_run):
    rows = {
        ln.split()[1]: ln.split()
        for ln in wrong_engines_run.output.splitlines()
        if ln.startswith("tiny ") and len(ln.split()) > 6
    }
    assert rows["ref[norm_before_residual=true]"][5:9] == ["draft.layer0.mlp_out", "(prompt", "0)", "regressed"]
    assert rows["ref[wiring=sglang]"][5:9] == ["draft.fc_in.0", "(prompt", "0)", "regressed"]


def test_progress_lines_while_engines_load_and_run(wrong_engines_run):
    assert "[difftest] starting ref[wiring=sglang]" in wrong_engines_run.output
    assert "[difftest] ref[wiring=sglang]: capturing tiny prompt 1/2" in wrong_engines_run.output
    # written past pytest's capture, not into failure sections
    out = wrong_engines_run.output
    assert "Captured stdout" not in out, out[out.find("Captured stdout") - 300 :][:2500]


def test_progress_is_quiet_under_q(wrong_engines_run):
    quiet = run_pytest(
        wrong_engines_run.root,
        "-q",
        "cases/",
        "--engines=ref,ref[wiring=sglang]",
        "--out=reports-q",
        env={"DIFFTEST_CACHE": str(wrong_engines_run.root / "cache")},
    )
    assert quiet.returncode == 1
    assert "[difftest]" not in quiet.output


def test_reproduce_command_names_the_engines_and_a_non_first_reference():
    from difftest.report.writer import reproduce_command

    cmd = reproduce_command("cases/t.yaml", ["vllm", "ref"], "ref")
    assert cmd == "difftest run cases/t.yaml --engines=vllm,ref --reference=ref"


def test_reproduce_command_turns_a_baseline_reference_back_into_the_baseline_option():
    from difftest.report.writer import reproduce_command

    cmd = reproduce_command("cases/t.yaml", ["baseline:v1:sglang", "sglang@new"], "baseline:v1:sglang")
    assert cmd == "difftest run cases/t.yaml --engines=sglang@new --baseline=v1:sglang"


def test_report_records_the_memory_plan_the_run_followed(wrong_engines_run):
    """The plan the pool printed is in the report: every engine's estimated need and the budget."""
    report = wrong_engines_run.report("tiny")
    plan = report.memory_plan
    assert plan is not None and [n.engine for n in plan.needs] == list(report.engines)
    assert all(n.host_bytes > 0 for n in plan.needs)
    assert plan.said().startswith("every worker side by side" if plan.all_at_once else "one after another")
