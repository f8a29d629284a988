"""`difftest fix` and the paths it reads and writes, with no engine started (`--no-verify`: the edit is
computed from SGLang's layer-id rule alone).

The patched case it writes names the same models and prompt files as the user's case, written the
way the user wrote them: a `${VAR}` stays `${VAR}`, an absolute path stays absolute, a relative path
is re-rooted on the patched case's own folder. And every file it will write is checked before any
case is computed: an --out it cannot use, or files an earlier fix wrote (without --force), end the
command with one line and the usage exit code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT

from difftest.base.exit_codes import USAGE
from difftest.case.case import load_case
from difftest.run.case_run import resolve_fixture

SOURCE = ROOT / "cases" / "tiny_llama_sglang_default_ids.yaml"  # SGLang's off-by-one: a patch to write
VAR = "DIFFTEST_TEST_FIX_MODELS"


def fix(case: Path, out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "difftest.cli",
            "fix",
            str(case),
            "--engines",
            "sglang",
            "--out",
            str(out),
            "--no-verify",
        ]
        + list(extra),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A folder of models the way a user keeps them: links to the tiny target and draft."""
    root = tmp_path_factory.mktemp("models")
    (root / "target").symlink_to(resolve_fixture("fixture:tiny-llama"))
    (root / "draft").symlink_to(resolve_fixture("fixture:tiny-llama-eagle3"))
    return root


def user_case(folder: Path, **fields: object) -> Path:
    """The off-by-one case with `fields` replaced, written at folder/case.yaml; a prompt file beside it."""
    raw = yaml.safe_load(SOURCE.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.jsonl").write_text('{"text": "the sky is"}\n{"text": "one two three"}\n')
    raw.update(name="paths", **fields)
    path = folder / "case.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def patched(out: Path) -> Path:
    return out / "fix" / "paths.sglang.yaml"


def test_a_var_path_is_written_as_the_user_wrote_it_and_read_expanded(tmp_path, models, monkeypatch):
    case = user_case(tmp_path / "cases", target=f"${{{VAR}}}/target", draft=f"${{{VAR}}}/draft")
    run = fix(case, tmp_path / "reports", env={VAR: str(models)})
    assert run.returncode == 0, run.stdout + run.stderr
    written = yaml.safe_load(patched(tmp_path / "reports").read_text())
    assert (written["target"], written["draft"]) == (f"${{{VAR}}}/target", f"${{{VAR}}}/draft")
    monkeypatch.setenv(VAR, str(models))
    assert load_case(patched(tmp_path / "reports")).target == str(models / "target")


def test_a_relative_path_is_rerooted_on_the_patched_cases_folder(tmp_path, models):
    case = user_case(
        tmp_path / "cases",
        target=os.path.relpath(models / "target", tmp_path / "cases"),
        prompts={"file": "prompts.jsonl", "field": "text"},
    )
    out = tmp_path / "elsewhere" / "reports"
    run = fix(case, out)
    assert run.returncode == 0, run.stdout + run.stderr
    written = yaml.safe_load(patched(out).read_text())
    assert written["target"] == os.path.relpath(models / "target", out / "fix")
    assert written["prompts"]["file"] == "../../../cases/prompts.jsonl"
    again, before = load_case(patched(out)), load_case(case)
    assert (again.target, again.prompts) == (before.target, before.prompts)


def test_a_relative_path_keeps_a_link_the_user_named_unresolved(tmp_path, models):
    case = user_case(tmp_path / "cases", target=os.path.relpath(models / "target", tmp_path / "cases"))
    run = fix(case, tmp_path / "reports")
    assert run.returncode == 0, run.stdout + run.stderr
    target = yaml.safe_load(patched(tmp_path / "reports").read_text())["target"]
    assert target.endswith(f"{models.name}/target"), target  # not the fixture cache the link points into


def test_an_absolute_path_stays_as_written(tmp_path, models):
    case = user_case(tmp_path / "cases", target=str(models / "target"))
    run = fix(case, tmp_path / "reports")
    assert run.returncode == 0, run.stdout + run.stderr
    assert yaml.safe_load(patched(tmp_path / "reports").read_text())["target"] == str(models / "target")


def test_a_var_that_expands_to_a_relative_path_keeps_the_var_led_by_the_way_back(tmp_path, models, monkeypatch):
    case = user_case(tmp_path / "cases", target=f"${{{VAR}}}/target")
    relative = os.path.relpath(models, tmp_path / "cases")
    run = fix(case, tmp_path / "reports", env={VAR: relative})
    assert run.returncode == 0, run.stdout + run.stderr
    written = yaml.safe_load(patched(tmp_path / "reports").read_text())["target"]
    assert written == f"../../cases/${{{VAR}}}/target"
    monkeypatch.setenv(VAR, relative)
    assert load_case(patched(tmp_path / "reports")).target == load_case(case).target


def test_an_earlier_fixs_files_are_refused_before_any_case_is_computed(tmp_path):
    first = fix(SOURCE, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    patch = tmp_path / "fix" / "tiny_llama_sglang_default_ids.sglang.patch.json"
    patch.write_text("{}\n")  # the user's edit of the old patch
    again = fix(SOURCE, tmp_path)
    assert again.returncode == USAGE and again.stdout == "", again.stdout + again.stderr
    assert again.stderr == (f"difftest fix: --out: {patch} already exists, from an earlier fix (--force replaces it)\n")
    assert patch.read_text() == "{}\n"


def test_force_replaces_an_earlier_fixs_files(tmp_path):
    assert fix(SOURCE, tmp_path).returncode == 0
    patch = tmp_path / "fix" / "tiny_llama_sglang_default_ids.sglang.patch.json"
    patch.write_text("{}\n")
    again = fix(SOURCE, tmp_path, "--force")
    assert again.returncode == 0, again.stdout + again.stderr
    assert patch.read_text() != "{}\n"


def test_an_out_that_is_a_file_is_refused_in_one_line_before_any_case_is_computed(tmp_path):
    out = tmp_path / "a-file"
    out.write_text("")
    run = fix(SOURCE, out)
    assert run.returncode == USAGE and run.stdout == "", run.stdout + run.stderr
    assert run.stderr == f"difftest fix: --out: {out} is not a directory (needed for {out / 'fix'})\n"


def test_an_output_file_that_is_a_directory_is_refused_even_with_force(tmp_path):
    taken = tmp_path / "fix" / "tiny_llama_sglang_default_ids.sglang.yaml"
    taken.mkdir(parents=True)
    run = fix(SOURCE, tmp_path, "--force")
    assert run.returncode == USAGE and run.stdout == "", run.stdout + run.stderr
    assert run.stderr == f"difftest fix: --out: {taken} is a directory; give a file path\n"


def test_a_reordered_draft_is_named_beside_the_patched_case_so_the_two_move_together(tmp_path):
    case = ROOT / "cases" / "catalogue_ids_unsorted.yaml"  # trained out of layer order: fc's blocks reordered
    run = fix(case, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    written = tmp_path / "fix" / "catalogue_ids_unsorted.sglang.yaml"
    assert yaml.safe_load(written.read_text())["draft"] == "catalogue_ids_unsorted.sglang.draft"
    assert load_case(written).draft == str(tmp_path / "fix" / "catalogue_ids_unsorted.sglang.draft")
