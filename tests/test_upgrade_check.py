"""The pre-upgrade check: two versions of one engine side by side in one session, and the summary.

An upgrade is simulated without network by two labels of one engine whose behaviour differs
through a per-label case section (`engines: {"ref@new": {wiring: sglang}}`: the new "release"
reads layer ids with SGLang's +1), and an unchanged label (`ref@patch`) that must come out "same".
The real-engine variant runs SGLang's own environment under two labels (skipped without it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from difftest.report import upgrade
from difftest.records.acceptance import AcceptStats
from difftest.records import AcceptLengthData, CheckResult, EngineEntry, PromptComparison, Report, TensorDiff
from helpers import HANG_GUARD_S, ROOT, TINY_CASE, make_tiny_pair, run_pytest

UPGRADE_SECTION = """\
engines:
  ref@new: {wiring: sglang}
"""


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    """ref@old (its interpreter from difftest.toml) vs ref@new (changed) and ref@patch (unchanged)."""
    root = tmp_path_factory.mktemp("upgrade")
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("models"))
    (root / "cases").mkdir()
    (root / "cases" / "tiny.yaml").write_text(TINY_CASE.format(target=target, draft=draft) + UPGRADE_SECTION)
    wrapper = root / "old-env" / "bin" / "python"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    (root / "difftest.toml").write_text('[engines]\n"ref@old" = "old-env"\n')
    cache = tmp_path_factory.mktemp("cache")
    run = run_pytest(root, "cases/", "--engines=ref@old,ref@new,ref@patch", env={"DIFFTEST_CACHE": str(cache)})
    run.cache = cache
    return run


def row(run, engine: str, case: str = "tiny") -> list[str]:
    """The summary table's row for (case, engine), split on whitespace."""
    return next(ln for ln in run.output.splitlines() if ln.startswith(f"{case} ") and f" {engine} " in ln).split()


def test_changed_label_regresses_at_the_first_fc_chunk(side_by_side):
    result = side_by_side.outcome("tiny", "ref@new", "fc_inputs")
    assert result.outcome == "failed"
    assert result.data.tensor == "draft.fc_in.0"
    assert "pattern: off-by-one +1" in result.message


def test_summary_row_of_the_changed_label_says_regressed(side_by_side):
    r = row(side_by_side, "ref@new")
    assert r[:3] == ["tiny", "ref@new", "ref@old"]
    assert r[5:10] == ["draft.fc_in.0", "(prompt", "0)", "regressed", str(side_by_side.root / "reports" / "tiny.html")]


def test_summary_row_of_the_unchanged_label_says_same(side_by_side):
    r = row(side_by_side, "ref@patch")
    assert r[:3] == ["tiny", "ref@patch", "ref@old"]
    assert r[3] == r[4]
    assert r[5:8] == ["-", "same", str(side_by_side.root / "reports" / "tiny.html")]


def test_summary_states_the_accept_length_definition(side_by_side):
    assert "difftest summary (accept length AL: accepted draft tokens + 1 per verify step)" in side_by_side.output


def test_each_label_gets_its_own_worker_and_log(side_by_side):
    logs = side_by_side.root / "reports" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["ref@new.log", "ref@old.log", "ref@patch.log"]


def test_project_file_chooses_the_labels_interpreter(side_by_side):
    log = (side_by_side.root / "reports" / "logs" / "ref@old.log").read_text()
    assert f"start ref@old with {side_by_side.root / 'old-env' / 'bin' / 'python'}" in log
    assert (
        f"start ref@patch with {sys.executable}"
        in (side_by_side.root / "reports" / "logs" / "ref@patch.log").read_text()
    )


def test_each_label_has_its_own_cached_captures(side_by_side):
    engines = []
    for manifest in (side_by_side.cache / "captures").glob("*/*/manifest.json"):
        meta = json.loads(manifest.read_text())["meta"]
        if not meta.get("golden_fc_in"):
            engines.append(meta["engine"] + ("+float64" if meta["dtype"] == "float64" else ""))
    # the reference label also captures each prompt in float64: the noise floor (difftest.compare.noise)
    assert sorted(engines) == ["ref@new"] * 2 + ["ref@old"] * 2 + ["ref@old+float64"] * 2 + ["ref@patch"] * 2


def test_difftest_run_prints_the_same_summary(side_by_side):
    env = dict(os.environ, DIFFTEST_CACHE=str(side_by_side.cache))
    proc = subprocess.run(
        [sys.executable, "-m", "difftest.cli", "run", "cases/", "--engines=ref@old,ref@patch"],
        cwd=side_by_side.root,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.splitlines()
    assert any(
        ln.split()[:2] == ["tiny", "ref@patch"] and ln.split()[6] == "same" for ln in lines if ln.startswith("tiny ")
    )


# -- verdicts, from reports alone -------------------------------------------------------------------
def _report(outcomes: dict[str, str], max_abs: float = 0.0, accept=(2.5, 2.5), status: str = "ok") -> Report:
    stats = lambda al: AcceptStats(num_verify=10, num_accepted=round((al - 1) * 10), num_draft_steps=3)  # noqa: E731
    checks = [
        CheckResult(
            "e@new",
            c,
            o,
            "",
            AcceptLengthData(stats(accept[0]), stats(accept[1]), 0.2, 0.0) if c == "accept_length" else None,
        )
        for c, o in outcomes.items()
    ]
    # a row as read from a report written before the noise criterion: no criterion, no `differs`
    row = {"name": "draft.fc_in", "status": status, "max_abs": max_abs, "nonfinite_mismatch": 0}
    tensors = [TensorDiff.from_json(row, "report.json", "tensors[0]")]
    first = None if status == "ok" else "draft.fc_in"
    return Report(
        case="c",
        case_file="c.yaml",
        created="now",
        reference="e@old",
        accept_length_definition="d",
        engines={"e@old": EngineEntry(), "e@new": EngineEntry()},
        checks=checks,
        comparisons={"e@new": [PromptComparison(0, first, None, first, None, "", tensors)]},
    )


PASSED = {"fc_inputs": "passed", "draft_logits": "passed", "top1_agreement": "passed", "accept_length": "passed"}


def test_bit_identical_tensors_and_equal_accept_length_are_same():
    (r,) = upgrade.summarise(_report(PASSED), Path("reports"))
    assert (r.verdict, r.first_divergence, r.html) == ("same", "-", "reports/c.html")


def test_tensor_moved_within_tolerance_is_drifted_naming_it():
    (r,) = upgrade.summarise(_report(PASSED, max_abs=3e-7), Path("reports"))
    assert (r.verdict, r.first_divergence, r.largest_drift) == ("drifted", "-", "draft.fc_in max|d| 3.00e-07")


def test_accept_length_moved_within_tolerance_is_drifted():
    (r,) = upgrade.summarise(_report(PASSED, accept=(2.5, 2.4)), Path("reports"))
    assert (r.verdict, r.reference_accept, r.engine_accept) == ("drifted", 2.5, 2.4)


def test_failed_check_is_regressed_naming_the_first_divergence():
    (r,) = upgrade.summarise(
        _report({**PASSED, "fc_inputs": "failed"}, max_abs=1.0, status="mismatch"), Path("reports")
    )
    assert (r.verdict, r.first_divergence) == ("regressed", "draft.fc_in (prompt 0)")


def test_engine_error_is_error_not_a_verdict_on_the_engine():
    (r,) = upgrade.summarise(_report({**PASSED, "fc_inputs": "error"}), Path("reports"))
    assert r.verdict == "error"


def test_engine_skipped_everywhere_is_skipped():
    (r,) = upgrade.summarise(_report({c: "skipped" for c in PASSED}), Path("reports"))
    assert r.verdict == "skipped"


def test_rendered_summary_is_one_header_and_one_line_per_row():
    rows = upgrade.summarise(_report(PASSED, max_abs=3e-7), Path("reports"))
    lines = upgrade.render(rows)
    assert lines[0].split() == [
        "case",
        "engine",
        "reference",
        "ref",
        "AL",
        "engine",
        "AL",
        "first",
        "divergent",
        "tensor",
        "verdict",
        "report",
        "release",
    ]
    assert lines[1].split() == [
        "c",
        "e@new",
        "e@old",
        "2.500",
        "2.500",
        "-",
        "drifted",
        "(draft.fc_in",
        "max|d|",
        "3.00e-07)",
        "reports/c.html",
        "-",  # the release of an engine that reported none
    ]


# -- the real engine under two labels -----------------------------------------------------------------
def test_sglang_under_two_labels_catches_a_changed_layer_id_rule(sglang_python, tmp_path):
    """One SGLang environment as sglang@old and sglang@new; "new" reads the draft's ids without the
    per-engine convention overlay ([2, 4, 5] under SGLang's +1: h3, h5, h6), as a release that
    changed its layer-id rule would. Both sides capture only their aux layers, so the diagnosis can
    place only the chunk the old one also captured (new's chunk 1 is old's h5, where h4 was fed);
    measured: accept length 3.889 -> 1.132, about 10 minutes on 2 shared CPU cores."""
    case = yaml.safe_load((ROOT / "cases" / "tiny_llama.yaml").read_text())
    ids = [2, 4, 5]
    case["engines"]["sglang@new"] = {
        "draft_config_overrides": {
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids},
            "eagle_aux_hidden_state_layer_ids": ids,
        }
    }
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "tiny_llama.yaml").write_text(yaml.safe_dump(case, sort_keys=False))
    run = run_pytest(
        tmp_path,
        "cases/",
        "--engines=sglang@old,sglang@new",
        "--require-engines",
        f"--engine-python=sglang={sglang_python}",
    )
    fc = run.outcome("tiny_llama", "sglang@new", "fc_inputs")
    assert fc.outcome == "failed", fc.message
    assert fc.data.tensor == "draft.fc_in.0"
    chunk1 = fc.data.fc_chunks[1]
    assert (chunk1.expected, chunk1.best, chunk1.cosine) == ("target.h.4", "target.h.5", 1.0)
    assert "reference fed [h2, h4, h5]" in fc.message
    accept = run.outcome("tiny_llama", "sglang@new", "accept_length")
    assert accept.outcome == "failed" and accept.message.startswith("accept length collapsed: ")
    r = row(run, "sglang@new", case="tiny_llama")
    assert r[:3] == ["tiny_llama", "sglang@new", "sglang@old"]
    assert r[5:9] == ["draft.fc_in.0", "(prompt", "0)", "regressed"]
