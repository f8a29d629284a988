"""`difftest fix` and the draft flags an engine release reads otherwise than training meant, from the
release rules (difftest.rules.engine_releases) alone, no engine started (`--no-verify`): a flag the
release reads from another place is written there; a flag it reads from no place gets no config fix,
but the releases that can serve the draft, or a draft trained without it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from helpers import ROOT, edited_copy

from difftest.run.case_run import resolve_fixture

NBFC_CASE = ROOT / "cases" / "release_sglang_norm_before_fc.yaml"  # drafted with norm_before_fc: true


def fix(case: Path, engine: str, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "difftest.cli", "fix", str(case), "--engines", engine, "--out", str(out), "--no-verify"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_release_that_cannot_read_a_trained_flag_gets_no_config_fix_but_the_releases_that_can(tmp_path):
    run = fix(NBFC_CASE, "sglang@0.5.16", tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert "SGLang 0.5.16 (Llama rule" in lines[0]  # the release's own rules, not the pinned one's
    assert lines[1] == (
        "no config fix: sglang 0.5.16 cannot read norm_before_fc (True in the draft config) from any place in "
        "the draft config, so no config edit makes it run the draft as trained"
    )
    assert lines[2].startswith("  serve the draft with a release that reads it: SGLang 0.5.17 - 0.5.23")
    assert lines[3] == "  or train the draft without norm_before_fc"
    assert not (tmp_path / "fix").exists() or not any((tmp_path / "fix").iterdir())  # no patch to apply


def test_a_release_that_reads_the_trained_flag_needs_no_edit_for_it(tmp_path):
    run = fix(NBFC_CASE, "sglang", tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "nothing to fix: the engine already feeds what training fed" in run.stdout


def test_a_flag_a_release_reads_from_another_place_is_written_where_it_reads(tmp_path):
    def nested(cfg: dict) -> None:  # the flag only in eagle_config, where vLLM before 0.22.0 never looks
        cfg.setdefault("eagle_config", {})["norm_before_fc"] = cfg.pop("norm_before_fc")

    draft = edited_copy(Path(resolve_fixture("fixture:tiny-llama-eagle3-nbfc")), tmp_path / "draft", config=nested)
    raw = yaml.safe_load(NBFC_CASE.read_text())
    raw.update(name="nested_flag", draft=str(draft))
    raw.pop("expect_failure")
    case = tmp_path / "nested_flag.yaml"
    case.write_text(yaml.safe_dump(raw, sort_keys=False))
    run = fix(case, "vllm@0.21.0", tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "note: norm_before_fc: True written at top level, where vllm 0.21.0 reads it" in run.stdout
    patch = json.loads((tmp_path / "fix" / "nested_flag.vllm@0.21.0.patch.json").read_text())
    assert patch == {"norm_before_fc": True}
    patched = yaml.safe_load((tmp_path / "fix" / "nested_flag.vllm@0.21.0.yaml").read_text())
    assert patched["engines"]["vllm@0.21.0"]["draft_config_overrides"] == {"norm_before_fc": True}


def fake_env(cache: Path, name: str, version: str) -> Path:
    """An engine environment as `difftest env create` leaves it, as far as its release goes: the engine's
    dist-info folder names it (difftest.run.envs)."""
    env = cache / "envs" / f"sglang-{name}"
    (env / "lib" / "python3.11" / "site-packages" / f"sglang-{version}.dist-info").mkdir(parents=True)
    (env / "bin").mkdir()
    (env / "bin" / "python").write_text("")
    return env


def test_the_release_fixed_for_is_the_one_in_the_engines_environment(tmp_path, monkeypatch):
    from difftest.fix_command import engine_release
    from difftest.run.engine import parse_spec

    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path))
    monkeypatch.delenv("DIFFTEST_PYTHON_SGLANG", raising=False)
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "sglang").symlink_to(fake_env(tmp_path, "a", "0.5.16"), target_is_directory=True)
    other = fake_env(tmp_path, "b", "0.5.20")
    assert engine_release(parse_spec("sglang"), []) == "0.5.16"
    assert engine_release(parse_spec("sglang"), [f"sglang={other / 'bin' / 'python'}"]) == "0.5.20"


def test_a_release_label_names_the_release_where_no_environment_does(tmp_path, monkeypatch):
    from difftest.fix_command import engine_release
    from difftest.run.engine import parse_spec

    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path))
    monkeypatch.delenv("DIFFTEST_PYTHON_SGLANG_0_5_16", raising=False)
    assert engine_release(parse_spec("sglang@0.5.16"), []) == "0.5.16"
    assert engine_release(parse_spec("sglang@old"), []) is None  # not a release: the pinned rules apply
