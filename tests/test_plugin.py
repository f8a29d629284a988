"""The pytest plugin, black-box: `pytest cases/ --engines=...` in a subprocess, with a fake engine
that injects divergence, errors, crashes and hangs (tests/fake_engine.py); what the plugin decides
before any engine runs (usage errors, bad case files) in this process, through pytester."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from helpers import TINY_CASE, run_pytest, start_pytest

CASE = TINY_CASE


def plugin_project(tmp_path: Path, models, name: str = "tiny", body: str | None = None) -> Path:
    (tmp_path / "cases").mkdir(exist_ok=True)
    target, draft = models
    (tmp_path / "cases" / f"{name}.yaml").write_text(
        body if body is not None else CASE.format(target=target, draft=draft)
    )
    return tmp_path


def in_process(pytester: pytest.Pytester, models, *args: str, body: str | None = None) -> tuple[int, str]:
    """`pytest ARGS` run by pytester in this process, in a project holding the tiny case (or `body`):
    for what the plugin decides before any engine runs (usage errors, case files), no subprocess."""
    plugin_project(pytester.path, models, body=body)
    result = pytester.runpytest_inprocess("-p", "difftest.plugin", *args)
    return int(result.ret), "\n".join(result.outlines + result.errlines)


@pytest.fixture(scope="module")
def mixed_run(models, tmp_path_factory):
    """One session with a correct engine, a miswired one and every fault the fake engine injects."""
    root = plugin_project(tmp_path_factory.mktemp("mixed"), models)
    engines = "ref,ref[wiring=vllm],ref[wiring=sglang],fake[mode=diverge],fake[mode=error],fake[mode=crash],fake[mode=unavailable]"
    engines += ",fake[release=sglang==0.5.24]"  # an installed release outside the supported range
    cache = tmp_path_factory.mktemp("cache")
    run = run_pytest(
        root, "cases/", f"--engines={engines}", "--allow-missing-engines", env={"DIFFTEST_CACHE": str(cache)}
    )
    run.cache = cache
    return run


def test_correctly_wired_engine_passes_every_check(mixed_run):
    for check in ("fc_inputs", "draft_logits", "top1_agreement", "accept_length"):
        assert mixed_run.outcome("tiny", "ref[wiring=vllm]", check).outcome == "passed", check


def test_written_report_reads_back_as_a_record_with_each_checks_typed_data(mixed_run):
    from difftest.records import AcceptLengthData, CaptureData, ComparisonData, LintData, Report, Top1Data

    report = Report.load(mixed_run.root / "reports" / "tiny.json")
    kinds = {(r.engine, r.check): type(r.data) for r in report.checks}
    assert kinds[("ref", "capture")] is CaptureData and kinds[("ref", "lint")] is LintData
    assert kinds[("ref[wiring=vllm]", "fc_inputs")] is kinds[("ref[wiring=sglang]", "draft_logits")] is ComparisonData
    assert kinds[("ref[wiring=vllm]", "top1_agreement")] is Top1Data
    assert kinds[("ref[wiring=vllm]", "accept_length")] is AcceptLengthData
    assert report.result("fake[mode=error]", "fc_inputs").data is None  # an error carries its message only


def test_report_records_where_the_cases_time_went_by_phase_and_owner(mixed_run):
    from difftest.records import Report

    t = Report.load(mixed_run.root / "reports" / "tiny.json").timings
    seen = {(p.phase, p.engine) for p in t.phases}
    for phase in [
        ("engine.start", "ref"),
        ("engine.capture", "ref"),
        ("transfer.write", "ref"),
        ("transfer.read", "ref"),
        ("compare", "ref[wiring=vllm]"),
        ("noise_floor", "ref"),
        ("check", "ref"),
        ("report", None),
    ]:
        assert phase in seen, phase
    assert any(p.phase == "engine.capture" and p.dtype == "float64" for p in t.phases)  # the noise floor's calibration
    assert t.harness_seconds == round(sum(p.seconds for p in t.phases if p.owner == "harness"), 6) > 0
    assert t.engine_seconds > 0


def test_reference_gets_a_capture_item(mixed_run):
    assert mixed_run.outcome("tiny", "ref", "capture").outcome == "passed"
    listed = run_pytest(mixed_run.root, "cases/", "--engines=ref,ref[wiring=vllm]", "--collect-only", "-q")
    assert "cases/tiny.yaml::ref::capture" in listed.output.splitlines()
    assert "cases/tiny.yaml::ref[wiring=vllm]::capture" not in listed.output  # only the reference gets one


def test_off_by_one_wiring_fails_fc_inputs_naming_chunk_0_and_the_pattern(mixed_run):
    result = mixed_run.outcome("tiny", "ref[wiring=sglang]", "fc_inputs")
    assert result.outcome == "failed"
    assert result.data.tensor == "draft.fc_in.0"
    assert "engine's fc chunk 0 matches reference target.h.2 (cos 1.0000); expected target.h.1" in result.message
    assert "engine fed fc [h2, h3, h4]; reference fed [h1, h2, h3]; pattern: off-by-one +1" in result.message


def test_downstream_check_names_the_upstream_first_divergence(mixed_run):
    result = mixed_run.outcome("tiny", "ref[wiring=sglang]", "draft_logits")
    assert result.outcome == "failed"
    assert result.data.first_divergence == "draft.fc_in.0"
    assert "error introduced at draft.fc_in.0: " in result.message
    assert "in this check's scope first at draft.fc_out" in result.message


def test_injected_logit_divergence_is_counted_and_located(mixed_run):
    assert mixed_run.outcome("tiny", "fake[mode=diverge]", "fc_inputs").outcome == "passed"
    result = mixed_run.outcome("tiny", "fake[mode=diverge]", "draft_logits")
    assert result.outcome == "failed"
    assert "draft.logits: 1/" in result.message
    assert "at [1, 7]" in result.message


def test_engine_exception_fails_items_with_one_line_and_log_path(mixed_run):
    result = mixed_run.outcome("tiny", "fake[mode=error]", "fc_inputs")
    assert result.outcome == "error"
    assert "RuntimeError: fake engine exploded" in result.message
    assert "second line" not in result.message
    assert "log:" in result.message


def test_engine_crash_fails_items_without_taking_the_session_down(mixed_run):
    result = mixed_run.outcome("tiny", "fake[mode=crash]", "fc_inputs")
    assert result.outcome == "error"
    assert "worker died (exit -9): fatal: simulated scheduler crash" in result.message
    # the session went on: engines after the crashed one still ran
    assert mixed_run.outcome("tiny", "fake[mode=unavailable]", "fc_inputs").outcome == "skipped"


def test_unavailable_engine_skips_with_its_setup_command(mixed_run):
    result = mixed_run.outcome("tiny", "fake[mode=unavailable]", "accept_length")
    assert result.outcome == "skipped"
    assert "set it up with: scripts/setup-engine fake" in result.message
    assert "SKIPPED" in mixed_run.output and "set it up with" in mixed_run.output


def test_an_engine_release_nobody_has_read_is_run_and_says_its_reading_was_measured(mixed_run):
    """The release a pre-upgrade check is for: run, verdicts measured, no reading predicted."""
    result = mixed_run.outcome("tiny", "fake[release=sglang==0.5.24]", "fc_inputs")
    assert result.outcome == "passed", result.message
    assert (
        "no rule on record for sglang 0.5.24 (rules were read for sglang 0.5.5 - 0.5.23): the reading was measured"
    ) in result.message


def test_failures_print_verdicts_not_tracebacks(mixed_run):
    assert "Traceback" not in mixed_run.output
    assert "internal error in difftest" not in mixed_run.output
    assert mixed_run.returncode == 1


def test_report_json_lists_every_check_and_engine(mixed_run):
    from difftest.records import EngineEntry

    # the file names its own kind and layout (what any reader of the JSON keys on)
    written = json.loads((mixed_run.root / "reports" / "tiny.json").read_text())
    assert (written["schema"], written["schema_version"]) == ("difftest.report", 4)
    report = mixed_run.report("tiny")
    assert report.reference == "ref"
    assert len(report.checks) == 2 + 7 * 4  # reference: capture, lint
    assert report.engines["fake[mode=unavailable]"] == EngineEntry(
        error="fake: not installed; set it up with: scripts/setup-engine fake"
    )
    assert report.comparisons["ref[wiring=sglang]"][0].first_divergence == "draft.fc_in.0"
    assert (mixed_run.root / "reports" / "tiny.md").exists()
    assert (mixed_run.root / "reports" / "tiny.html").exists()


def test_no_worker_outlives_the_session(mixed_run):
    # workers of this session are the ones whose environment names its private cache
    marker = f"DIFFTEST_CACHE={mixed_run.cache}".encode()
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "difftest.run.worker" in cmd and marker in environ:
            alive.append(cmd)
    assert alive == []


def test_hanging_engine_is_killed_after_the_timeout(models, tmp_path):
    # 30 s: long enough for the reference's real captures on a loaded machine, short for a hang
    run = run_pytest(
        plugin_project(tmp_path, models),
        "cases/",
        "--engines=ref,fake[mode=hang]",
        "--engine-timeout=30",
        env={"DIFFTEST_CACHE": str(tmp_path / "cache")},
    )
    result = run.outcome("tiny", "fake[mode=hang]", "fc_inputs")
    assert result.outcome == "error"
    assert "no answer to 'capture' within 30s; worker killed" in result.message
    later = run.outcome("tiny", "fake[mode=hang]", "draft_logits")  # the killed worker is not asked again
    assert later.outcome == "error" and "worker is no longer running" in later.message, later
    assert "internal error" not in run.output


def interrupt_mid_capture(root: Path, *args: str, env: dict) -> str:
    """Start `pytest cases/ --engines=ref,fake[mode=hang]`, press Ctrl-C (SIGINT) once the hanging
    engine is inside its capture; the run's output."""
    proc = start_pytest(root, "cases/", "--engines=ref,fake[mode=hang]", *args, env=env)
    log = root / "reports" / "logs" / "fake[mode=hang].log"
    try:
        deadline = time.monotonic() + 600
        while not (log.exists() and "request capture" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached the hanging capture"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        return proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_without_a_previous_report_writes_one_marked_interrupted(models, tmp_path):
    root = plugin_project(tmp_path, models)
    output = interrupt_mid_capture(root, env={"DIFFTEST_CACHE": str(tmp_path / "cache")})
    from difftest.records import Report

    report = Report.load(root / "reports" / "tiny.json")
    assert report.interrupted is True, output
    assert [r.outcome for r in report.checks if r.engine == "ref" and r.check == "capture"] == ["passed"]
    assert "**Interrupted**" in (root / "reports" / "tiny.md").read_text()
    assert not [p.name for p in (root / "reports").iterdir() if p.name.endswith(".tmp")]


def test_ctrl_c_keeps_the_previous_report(models, tmp_path):
    root, env = plugin_project(tmp_path, models), {"DIFFTEST_CACHE": str(tmp_path / "cache")}
    assert run_pytest(root, "cases/", "--engines=ref", env=env).returncode == 0
    before = (root / "reports" / "tiny.json").read_bytes()
    output = interrupt_mid_capture(root, env=env)
    assert (root / "reports" / "tiny.json").read_bytes() == before
    assert "tiny.json (kept: the run was interrupted before this case finished)" in output


def test_an_unavailable_engine_fails_by_default_with_the_engine_exit_code(models, tmp_path):
    run = run_pytest(
        plugin_project(tmp_path, models),
        "cases/",
        "--engines=ref,fake[mode=unavailable]",
        env={"DIFFTEST_CACHE": str(tmp_path / "cache")},
    )
    assert run.returncode == 7
    assert "engine unavailable: fake: not installed" in run.output
    assert "--allow-missing-engines skips it instead" in run.output


def test_second_run_reuses_cached_captures(models, tmp_path):
    cache = {"DIFFTEST_CACHE": str(tmp_path / "cache")}
    root = plugin_project(tmp_path, models)
    first = run_pytest(root, "cases/", "--engines=ref,ref[wiring=vllm]", "--out=r1", env=cache)
    second = run_pytest(root, "cases/", "--engines=ref,ref[wiring=vllm]", "--out=r2", env=cache)
    assert first.returncode == second.returncode == 0
    assert "request capture" in (root / "r1" / "logs" / "ref.log").read_text()
    assert not (root / "r2" / "logs" / "ref.log").exists()  # every result cached: no worker started


@pytest.mark.parametrize(
    "engines, body, expected",
    [
        ("ref,nosuch", None, "--engines: unknown engine 'nosuch'"),
        ("ref,ref[wiring", None, "--engines: cannot parse engine spec"),
    ],
    ids=["unknown-engine", "unparsable-spec"],
)
def test_bad_engine_list_is_a_one_line_usage_error(models, pytester, engines, body, expected):
    ret, output = in_process(pytester, models, "cases/", f"--engines={engines}")
    assert ret == 4
    assert expected in output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    "body, expected",
    [
        ("target: [unclosed\n", "tiny.yaml: malformed YAML at line"),
        (
            "target: /nonexistent/t\ndraft: /nonexistent/d\nprompts: [a b]\n",
            "tiny.yaml: target: checkpoint /nonexistent/t not found",
        ),
        ("target: x\ndraft: y\nprompt: [a]\n", "tiny.yaml: prompt: unknown field"),
    ],
    ids=["malformed-yaml", "missing-checkpoint", "unknown-field"],
)
def test_bad_case_file_fails_its_load_item_with_file_and_field(models, pytester, body, expected):
    ret, output = in_process(pytester, models, "cases/", "--engines=ref", body=body)
    assert ret == 6  # a configuration error, not a regression
    assert expected in output
    assert "Traceback" not in output


def test_a_broken_check_registration_fails_the_load_item_in_one_line(models, tmp_path):
    """DIFFTEST_CHECKS (checks registered without packaging) is read when a case's items are made:
    a malformed entry fails the case's load item naming the variable, not a traceback."""
    run = run_pytest(plugin_project(tmp_path, models), "cases/", "--engines=ref", env={"DIFFTEST_CHECKS": "bogus"})
    assert run.returncode == 6  # a configuration error
    assert "FAILED cases/tiny.yaml::load - DIFFTEST_CHECKS: 'bogus' is not name=mod" in run.output
    assert "Traceback" not in run.output and "ERROR collecting" not in run.output


@pytest.mark.parametrize(
    "engine, expected",
    [
        ("ref[wiring=h0+h2+h9]", "wiring: h9 does not exist; the target has 6 layers (h0..h6)"),
        ("ref[wiring=h0+h2]", "wiring [h0, h2] has 2 inputs but"),
        ("ref[wiring=bogus]", "unknown wiring preset 'bogus'"),
    ],
    ids=["layer-out-of-range", "fc-width-mismatch", "unknown-preset"],
)
def test_bad_wiring_fails_the_engine_items_with_one_line(models, tmp_path, engine, expected):
    run = run_pytest(
        plugin_project(tmp_path, models),
        "cases/",
        f"--engines=ref,{engine}",
        env={"DIFFTEST_CACHE": str(tmp_path / "c")},
    )
    result = run.outcome("tiny", engine, "fc_inputs")
    assert result.outcome == "error"
    assert expected in result.message
    assert "Traceback" not in run.output


def test_a_worker_killed_by_one_case_is_replaced_for_the_next_case(models, tmp_path):
    """A case that crashes an engine (an SGLang scheduler dying on ids it cannot capture) must not
    fail every later case's items on that engine: the next case gets a fresh worker."""
    target, draft = models
    tiny = CASE.format(target=target, draft=draft)
    root = plugin_project(tmp_path, models, name="a_crashes", body=tiny + "engines:\n  fake: {mode: crash}\n")
    plugin_project(root, models, name="b_runs", body=tiny)
    run = run_pytest(root, "cases/", "--engines=ref,fake", "-k", "fc_inputs or capture")
    assert "worker died (exit -9)" in run.outcome("a_crashes", "fake", "fc_inputs").message
    assert run.outcome("b_runs", "fake", "fc_inputs").outcome == "passed", run.output[-3000:]


def test_an_engine_that_cannot_restart_fails_its_case_with_the_cause_and_the_next_case_runs(models, tmp_path):
    """An engine whose failed start leaves its process unable to start it again (sglang.Engine) ends
    its worker after answering: every item of that case names the engine's own error, and the next
    case, on a fresh worker, runs as if nothing had happened."""
    target, draft = models
    tiny = CASE.format(target=target, draft=draft)
    root = plugin_project(tmp_path, models, name="a_spent", body=tiny + "engines:\n  fake: {mode: spent}\n")
    plugin_project(root, models, name="b_runs", body=tiny)
    run = run_pytest(root, "cases/", "--engines=ref,fake", "-k", "fc_inputs or draft_logits or capture")
    for check in ("fc_inputs", "draft_logits"):
        result = run.outcome("a_spent", "fake", check)
        assert result.outcome == "error"  # an engine that failed, not a verdict on its wiring
        assert "no model_type in config.json" in result.message, result.message
        assert "worker died" not in result.message
    assert run.outcome("b_runs", "fake", "fc_inputs").outcome == "passed", run.output[-3000:]
    assert run.outcome("b_runs", "fake", "draft_logits").outcome == "passed", run.output[-3000:]
    assert "Traceback" not in run.output


def test_a_worker_killed_for_a_hang_is_replaced_for_the_next_case(models, tmp_path):
    """A worker killed after its timeout mid-case (a hang) takes only that case's items with it."""
    target, draft = models
    tiny = CASE.format(target=target, draft=draft)
    root = plugin_project(tmp_path, models, name="a_hangs", body=tiny + "engines:\n  fake: {mode: hang}\n")
    plugin_project(root, models, name="b_runs", body=tiny)
    run = run_pytest(
        root,
        "cases/",
        "--engines=ref,fake",
        "--engine-timeout=30",
        "-k",
        "fc_inputs or capture",
        env={"DIFFTEST_CACHE": str(tmp_path / "cache")},
    )
    assert "worker killed" in run.outcome("a_hangs", "fake", "fc_inputs").message
    assert run.outcome("b_runs", "fake", "fc_inputs").outcome == "passed", run.output[-3000:]
