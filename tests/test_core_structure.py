"""The core knows no engine: engines reach the core only through entry points (adapters, fixtures,
checks, CLI commands: difftest.base.extensions). That nothing under difftest/ imports the `difftest_engines`
package is an import-linter contract (pyproject.toml; tests/test_code_standards.py); that no core
logic names an engine in a string is checked here, since import-linter sees imports only."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from helpers import ROOT, TINY_CASE, run_pytest


def test_one_cache_root_expands_the_user_directory(monkeypatch):
    from difftest.base.paths import cache_root

    monkeypatch.setenv("DIFFTEST_CACHE", "~/somewhere")
    assert cache_root() == Path.home() / "somewhere"
    monkeypatch.delenv("DIFFTEST_CACHE")
    assert cache_root() == Path.home() / ".cache" / "difftest"


# the engines' rules as data, keyed by engine and release (pyproject.toml's "Rule data is data" contract)
RULE_DATA = {
    "difftest/rules/draft_rules.py",
    "difftest/rules/layer_rules.py",
    "difftest/rules/engine_releases.py",
    "difftest/rules/wiring.py",
}


def registered_engine_names() -> set[str]:
    """The names pyproject.toml registers adapters under (difftest.engines entry points)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(project["project"]["entry-points"]["difftest.engines"])


def engine_literals(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, text) of every string constant that is an engine name or spec (`vllm`, `ref[...]`,
    `sglang@old`) outside docstrings."""
    tree = ast.parse(source)
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    spec = re.compile(rf"({'|'.join(map(re.escape, sorted(names)))})([\[@].*)?", re.S)
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and spec.fullmatch(n.value)
    ]


def test_the_literal_scan_finds_engine_names_and_specs_but_not_prose():
    found = engine_literals(
        '"""About vllm."""\nA = "vllm"\nB = f"{x} sglang"\nC = "ref[wiring=h0]"\nD = "vllm-cpu"\n',
        {"vllm", "sglang", "ref"},
    )
    assert found == [(2, "vllm"), (4, "ref[wiring=h0]")]


def test_core_logic_names_no_engine_outside_the_rule_data():
    names = registered_engine_names()
    assert {"ref", "vllm", "sglang", "train", "server"} <= names
    found = {
        f"{p.relative_to(ROOT)}:{line}: {text!r}"
        for p in sorted((ROOT / "difftest").rglob("*.py"))
        if str(p.relative_to(ROOT)) not in RULE_DATA
        for line, text in engine_literals(p.read_text(), names)
    }
    assert not found, "engine names in core logic (move them to rule data or the engine):\n" + "\n".join(sorted(found))
    assert all(engine_literals((ROOT / p).read_text(), names) for p in RULE_DATA)  # the list holds no stale entry


def test_the_calibration_engine_is_the_one_whose_adapter_says_so():
    from difftest.base.registry import calibration_engine, registered_engines
    from difftest_engines.ref.engine import RefEngine

    assert registered_engines()[calibration_engine()] == f"{RefEngine.__module__}:{RefEngine.__name__}"
    assert RefEngine.CALIBRATES


def test_the_server_engine_brings_its_probe_command_and_its_accept_length():
    from difftest.base.check_registry import replacement
    from difftest.base.extensions import commands

    assert commands()["probe"].run.__module__ == "difftest_engines.server.command"
    assert replacement("accept_length", "server").run.__module__ == "difftest_engines.server.probe"
    assert replacement("accept_length", "vllm") is None


def test_engines_contribute_checks_and_commands_through_entry_points():
    from difftest.base.check_registry import check_specs
    from difftest.base.extensions import commands

    assert "train_accuracy" in check_specs()
    assert {"train-acc", "dump"} <= set(commands())
    out = subprocess.run(
        [sys.executable, "-m", "difftest.cli", "train-acc", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
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
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path / "repo"),
            "-c",
            "/dev/null",
            "cases/",
            "--engines=ref,ref[wiring=vllm]",
            "--collect-only",
            "-q",
        ],
        cwd=tmp_path / "repo",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "cases/mine.yaml::ref[wiring=vllm]::accept_length" in out.stdout.splitlines(), out.stdout + out.stderr


def test_docs_layout_names_every_module_and_no_other():
    """docs/layout.md is where a reader finds what a module is for: every module of difftest/, difftest_engines/
    and difftest_fixtures/ (package __init__.py files apart) is named there by its path, and every path it
    names exists, so a new, renamed or removed module fails here by name until the doc follows."""
    layout = (ROOT / "docs" / "layout.md").read_text()
    named = set(re.findall(r"`((?:difftest|difftest_engines|difftest_fixtures)/[\w/]+\.py)`", layout))
    modules = {
        path.relative_to(ROOT).as_posix()
        for top in ("difftest", "difftest_engines", "difftest_fixtures")
        for path in (ROOT / top).rglob("*.py")
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    }
    missing, gone = sorted(modules - named), sorted(named - modules)
    assert not missing, f"docs/layout.md: modules not named (add a line to 'Every module'): {', '.join(missing)}"
    assert not gone, f"docs/layout.md: names modules that do not exist: {', '.join(gone)}"


def _api_names_imported_by(*packages: str) -> set[str]:
    """Every name the given packages take from difftest.api (`from difftest.api import X` or `api.X`)."""
    used: set[str] = set()
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            if "cpu_shim/site" in str(path):
                continue  # SGLang's patched copies, not our code
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "difftest.api":
                    used |= {alias.name for alias in node.names}
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "api":
                    used.add(node.attr)
    return used


def test_the_public_surface_is_what_the_engines_and_fixtures_import_and_nothing_more():
    import difftest.api

    used = _api_names_imported_by("difftest_engines", "difftest_fixtures")
    exported = set(difftest.api.__all__)
    assert not exported - used, f"difftest.api exports names no engine or fixture imports: {sorted(exported - used)}"
    assert not used - exported, (
        f"engines or fixtures import names difftest.api does not export: {sorted(used - exported)}"
    )
