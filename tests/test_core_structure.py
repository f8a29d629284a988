"""The core knows no engine: engines reach the core only through entry points (adapters, fixtures,
checks, CLI commands: difftest.extensions). That nothing under difftest/ imports the `engines`
package is an import-linter contract (pyproject.toml; tests/test_code_standards.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, TINY_CASE, make_tiny_pair, run_pytest



@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    return make_tiny_pair(tmp_path_factory.mktemp("models"))


def test_one_cache_root_expands_the_user_directory(monkeypatch):
    from difftest.paths import cache_root

    monkeypatch.setenv("DIFFTEST_CACHE", "~/somewhere")
    assert cache_root() == Path.home() / "somewhere"
    monkeypatch.delenv("DIFFTEST_CACHE")
    assert cache_root() == Path.home() / ".cache" / "difftest"


def test_engines_contribute_checks_and_commands_through_entry_points():
    from difftest.extensions import commands, extra_checks

    assert "train_accuracy" in extra_checks()
    assert {"train-acc", "dump"} <= set(commands())
    out = subprocess.run([sys.executable, "-m", "difftest.cli", "train-acc", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)  # fmt: skip
    assert out.returncode == 0 and "--data" in out.stdout, out.stderr


def test_a_case_file_named_on_the_command_line_is_collected_wherever_it_lives(tmp_path, models):
    target, draft = models
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "my_case.yaml").write_text(TINY_CASE.format(target=target, draft=draft))
    (tmp_path / "elsewhere" / "ci.yaml").write_text("jobs: {}\n")  # not named: never collected
    run = run_pytest(tmp_path, "elsewhere/my_case.yaml", "--engines=ref,ref[wiring=vllm]", "--collect-only", "-q")
    assert "elsewhere/my_case.yaml::ref[wiring=vllm]::fc_inputs" in run.output.splitlines(), run.output
    listed = run_pytest(tmp_path, "elsewhere/", "--engines=ref", "--collect-only", "-q")
    assert "ci.yaml" not in listed.output and "my_case.yaml" not in listed.output


def test_the_installed_plugin_runs_cases_without_naming_it(tmp_path, models):
    """`pip install` registers the plugin (pytest11): a user's repository needs no conftest and no -p."""
    target, draft = models
    (tmp_path / "repo" / "cases").mkdir(parents=True)
    (tmp_path / "repo" / "cases" / "mine.yaml").write_text(TINY_CASE.format(target=target, draft=draft))
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path / "repo"),
                          "-c", "/dev/null", "cases/", "--engines=ref,ref[wiring=vllm]", "--collect-only", "-q"],
                         cwd=tmp_path / "repo", capture_output=True, text=True, timeout=600)  # fmt: skip
    assert "cases/mine.yaml::ref[wiring=vllm]::accept_length" in out.stdout.splitlines(), out.stdout + out.stderr
