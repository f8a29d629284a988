"""End to end through the plugin: golden-input verdicts, the lint item, tree accept length and
the HTML report, from one `pytest cases/` run with several deliberately wrong engines."""

from __future__ import annotations

import re

import pytest

from helpers import TINY_CASE, make_tiny_pair, run_pytest

CASE = TINY_CASE
ENGINES = "ref,ref[wiring=sglang],ref[norm_before_residual=true],fake[mode=diverge,golden=no],ref[topk=2,num_draft_tokens=5]"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("models"))
    (root / "cases").mkdir()
    (root / "cases" / "tiny.yaml").write_text(CASE.format(target=target, draft=draft))
    return run_pytest(root, "cases/", f"--engines={ENGINES}", env={"DIFFTEST_CACHE": str(root / "cache")})


def test_golden_inputs_blame_the_captured_hidden_states(run):
    r = run.outcome("tiny", "ref[wiring=sglang]", "draft_logits")
    assert r["outcome"] == "failed" and r["data"]["golden"]["outcome"] == "matches"
    assert ("golden inputs: on the reference's draft.fc_in, ref[wiring=sglang]'s draft matches ref on every draft tensor: "
            "the engine captured the wrong hidden states; its draft computes correctly") in r["message"]  # fmt: skip


def test_golden_inputs_blame_the_draft_computation(run):
    r = run.outcome("tiny", "ref[norm_before_residual=true]", "draft_logits")
    assert r["data"]["golden"] == {"outcome": "diverges", "first_divergence": "draft.layer0.mlp_out", "tensors": r["data"]["golden"]["tensors"]}
    assert "suspect: the residual or MLP differs after matching attention: norm_before_residual handled differently?" in r["message"]
    assert ("golden inputs: on the reference's draft.fc_in, ref[norm_before_residual=true]'s draft still diverges, first at "
            "draft.layer0.mlp_out") in r["message"]  # fmt: skip
    assert "the engine's draft computes differently" in r["message"]
    assert run.outcome("tiny", "ref[norm_before_residual=true]", "fc_inputs")["outcome"] == "passed"


def test_engine_without_golden_support_says_so(run):
    r = run.outcome("tiny", "fake[mode=diverge,golden=no]", "draft_logits")
    assert r["data"]["golden"] == {"outcome": "unsupported"}
    assert "golden-input re-run: not supported by fake[mode=diverge,golden=no]" in r["message"]


def test_lint_is_a_reference_item(run):
    r = run.outcome("tiny", "ref", "lint")
    assert r["outcome"] == "passed"
    assert [f["code"] for f in r["data"]["findings"]] == ["layer-ids-training"]  # SGLang & co. read [1, 2, 3] as h2..h4
    assert "0 error(s), 1 warning(s) in the draft config" in r["message"]


def test_tree_drafting_reports_per_position_acceptance(run):
    r = run.outcome("tiny", "ref[topk=2,num_draft_tokens=5]", "accept_length")
    engine = r["data"]["engine"]
    assert engine["source"].startswith("ref tree simulation (topk 2, num_draft_tokens 5)")
    assert len(engine["acceptance_rate_per_pos"]) == 3
    assert r["data"]["reference"]["source"].startswith("ref simulation")


def test_html_report_is_written_with_plots_and_reproduce_command(run):
    html = (run.root / "reports" / "tiny.html").read_text()
    assert len(re.findall(r'src="data:image/png;base64,', html)) >= 4
    assert "difftest run" in html and "--engines=ref,ref[wiring=sglang]" in html
    report = run.report("tiny")
    assert report["environment"]["torch"] and report["case_yaml"].startswith("target:")
    assert report["reproduce"].startswith("difftest run ")


def test_progress_lines_while_engines_load_and_run(run):
    assert "[difftest] starting ref[wiring=sglang]" in run.output
    assert "[difftest] ref[wiring=sglang]: capturing tiny prompt 1/2" in run.output
    assert "Captured stdout" not in run.output  # written past pytest's capture, not into failure sections


def test_progress_is_quiet_under_q(run):
    quiet = run_pytest(run.root, "-q", "cases/", "--engines=ref,ref[wiring=sglang]", "--report-dir=reports-q",
                       env={"DIFFTEST_CACHE": str(run.root / "cache")})  # fmt: skip
    assert quiet.returncode == 1
    assert "[difftest]" not in quiet.output


def test_reproduce_command_names_the_engines_and_a_non_first_reference():
    from difftest.report import reproduce_command

    cmd = reproduce_command("cases/t.yaml", ["vllm", "ref"], "ref")
    assert cmd == "difftest run cases/t.yaml --engines=vllm,ref --reference=ref"


def test_reproduce_command_turns_a_baseline_reference_back_into_the_baseline_option():
    from difftest.report import reproduce_command

    cmd = reproduce_command("cases/t.yaml", ["baseline:v1:sglang", "sglang@new"], "baseline:v1:sglang")
    assert cmd == "difftest run cases/t.yaml --engines=sglang@new --baseline=v1:sglang"
