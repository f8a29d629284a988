"""The SGLang adapter end to end: real `sglang.Engine` EAGLE-3 (CPU kernel shim on CPU machines).

The shipped cases are judged from the one real run of the user's command (tests/shipped_run.py);
the other tests run `pytest <case> --engines=ref,sglang` in a subprocess, as a user would. They
need SGLang's environment (`scripts/setup-engine sglang`); without it they skip with that
command, unless DIFFTEST_REQUIRE_ENGINES=1 (CI), where they fail.
"""

from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

import pytest
from helpers import COUNTERS_CASE, HANG_GUARD_S, ROOT, make_degenerate_pair, run_pytest
from shipped_run import shipped_or_skip

from difftest.records.check_result import CheckResult
from difftest.records.report import Report


TIMEOUT = HANG_GUARD_S  # per pytest run; a hung engine is killed by --engine-timeout well before


def _run(
    tmp: Path, case: str, sglang_python: str, marker: str | None = None, timeout_s: int = 600, case_dir: Path = ROOT
):
    env = {"DIFFTEST_TEST_MARKER": marker} if marker else {}
    run = run_pytest(
        case_dir,
        case,
        "--engines=ref,sglang",
        "--require-engines",
        "--no-capture-cache",
        f"--engine-python=sglang={sglang_python}",
        f"--engine-timeout={timeout_s}",
        f"--out={tmp}",
        env=env,
        timeout=TIMEOUT,
    )
    name = Path(case).stem
    report = Report.load(tmp / f"{name}.json")
    outcomes = {(c.engine, c.check): c for c in report.checks}
    return run, outcomes


def _shipped(case: str) -> dict[tuple[str, str], CheckResult]:
    """The shipped case's SGLang results from the one real run of the user's command (tests/shipped_run.py)."""
    report = shipped_or_skip().report(case)
    return {(c.engine, c.check): c for c in report.checks}


def test_tiny_case_passes_every_check():
    out = _shipped("tiny_llama")
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        assert out[("sglang", check)].outcome == "passed", out[("sglang", check)].message
    # draft.fc_in matched the reference's, which is HF's hidden states by value (tests/test_target_capture.py)
    assert "within noise of ref" in out[("sglang", "fc_inputs")].message
    # golden inputs on the real engine: its draft re-run on the reference's draft.fc_in (hooks.golden_hook)
    logits = out[("sglang", "draft_logits")]
    assert logits.data.golden.outcome == "matches", logits.message
    assert (
        "golden inputs (prompt 0): on the reference's draft.fc_in, sglang's draft matches ref on every draft tensor"
        in logits.message
    )
    stats = out[("sglang", "accept_length")].data.engine
    assert stats.accept_length > 1.5, stats  # a trained draft: SGLang accepts drafts
    assert "sglang meta_info" in stats.source


def test_seed_miswiring_is_caught():
    out = _shipped("seed_miswired_training")  # the run is green: every failure is one the case declares
    fc = out[("sglang", "fc_inputs")]
    assert fc.outcome == "xfailed"
    assert "draft.fc_in.0" in fc.message and "expected target.h.0 (the embedding)" in fc.message, fc.message
    # SGLang's id -1 is layer 0's input, the embedding: the fix the rule model computes
    assert "fix: set eagle_config.eagle_aux_hidden_state_layer_ids = [-1, 1, 3]" in fc.message, fc.message
    # on golden inputs SGLang's draft computes what the reference's does: the fault is the fed layers
    logits = out[("sglang", "draft_logits")]
    assert logits.outcome == "xfailed" and logits.data.golden.outcome == "matches", logits.message
    assert "the engine captured the wrong hidden states; its draft computes correctly" in logits.message
    assert out[("sglang", "accept_length")].outcome == "xfailed"


def _marked_processes(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if f"DIFFTEST_TEST_MARKER={marker}".encode() in (d / "environ").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def test_every_engine_start_in_one_worker_forks_from_the_same_server():
    """difftest_engines/sglang/process_start.py on the real engine: in the shipped run, each worker's SGLang
    starts (one per case) all fork from the one forkserver that has SGLang imported."""
    log = (shipped_or_skip().root / "reports" / "logs" / "sglang.log").read_text()
    starts_per_worker = [
        re.findall(r"engine processes started by forkserver pid (\d+)", part) for part in log.split("\n=== ")[1:]
    ]
    reused = [pids for pids in starts_per_worker if len(pids) >= 2]
    assert reused, f"no worker started SGLang twice: {starts_per_worker}"
    for pids in starts_per_worker:
        assert len(set(pids)) <= 1, f"one worker's engine starts came from several forkservers: {pids}"


def test_scheduler_crash_fails_only_sglang_with_its_error_and_leaves_no_processes(tmp_path, sglang_python):
    # The seed draft with its config ids [2, 4, 7] as is: SGLang's +1 asks for h8 = L, which its
    # Llama never captures, and the scheduler dies mid-request, killing its process tree.
    cases = tmp_path / "cases"
    cases.mkdir()
    text = (ROOT / "cases" / "seed_miswired_training.yaml").read_text()
    text = text[: text.index("\nengines:")] + "\n" + text[text.index("expect:") :]
    (cases / "crash.yaml").write_text(text)
    marker = uuid.uuid4().hex
    run, out = _run(tmp_path, str(cases / "crash.yaml"), sglang_python, marker=marker, timeout_s=300)
    assert run.returncode != 0
    assert out[("ref", "capture")].outcome == "passed"
    fc = out[("sglang", "fc_inputs")]
    assert fc.outcome in ("failed", "error")
    assert "log:" in fc.message and "sglang.log" in fc.message, fc.message
    # the cause the layer-id rule predicts first (difftest.rules.layer_rules), SGLang's own error beneath
    cause, *raw = fc.message.splitlines()
    assert cause.startswith(
        "predicted by the layer-id rule: SGLang 0.5.23 (Llama rule: ids from eagle_config, "
        "layer order, k -> h[k+1]) turns [2, 4, 7] (eagle_config) into [h3, h5]"
    ), cause
    assert "fc expects 3 chunks but the engine captures 2" in cause
    assert 1 <= len(raw) <= 2, fc.message
    assert _marked_processes(marker) == [], "orphan processes after the run"
    shutil.rmtree(cases)


# -- engine-reported acceptance on drafts that are always right / always wrong ---------------

K = 3
SGLANG_IDS = """\
engines:
  # SGLang reads id k as h[k+1]; [0, 1, 2] keeps every id capturable on the 4-layer target
  sglang:
    draft_config_overrides:
      eagle_config: {eagle_aux_hidden_state_layer_ids: [0, 1, 2]}
"""


@pytest.fixture(scope="module")
def counters(tmp_path_factory, sglang_python):
    """Both degenerate drafts in one session: one SGLang start-up."""
    root = tmp_path_factory.mktemp("counters")
    (root / "cases").mkdir()
    for name, right in (("always_right", True), ("always_wrong", False)):
        t, d = make_degenerate_pair(root / name, right)
        (root / "cases" / f"{name}.yaml").write_text(COUNTERS_CASE.format(target=t, draft=d, k=K, extra=SGLANG_IDS))
    run = run_pytest(
        root,
        "cases/",
        "--engines=ref,sglang",
        "--require-engines",
        "--no-capture-cache",
        f"--engine-python=sglang={sglang_python}",
        "--engine-timeout=600",
        timeout=TIMEOUT,
    )
    outcomes = {name: run.outcome(name, "sglang", "accept_length") for name in ("always_right", "always_wrong")}
    return {**outcomes, "log": (root / "reports" / "logs" / "sglang.log").read_text(errors="replace")}


def test_sglang_always_right_draft_accepts_k_plus_1(counters):
    engine = counters["always_right"].data.engine
    assert engine.source.startswith("sglang meta_info")
    assert engine.num_verify > 0
    assert engine.accept_length == pytest.approx(K + 1), engine
    assert counters["always_right"].outcome == "passed", counters["always_right"].message


def test_sglang_always_wrong_draft_accepts_1(counters):
    engine = counters["always_wrong"].data.engine
    assert engine.num_verify > 0 and engine.num_accepted == 0
    assert engine.accept_length == pytest.approx(1.0)
    assert counters["always_wrong"].outcome == "passed", counters["always_wrong"].message


def test_a_session_that_ends_cleanly_leaves_no_traceback_in_the_engine_log(counters):
    """The log is what a user reads when something fails: the worker removed its temp dir before
    multiprocessing's exit finalizer removed its own dir inside it, which printed a FileNotFoundError
    traceback at the end of every session."""
    assert "request close" in counters["log"]
    assert "Traceback" not in counters["log"], counters["log"][-3000:]


def test_catalogue_norm_flag_sglang_ignores_is_caught_with_its_cause():
    """A draft trained with norm_before_residual=true: SGLang 0.5.23 never reads the flag. Its draft
    diverges at draft.layer0.mlp_out, the failure names the lint's known cause, and acceptance falls
    the way the reference predicts for a draft without the flag (the case's expect_failure: green)."""
    out = _shipped("catalogue_norm_flag_ignored")
    assert out[("sglang", "fc_inputs")].outcome == "passed"
    logits = out[("sglang", "draft_logits")]
    assert logits.outcome == "xfailed" and logits.data.introduced == "draft.layer0.mlp_out"
    assert "known cause (lint [flag-ignored]): norm_before_residual" in logits.message
    accept = out[("sglang", "accept_length")]
    assert accept.outcome == "xfailed"
    assert accept.data.engine.accept_length < accept.data.reference.accept_length - 0.5
