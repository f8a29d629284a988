"""Every shipped case on the real engines: the user's command `pytest cases/ --engines=ref,vllm,sglang`
is green, every case runs on vLLM and SGLang, and every `expect_failure` declared for them is
exercised: caught as declared, not skipped past. One real run serves all of them (tests/shipped_run.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import ROOT
from shipped_run import ENGINES, REAL

from difftest.case.case import load_case

CASES = sorted((ROOT / "cases").glob("*.yaml"))
CHECKS = ("fc_inputs", "draft_logits", "top1_agreement", "accept_length")


def _runnable(path: Path) -> bool:
    """A case this machine can run: one for a model it does not have (an unset ${VAR}) skips by design."""
    from difftest.base.errors import CaseNotConfigured

    try:
        load_case(path)
    except CaseNotConfigured:
        return False
    return True


def test_the_users_command_is_green_on_the_real_engines(shipped_run):
    assert shipped_run.returncode == 0, shipped_run.output[-4000:]
    for path in filter(_runnable, CASES):
        for r in shipped_run.report(path.stem).checks:
            assert r.outcome in ("passed", "xfailed", "skipped"), f"{path.name} {r.engine} {r.check}: {r.message}"


@pytest.mark.parametrize("engine", REAL)
def test_every_runnable_shipped_case_is_judged_by_each_real_engine(shipped_run, engine):
    """No shipped case skips an engine: each check has a verdict (passed, or failed as declared)."""
    for path in filter(_runnable, CASES):
        results = {r.check: r for r in shipped_run.report(path.stem).checks if r.engine == engine}
        for check in CHECKS:
            assert check in results, f"{path.name}: no {check} result for {engine}"
            assert results[check].outcome in ("passed", "xfailed"), (
                f"{path.name} {engine} {check}: {results[check].outcome}: {results[check].message}"
            )


def test_every_declared_expectation_is_exercised(shipped_run):
    """Each `expect_failure` entry of each shipped case matched a real failure with its declared cause."""
    for path in filter(_runnable, CASES):
        case = load_case(path)
        checks = shipped_run.report(path.stem).checks
        for expected in case.expect_failure:
            if expected.reference not in ("*", "ref") or expected.engine not in ("*", *ENGINES):
                # another release or one as the reference (tests/test_upgrade_real_releases.py), a reference
                # preset such as ref[wiring=vllm] or the train engine (tests/test_cases.py, test_chat_template.py)
                continue
            hits = [
                r
                for r in checks
                if r.expected_failure is not None
                and r.expected_failure.cause == expected.cause
                and r.expected_failure.engine == expected.engine
            ]
            assert hits, f"{path.name}: expect_failure {expected} was never exercised"
            for r in hits:
                assert r.outcome == "xfailed", f"{path.name} {r.engine} {r.check}: {r.outcome}: {r.message}"


# -- catalogue rows the engines run on the broken export itself (the reference: the draft as trained)


@pytest.mark.parametrize("engine", REAL)
def test_a_draft_without_lm_head_diverges_at_draft_logits_on_each_engine_and_collapses_acceptance(shipped_run, engine):
    logits = shipped_run.outcome("catalogue_lm_head_missing", engine, "draft_logits")
    assert logits.outcome == "xfailed" and "error introduced at draft.logits" in logits.message, logits.message
    assert shipped_run.outcome("catalogue_lm_head_missing", engine, "fc_inputs").outcome == "passed"  # upstream intact
    accept = shipped_run.outcome("catalogue_lm_head_missing", engine, "accept_length")
    assert accept.outcome == "xfailed" and "accept length collapsed" in accept.message, accept.message


def test_absolute_d2t_fails_in_vllms_own_compute_logits(shipped_run):
    r = shipped_run.outcome("catalogue_d2t_absolute", "vllm", "draft_logits")
    assert r.outcome == "xfailed" and "IndexError: index 1026 is out of bounds" in r.message, r.message


@pytest.mark.parametrize("engine", REAL)
def test_a_draft_without_d2t_diverges_where_its_ids_are_mapped_on_each_engine(shipped_run, engine):
    logits = shipped_run.outcome("catalogue_d2t_missing", engine, "draft_logits")
    assert logits.outcome == "xfailed", logits.message
    assert "error introduced at draft.logits_target" in logits.message, logits.message
    assert shipped_run.outcome("catalogue_d2t_missing", engine, "accept_length").outcome == "xfailed"


@pytest.mark.parametrize("engine", REAL)
def test_a_rope_conflict_enters_at_the_draft_attention_naming_both_thetas(shipped_run, engine):
    logits = shipped_run.outcome("catalogue_rope_conflict", engine, "draft_logits")
    assert logits.outcome == "xfailed", logits.message
    assert "error introduced at draft.layer0.attn_out" in logits.message, logits.message
    assert "rope_theta 500000.0 but rope_parameters.rope_theta 10000.0" in logits.message
