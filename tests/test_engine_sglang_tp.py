"""SGLang tensor-parallel (`sglang[tp_size=2]`): the real engine with two ranks (two scheduler
processes over gloo on CPU), captures joined into whole tensors by difftest_engines/sglang/tensor_parallel.py.

The default suite pays for one engine session: the shipped Llama case at TP = 2, judged against the
same case at TP = 1 from the shipped run (tests/shipped_run.py; `DIFFTEST_SGLANG_TP1_REPORTS=<dir>`
reads a TP = 1 run's reports from <dir> instead). DIFFTEST_FULL_MATRIX=1 adds the DeepSeek-V3 MLA +
MoE case, TP = 2 against TP = 1 of the same engine, and a rank killed mid-run (each its own session,
about 2-4 minutes on two cores).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from helpers import HANG_GUARD_S, ROOT, run_pytest, start_pytest
from shipped_run import shipped_or_skip

from difftest.records.check_result import CheckResult
from difftest.records.report import Report


TP2 = "sglang[tp_size=2]"
FULL = os.environ.get("DIFFTEST_FULL_MATRIX") == "1"
full_only = pytest.mark.skipif(not FULL, reason="a further SGLang TP = 2 session (minutes): DIFFTEST_FULL_MATRIX=1")
CHECKS = ("fc_inputs", "draft_logits", "top1_agreement", "accept_length")


def _args(sglang_python: str, report_dir: Path, engines: str, *extra: str) -> tuple[str, ...]:
    return (
        f"--engines={engines}",
        "--require-engines",
        "--no-capture-cache",
        f"--engine-python=sglang={sglang_python}",
        "--engine-timeout=900",
        f"--out={report_dir}",
        *extra,
    )


def _checks(report: Report, engine: str) -> dict[str, CheckResult]:
    return {c.check: c for c in report.checks if c.engine == engine}


def _tp1(case: str) -> dict[str, CheckResult]:
    """The case's SGLang TP = 1 results: the shipped run's, or a given run's reports."""
    given = os.environ.get("DIFFTEST_SGLANG_TP1_REPORTS")
    report = Report.load(Path(given) / f"{case}.json") if given else shipped_or_skip().report(case)
    return _checks(report, "sglang")


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory, sglang_python) -> tuple[dict[str, CheckResult], str]:
    """The one default session: the shipped Llama case against the reference at TP = 2."""
    out = tmp_path_factory.mktemp("tp2")
    run = run_pytest(ROOT, "cases/tiny_llama.yaml", *_args(sglang_python, out, f"ref,{TP2}"), timeout=HANG_GUARD_S)
    report = Report.load(out / "tiny_llama.json")
    return _checks(report, TP2), (out / "logs" / f"{TP2}.log").read_text() + run.output


def test_llama_case_gives_the_same_verdicts_at_tp2_as_at_tp1(llama_tp2):
    tp2, _ = llama_tp2
    tp1 = _tp1("tiny_llama")
    assert {c: tp2[c].outcome for c in CHECKS} == {c: tp1[c].outcome for c in CHECKS}
    assert all(tp2[c].outcome == "passed" for c in CHECKS), {c: tp2[c].message for c in CHECKS}


def test_golden_inputs_work_at_tp2(llama_tp2):
    """Every rank's target takes the reference's draft.fc_in (one golden file per rank)."""
    logits = llama_tp2[0]["draft_logits"]
    assert logits.data.golden.outcome == "matches", logits.message


def test_accept_length_at_tp2_is_tp1s_within_its_spread(llama_tp2):
    tp2 = llama_tp2[0]["accept_length"].data.engine
    tp1 = _tp1("tiny_llama")["accept_length"].data.engine
    assert tp2.source.startswith("sglang meta_info") and tp2.num_verify > 0
    # greedy decoding of the same weights: the ranks' joined logits pick the same tokens
    assert abs(tp2.accept_length - tp1.accept_length) <= 0.05, (tp2, tp1)


def test_tp2_log_says_per_tensor_what_was_gathered_and_what_checked_replicated(llama_tp2):
    _, log = llama_tp2
    assert "tp_size 2: target.logits: gathered: 2 shards joined on the last dimension (" in log
    assert "tp_size 2: target.h.2: replicated: rank 0's, checked equal on 2 ranks (" in log
    assert "tp_size 2: draft.layer0.mlp_out: replicated: rank 0's, checked equal on 2 ranks (" in log
    assert "tp_size 2: draft.step1.logits_target: gathered: 2 shards joined on the last dimension (" in log


@full_only
def test_deepseek_mla_moe_case_gives_the_same_verdicts_at_tp2_as_at_tp1(tmp_path, sglang_python):
    run_pytest(ROOT, "cases/tiny_deepseek_v3.yaml", *_args(sglang_python, tmp_path, f"ref,{TP2}"), timeout=HANG_GUARD_S)
    tp2 = _checks(Report.load(tmp_path / "tiny_deepseek_v3.json"), TP2)
    tp1 = _tp1("tiny_deepseek_v3")
    assert {c: tp2[c].outcome for c in CHECKS} == {c: tp1[c].outcome for c in CHECKS}
    assert all(tp2[c].outcome == "passed" for c in CHECKS), {c: tp2[c].message for c in CHECKS}


@full_only
def test_tp2_against_tp1_of_the_same_engine_is_within_noise(tmp_path, sglang_python):
    run_pytest(
        ROOT,
        "cases/tiny_llama.yaml",
        *_args(sglang_python, tmp_path, f"sglang,{TP2}", "--reference=sglang"),
        timeout=HANG_GUARD_S,
    )
    tp2 = _checks(Report.load(tmp_path / "tiny_llama.json"), TP2)
    for check in ("fc_inputs", "draft_logits", "top1_agreement"):
        assert tp2[check].outcome == "passed", tp2[check].message
        print(f"{check}: {tp2[check].message.splitlines()[0]}")  # the figures, for the docs


def _engine_processes(marker: str) -> dict[str, int]:
    """SGLang's processes of the marked run, by title ("sglang::scheduler_TP1": pid). setproctitle
    overwrites their environment block, so they are found as children of a marked process (the
    forkserver they fork from)."""
    marked, found = set(_marked(marker)), {}
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "cmdline").read_bytes().startswith(b"sglang::"):
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid in marked:
                    found[(d / "cmdline").read_bytes().split(b"\0")[0].decode()] = int(d.name)
        except (OSError, ValueError, IndexError):
            pass
    return found


def _marked(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and f"DIFFTEST_TEST_MARKER={marker}".encode() in (d / "environ").read_bytes():
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


@full_only
def test_a_rank_killed_mid_run_fails_only_sglang_with_that_ranks_error_and_leaves_no_process(tmp_path, sglang_python):
    marker = uuid.uuid4().hex
    proc = start_pytest(
        ROOT,
        "cases/tiny_llama.yaml",
        *_args(sglang_python, tmp_path, f"ref,{TP2}"),
        env={"DIFFTEST_TEST_MARKER": marker},
    )
    log = tmp_path / "logs" / f"{TP2}.log"
    engine: dict[str, int] = {}
    deadline = time.monotonic() + 900
    while "sglang::scheduler_TP1" not in engine and time.monotonic() < deadline and proc.poll() is None:
        # the engine is up (both ranks serve requests) once the adapter has logged its start
        if log.exists() and "engine processes started by" in log.read_text(errors="replace"):
            engine = _engine_processes(marker)
        time.sleep(0.5)
    assert "sglang::scheduler_TP1" in engine, f"rank 1's scheduler never appeared: {engine}"
    victim = engine["sglang::scheduler_TP1"]
    os.kill(victim, signal.SIGKILL)
    proc.communicate(timeout=HANG_GUARD_S)
    report = Report.load(tmp_path / "tiny_llama.json")
    tp2 = _checks(report, TP2)
    ref = _checks(report, "ref")
    assert ref and all(c.outcome == "passed" for c in ref.values())
    first = next(c for c in CHECKS if tp2[c].outcome in ("failed", "error"))
    assert f"SGLang's tensor-parallel rank 1 (scheduler pid {victim}) died: killed by SIGKILL" in tp2[first].message
    assert all(tp2[c].outcome in ("failed", "error") for c in CHECKS[CHECKS.index(first) :])
    assert _marked(marker) == [], "processes of the run left behind"
    alive = [name for name, pid in engine.items() if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"SGLang processes of the run left behind: {alive}"
