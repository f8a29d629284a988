"""The shipped cases, run as a user runs them: `pytest cases/... --engines=ref,"ref[wiring=...]"`
on the built-in tiny models (built once into the cache).

The `ref` lane of these runs is the shipped run's (tests/shipped_run.py): each run waits for it
and reads the reference's captures from the capture cache, so only the other lane is computed."""

from __future__ import annotations

import shutil

import pytest

from helpers import ROOT, run_pytest
from shipped_run import reference_captures


def shipped_cases_project(tmp_path_factory):
    """A copy of cases/ in a scratch root, so reports do not land in the repository; the shipped
    run's reference captures in the cache first."""
    reference_captures()
    root = tmp_path_factory.mktemp("project")
    shutil.copytree(ROOT / "cases", root / "cases")
    return root


# The shipped cases this module judges on vLLM's wiring: the tiny pair, the case reading its prompts
# from a file (cases/prompts/), the seed and its inferred
# twin, and every catalogue case (its lint, and that it fails only as declared). The DeepSeek cases
# are judged on the presets by tests/test_cases_deepseek.py and tests/test_deepseek_fixture.py, and
# every shipped case on the engines themselves by the shipped run (tests/test_shipped_cases.py).
JUDGED = (
    "tiny_llama",
    "tiny_llama_speculators",
    "tiny_llama_chat_prompts",
    "seed_miswired_training",
    "seed_infer_wiring",
)


def judged_cases() -> list[str]:
    catalogue = sorted(p.stem for p in (ROOT / "cases").glob("catalogue_*.yaml"))
    return [f"cases/{name}.yaml" for name in (*JUDGED, *catalogue)]


@pytest.fixture(scope="module")
def vllm_wired(tmp_path_factory):
    return run_pytest(shipped_cases_project(tmp_path_factory), *judged_cases(), "--engines=ref,ref[wiring=vllm]")


@pytest.fixture(scope="module")
def sglang_wired(tmp_path_factory):
    return run_pytest(
        shipped_cases_project(tmp_path_factory), "cases/tiny_llama.yaml", "--engines=ref,ref[wiring=sglang]"
    )


@pytest.mark.parametrize("case", ["tiny_llama", "tiny_llama_speculators", "tiny_llama_chat_prompts"])
def test_correctly_wired_tiny_case_passes_every_check(vllm_wired, case):
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        assert vllm_wired.outcome(case, "ref[wiring=vllm]", check).outcome == "passed", (case, check)
    assert vllm_wired.outcome(case, "ref", "capture").outcome == "passed"


def test_seed_case_names_fc_chunk_0_as_the_first_divergence(vllm_wired):
    result = vllm_wired.outcome("seed_miswired_training", "ref[wiring=vllm]", "fc_inputs")
    assert result.outcome == "failed"
    assert result.data.tensor == "draft.fc_in.0"
    assert (
        "engine's fc chunk 0 matches reference target.h.2 (cos 1.0000); expected target.h.0 (the embedding)"
        in result.message
    )
    assert "engine fed fc [h2, h4, h7]; reference fed [h0, h2, h4]; pattern: embedding dropped" in result.message


def test_seed_case_shows_the_accept_length_collapse(vllm_wired):
    result = vllm_wired.outcome("seed_miswired_training", "ref[wiring=vllm]", "accept_length")
    assert result.outcome == "failed"
    assert result.message.startswith("accept length collapsed")
    reference, engine = result.data.reference.accept_length, result.data.engine.accept_length
    assert reference >= 2.0
    assert engine < 0.75 * reference
    # a failing gate is re-judged with the reference's float64 move measured, and says so
    assert "numerical move measured: ref in float32 vs float64" in result.message
    assert result.data.gate.numerical_accept is not None


def test_passing_accept_length_needs_no_float64_run(vllm_wired):
    result = vllm_wired.outcome("tiny_llama", "ref[wiring=vllm]", "accept_length")
    assert result.outcome == "passed"
    assert "every position within noise" in result.message and "within the sampling spread alone" in result.message
    assert result.data.gate.numerical_accept is None


def test_seed_case_top1_agreement_fails(vllm_wired):
    result = vllm_wired.outcome("seed_miswired_training", "ref[wiring=vllm]", "top1_agreement")
    assert result.outcome == "failed"
    assert result.data.rate < 0.5


def test_sglang_style_wiring_of_the_tiny_draft_is_named_off_by_one(sglang_wired):
    result = sglang_wired.outcome("tiny_llama", "ref[wiring=sglang]", "fc_inputs")
    assert result.outcome == "failed"
    assert "engine fed fc [h3, h5, h6]; reference fed [h2, h4, h5]; pattern: off-by-one +1" in result.message
    assert sglang_wired.returncode == 1


def test_reports_are_written_per_case(vllm_wired):
    for case in ("tiny_llama", "tiny_llama_speculators", "seed_miswired_training"):
        report = vllm_wired.report(case)
        assert report.case == case
        assert {r.engine for r in report.checks} == {"ref", "ref[wiring=vllm]"}


@pytest.fixture(scope="module")
def training_data_run(tmp_path_factory):
    return run_pytest(
        shipped_cases_project(tmp_path_factory), "cases/seed_training_data.yaml", "--engines=ref,train,ref[wiring=vllm]"
    )


def test_seed_training_data_accuracy_is_high_under_the_trainers_wiring(training_data_run):
    result = training_data_run.outcome("seed_training_data", "train", "train_accuracy")
    assert result.outcome == "passed"
    assert (
        "dumped tensors = [h0, h2, h4, h8]; trainer fed fc [h0, h2, h4]; verifier = h8 (the final layer)"
        in result.message
    )


def test_seed_training_data_accuracy_collapses_under_the_engines_wiring(training_data_run):
    result = training_data_run.outcome("seed_training_data", "ref[wiring=vllm]", "train_accuracy")
    assert result.outcome == "failed"
    assert result.message.startswith("training accuracy collapses under this engine's wiring")
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        assert training_data_run.outcome("seed_training_data", "train", check).outcome == "passed", check


def test_inferred_wiring_case_says_what_was_inferred_and_with_what_margin(vllm_wired):
    result = vllm_wired.outcome("seed_infer_wiring", "ref", "capture")
    assert result.outcome == "passed"
    assert "wiring inferred: trained on [h0, h2, h4]" in result.message
    assert "the config reads as [h2, h4, h7] in vllm" in result.message
    inferred = vllm_wired.report("seed_infer_wiring").wiring_inference
    assert inferred.decided and inferred.wiring == ["target.h.0", "target.h.2", "target.h.4"]
    assert inferred.margin > 0


def test_inferred_wiring_feeds_the_checks_of_a_serving_wired_engine(vllm_wired):
    fc = vllm_wired.outcome("seed_infer_wiring", "ref[wiring=vllm]", "fc_inputs")
    assert fc.outcome == "failed"
    assert "engine fed fc [h2, h4, h7]; reference fed [h0, h2, h4]; pattern: embedding dropped" in fc.message
    assert vllm_wired.outcome("seed_infer_wiring", "ref[wiring=vllm]", "accept_length").outcome == "failed"


# -- the failure catalogue (docs/failure-catalogue.md): each case's declared failure is caught
# with its cause, so the items are xfailed and the run stays green on them.

CATALOGUE_LINT = {
    "catalogue_norm_flag_ignored": "[flag-ignored]: norm_before_residual: True in the draft config (top level), but sglang 0.5.23 never reads it",
    "catalogue_embedding_substituted": "[embedding-substituted]",
    "catalogue_lm_head_missing": "[lm-head-missing]: no lm_head.weight in the draft checkpoint",
    "catalogue_d2t_absolute": "[d2t-convention]: d2t holds absolute target ids",
    "catalogue_d2t_missing": "[vocab-map]",
    "catalogue_rope_conflict": "[rope-conflict]: draft config: rope_theta 500000.0 but rope_parameters.rope_theta 10000.0",
    "catalogue_ids_unsorted": "[layer-ids-order]: layer ids [5, 2, 4] are not sorted and unique",
}


@pytest.mark.parametrize("case", sorted(CATALOGUE_LINT))
def test_catalogue_case_lint_names_its_fault_as_declared(vllm_wired, case):
    lint = vllm_wired.outcome(case, "ref", "lint")
    assert lint.outcome == "xfailed", lint.message
    assert CATALOGUE_LINT[case] in lint.message


@pytest.mark.parametrize(
    "case", ["catalogue_lm_head_missing", "catalogue_d2t_absolute", "catalogue_d2t_missing", "catalogue_rope_conflict"]
)
def test_catalogue_reference_runs_the_draft_as_trained_not_the_broken_export(vllm_wired, case):
    """The export is the engines' to serve (tests/test_shipped_cases.py); the reference runs
    engines.ref.draft, the checkpoint as trained, and never refuses on the row's behalf."""
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        r = vllm_wired.outcome(case, "ref[wiring=vllm]", check)
        assert r.outcome == "passed", (check, r.message)


@pytest.mark.parametrize("case", ["catalogue_norm_flag_ignored", "catalogue_embedding_substituted"])
def test_catalogue_fault_vllm_handles_passes_with_vllms_wiring(vllm_wired, case):
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        assert vllm_wired.outcome(case, "ref[wiring=vllm]", check).outcome == "passed", check


def test_catalogue_cases_leave_the_run_green_where_only_declared_failures_occur(vllm_wired):
    failed = [line for line in vllm_wired.output.splitlines() if line.startswith("FAILED cases/catalogue_")]
    assert failed == []


def test_catalogue_unsorted_ids_are_named_as_layer_order_on_vllms_reading(vllm_wired):
    fc = vllm_wired.outcome("catalogue_ids_unsorted", "ref[wiring=vllm]", "fc_inputs")
    assert fc.outcome == "xfailed"
    assert (
        "engine fed fc [h2, h4, h5]; reference fed [h5, h2, h4]; pattern: permuted order (engine sorted the ids)"
        in fc.message
    )
    # the draft config's own ids [5, 2, 4] lead to [h2, h4, h5]: the engine followed them, it did not fall back
    assert "default-layer fallback" not in fc.message


# -- EAGLE-3.1 flags on the reference: computing a draft as an engine that ignores them does


@pytest.fixture(scope="module")
def nbfc_ignored(tmp_path_factory):
    return run_pytest(
        shipped_cases_project(tmp_path_factory),
        "cases/release_sglang_norm_before_fc.yaml",
        "--engines=ref,ref[norm_before_fc=false]",
        "-k",
        "fc_inputs or draft_logits",
    )


def test_ignoring_norm_before_fc_on_the_reference_moves_the_draft_at_fc_out(nbfc_ignored):
    assert (
        nbfc_ignored.outcome("release_sglang_norm_before_fc", "ref[norm_before_fc=false]", "fc_inputs").outcome
        == "passed"
    )
    logits = nbfc_ignored.outcome("release_sglang_norm_before_fc", "ref[norm_before_fc=false]", "draft_logits")
    assert logits.outcome == "failed"
    assert "error introduced at draft.fc_out" in logits.message, logits.message
    assert "suspect: fc differs while its input matches: fc weights, norm_before_fc or fc_norm" in logits.message


def test_a_flag_the_draft_has_no_weights_for_cannot_be_turned_on(tmp_path_factory):
    run = run_pytest(
        shipped_cases_project(tmp_path_factory),
        "cases/tiny_llama.yaml",
        "--engines=ref,ref[fc_norm=true]",
        "-k",
        "fc_inputs",
    )
    result = run.outcome("tiny_llama", "ref[fc_norm=true]", "fc_inputs")
    assert result.outcome == "error"
    assert "fc_norm=true, but" in result.message and "has no fc_norm weights" in result.message
