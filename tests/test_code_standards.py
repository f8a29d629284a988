"""The code standards, checked by the ecosystem's own tools with the settings in pyproject.toml:

* import-linter: the architecture (the core never imports an engine, the core in floors whose imports
  all go down (entry points, checks, run, report, compare, case, rules, records, base), no circles in
  the core, engines importing the core through one surface (difftest.api), reports built from
  records and never from a live session, rule data that is data, the
  serving adapters independent of each other, the fixtures imported by no engine, no circles in the
  reference engine or the fixtures);
* ruff: pyflakes, syntax and statement errors, bugbear's likely bugs; and its formatter's layout;
* mypy: the core's types, its typed records included.

Each runs as the user would run it, from the project root, in the project's environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

BIN = Path(sys.executable).parent
PATHS = ("difftest", "difftest_engines", "difftest_fixtures", "tests", "benchmarks", "scripts")


def run_tool(*argv: str) -> subprocess.CompletedProcess:
    tool = BIN / argv[0]
    if not tool.exists():
        pytest.fail(f"{argv[0]} is not installed in {BIN}: scripts/setup installs it (requirements-cpu.txt)")
    return subprocess.run([str(tool), *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_the_architecture_contracts_hold():
    out = run_tool("lint-imports")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout and "Contracts: 11 kept" in out.stdout, out.stdout[-2000:]


def test_ruff_finds_nothing():
    out = run_tool("ruff", "check", "--no-cache", *PATHS)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_format_leaves_every_file_as_it_is():
    out = run_tool("ruff", "format", "--check", "--no-cache", *PATHS)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_mypy_finds_no_type_error_in_the_core(tmp_path):
    out = run_tool("mypy", "--cache-dir", str(tmp_path / "mypy-cache"))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Success: no issues found" in out.stdout, out.stdout[-2000:]
