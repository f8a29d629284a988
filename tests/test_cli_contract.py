"""The command line's contract with a user and a CI: exit codes that say what went wrong (the same
from `difftest run` and `pytest`), one name per concept, no abbreviations, `--version`, and the
listings (`env list`, `fixtures --list`, `cache`) and cache pruning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from difftest import cli
from difftest.base import exit_codes
from difftest.run.progress import Progress
from helpers import ROOT, TESTS, TINY_CASE, run_pytest


def _project(tmp_path: Path, models) -> Path:
    (tmp_path / "cases").mkdir(parents=True)
    target, draft = models
    (tmp_path / "cases" / "tiny.yaml").write_text(TINY_CASE.format(target=target, draft=draft))
    return tmp_path


def _difftest_run(root: Path, *args: str, cache: Path) -> subprocess.CompletedProcess:
    """`difftest run ARGS` in a fresh process inside `root`, with the tests' fake engine registered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
    env["DIFFTEST_ENGINES"] = "fake=fake_engine:FakeEngine"
    env["DIFFTEST_CACHE"] = str(cache)
    command = [sys.executable, "-m", "difftest.cli", "run", *args, f"--rootdir={root}"]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=3600)


# -- exit codes --------------------------------------------------------------------------------


def test_every_kind_of_outcome_has_its_own_exit_code():
    codes = [e.code for e in exit_codes.TABLE]
    assert len(codes) == len(set(codes))
    assert {exit_codes.REGRESSION, exit_codes.CONFIG, exit_codes.ENGINE, exit_codes.USAGE} <= set(codes)
    assert exit_codes.INTERRUPTED == 130


def test_a_configuration_error_outranks_a_missing_engine_which_outranks_a_regression():
    assert exit_codes.worst({"regression", "engine", "config"}) == exit_codes.CONFIG
    assert exit_codes.worst({"regression", "engine"}) == exit_codes.ENGINE
    assert exit_codes.worst({"regression"}) == exit_codes.REGRESSION
    assert exit_codes.worst(set()) == exit_codes.OK


def test_a_missing_engine_fails_difftest_run_and_pytest_with_the_same_engine_code(models, tmp_path):
    root = _project(tmp_path / "p", models)
    engines = "--engines=ref,fake[mode=unavailable]"
    under_pytest = run_pytest(root, "cases/", engines, "-q", env={"DIFFTEST_CACHE": str(tmp_path / "cache")})
    under_cli = _difftest_run(root, "cases/", engines, "-q", cache=tmp_path / "cache")
    assert under_pytest.returncode == exit_codes.ENGINE, under_pytest.output
    assert under_cli.returncode == exit_codes.ENGINE, under_cli.stdout + under_cli.stderr
    assert "engine unavailable: fake: not installed" in under_cli.stdout


def test_allow_missing_engines_skips_the_missing_engine_and_passes(models, tmp_path):
    root = _project(tmp_path / "p", models)
    run = run_pytest(
        root,
        "cases/",
        "--engines=ref,fake[mode=unavailable]",
        "--allow-missing-engines",
        "-q",
        env={"DIFFTEST_CACHE": str(tmp_path / "cache")},
    )
    assert run.returncode == exit_codes.OK, run.output
    assert "skipped" in run.output


def test_a_case_file_typo_is_a_configuration_error_from_difftest_run(models, tmp_path):
    root = _project(tmp_path / "p", models)
    (root / "cases" / "tiny.yaml").write_text((root / "cases" / "tiny.yaml").read_text() + "promts: [a]\n")
    run = _difftest_run(root, "cases/", "--engines=ref", "-q", cache=tmp_path / "cache")
    assert run.returncode == exit_codes.CONFIG, run.stdout + run.stderr
    assert "promts: unknown field" in run.stdout


def test_a_misspelt_run_option_is_a_usage_error_naming_the_closest(capsys):
    assert cli.main(["run", "--engine=ref"]) == exit_codes.USAGE
    assert capsys.readouterr().err == "difftest run: unknown option --engine (did you mean --engines?)\n"


def test_a_prefix_of_an_option_is_refused_not_taken_as_the_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["fixtures", "--lis"])
    assert e.value.code == exit_codes.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--lis (did you mean --list?)" in err


def test_run_help_documents_its_arguments_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    for documented in ("cases", "--reference", "--out", "--engine-python", "--allow-missing-engines", "--json"):
        assert documented in out, documented
    assert "7 an engine is not installed or could not start" in " ".join(out.split())
    assert "--report-dir" not in out  # the deprecated spelling works but is not advertised


# -- one name per concept ------------------------------------------------------------------------


def test_the_old_report_dir_spelling_warns_naming_out(capsys, tmp_path):
    cli.main(["report", str(tmp_path / "missing.json"), "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "difftest: --out-dir is deprecated and goes in the next release; use --out" in err


def test_bundle_takes_out_and_warns_on_dash_o(capsys, tmp_path):
    cli.main(["bundle", str(tmp_path / "missing.json"), "-o", str(tmp_path / "b.tar.gz")])
    assert "-o is deprecated and goes in the next release; use --out" in capsys.readouterr().err


def test_version_names_the_package_and_the_pinned_engine_releases(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("difftest ") and "sglang " in out


# -- listings and the cache --------------------------------------------------------------------


def _fake_env(root: Path, name: str, engine_dist: str, version: str, complete: bool) -> Path:
    env = root / "envs" / name
    (env / "lib" / "python3.11" / "site-packages" / f"{engine_dist}-{version}.dist-info").mkdir(parents=True)
    (env / "bin").mkdir()
    (env / "bin" / "python").write_text("x" * 100)
    if complete:
        (env / ".complete").write_text("")
    return env


def test_env_list_names_engine_release_size_and_completeness(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path))
    built = _fake_env(tmp_path, "sglang-0123456789ab", "sglang", "0.5.23", complete=True)
    _fake_env(tmp_path, "vllm-0123456789ab.partial", "vllm", "0.32.0", complete=False)
    (tmp_path / "envs" / "sglang@old").symlink_to(built)
    assert cli.main(["env", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["sglang-0123456789ab"]["engine"] == "sglang"
    assert rows["sglang-0123456789ab"]["release"] == "0.5.23"
    assert rows["sglang-0123456789ab"]["complete"] is True
    assert rows["sglang-0123456789ab"]["size"] >= 100
    assert rows["vllm-0123456789ab.partial"]["complete"] is False
    assert rows["sglang@old"]["link_to"] == str(built)


def test_fixtures_list_says_which_are_built_and_where(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path))
    (tmp_path / "fixtures" / "v1" / "tiny-llama-eagle3").mkdir(parents=True)
    assert cli.main(["fixtures", "--list", "tiny-llama-eagle3", "tiny-qwen3"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()}
    assert "not built" not in lines["tiny-llama-eagle3"]
    assert str(tmp_path / "fixtures" / "v1" / "tiny-llama-eagle3") in lines["tiny-llama-eagle3"]
    assert "not built" in lines["tiny-qwen3"]


def test_cache_sizes_each_kind(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path))
    (tmp_path / "captures" / "ab").mkdir(parents=True)
    (tmp_path / "captures" / "ab" / "c.pt").write_bytes(b"x" * 1000)
    assert cli.main(["cache", "--json"]) == 0
    kinds = {k["kind"]: k for k in json.loads(capsys.readouterr().out)["kinds"]}
    assert set(kinds) == {"captures", "envs", "fixtures", "releases", "engine-info"}
    assert kinds["captures"]["bytes"] == 1000


def test_cache_prune_removes_old_captures_only_and_never_an_environment(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path))
    old, new = tmp_path / "captures" / "ab" / "old.pt", tmp_path / "captures" / "cd" / "new.pt"
    for path in (old, new):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
    month_ago = time.time() - 30 * 86400
    os.utime(old, (month_ago, month_ago))
    env = _fake_env(tmp_path, "sglang-0123456789ab", "sglang", "0.5.23", complete=True)
    os.utime(env / "bin" / "python", (month_ago, month_ago))
    assert cli.main(["cache", "prune", "--older-than", "7", "--dry-run"]) == 0
    assert old.exists()
    assert cli.main(["cache", "prune", "--captures", "--older-than", "7"]) == 0
    assert not old.exists() and not old.parent.exists()
    assert new.exists() and (env / "bin" / "python").exists()
    assert "removed 1 files" in capsys.readouterr().out


# -- progress ----------------------------------------------------------------------------------


def _collect(fmt: str, heartbeat_s: float = 0.0) -> tuple[Progress, list[str]]:
    lines: list[str] = []
    return Progress(fmt, lines.append, heartbeat_s=heartbeat_s), lines


def test_progress_lines_carry_the_elapsed_time():
    progress, lines = _collect("lines")
    progress("starting sglang")
    assert lines[0].startswith("[difftest] starting sglang  (t+") and lines[0].endswith("s)")


def test_progress_json_is_one_object_per_line_with_the_documented_fields():
    progress, lines = _collect("json")
    progress("starting sglang")
    assert set(json.loads(lines[0])) == {"event", "elapsed_s", "message"}
    assert json.loads(lines[0])["event"] == "step"


def test_a_quiet_step_gets_a_heartbeat_naming_what_is_awaited_until_idle():
    progress, lines = _collect("json", heartbeat_s=0.05)
    progress("starting sglang")
    deadline = time.monotonic() + 30
    while len(lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    progress.idle()
    beat = json.loads(lines[1])
    assert beat["event"] == "waiting" and beat["message"] == "starting sglang" and "waited_s" in beat
    settled = len(lines)
    time.sleep(0.3)
    progress.close()
    assert len(lines) == settled  # idle: nothing is awaited, no heartbeat
