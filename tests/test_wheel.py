"""The package as a user installs it: a wheel built from a source tree without `.git`, installed into a
fresh venv (no system site-packages, dependencies from the machine's package index through uv-pip),
run from a folder outside the checkout. Nothing here reads the checkout once the wheel is built.

The wheel and its venv are built once per session (about a minute: torch is most of it); the engine
environment `difftest env create sglang` finds is the one already built (keyed by its pins), so
nothing here builds one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from difftest.base.paths import cache_root
from difftest.run import envs
from helpers import ROOT

PACKAGES = ("difftest", "difftest_engines", "difftest_fixtures")
# what a source distribution carries besides the packages (README: the project's long description)
SOURCE_FILES = ("pyproject.toml", "README.md")
TINY_CASE = ROOT / "cases" / "tiny_llama.yaml"


@dataclass(frozen=True)
class Installed:
    python: Path  # the fresh venv's interpreter
    difftest: Path  # its `difftest` command
    site: Path  # where the wheel's packages landed
    env: dict[str, str]  # the environment commands run with: no checkout on any path


def _source_files(root: Path) -> list[Path]:
    """The packages' files as a source tree holds them (no caches, no build leftovers)."""
    out = []
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                out.append(path.relative_to(root))
    return out


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the source tree without `.git` (as an unpacked sdist is)."""
    src = tmp_path_factory.mktemp("source") / "difftest-src"
    for rel in [*map(Path, SOURCE_FILES), *_source_files(ROOT)]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("dist")
    # the build backend is the core venv's own setuptools (no build isolation: nothing fetched)
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        dict(os.environ),
        src,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (whl,) = out.glob("difftest-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Installed:
    """A fresh venv with the wheel and the dependencies it declares (and nothing else)."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    # the project's verified pins as constraints only: the wheel's own requirements decide what is installed
    done = _run(
        [
            "bash",
            str(ROOT / "scripts" / "uv-pip"),
            str(python),
            "install",
            "-q",
            "-c",
            str(ROOT / "requirements-cpu.txt"),
            str(wheel),
        ],
        env,
        venv,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    site = Path(
        _run(
            [str(python), "-c", "import difftest, pathlib; print(pathlib.Path(difftest.__file__).parents[1])"],
            env,
            venv,
        ).stdout.strip()
    )
    yield Installed(python, venv / "bin" / "difftest", site, env)
    # the links a worker imports through, keyed by this venv's location: gone with it
    root = _run([str(python), "-c", "from difftest.base.paths import import_root; print(import_root())"], env, venv)
    if root.returncode == 0 and root.stdout.strip().startswith(str(cache_root() / "import-roots")):
        shutil.rmtree(root.stdout.strip(), ignore_errors=True)


def test_wheel_declares_python_3_11_and_every_dependency_the_core_imports(wheel):
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = z.read(name).decode()
    assert "Requires-Python: >=3.11" in meta
    requires = {
        re.split(r"[<>=!;\[ ]", line.split(": ", 1)[1])[0].lower()
        for line in meta.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    }
    assert {"packaging", "pytest", "jinja2", "torch", "transformers", "pyyaml"} <= requires


def test_installed_command_prints_its_help_and_version(installed, tmp_path):
    helped = _run([str(installed.difftest), "--help"], installed.env, tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: difftest") and re.search(r"\{[^}]*\brun\b[^}]*\}", helped.stdout)
    version = _run([str(installed.difftest), "--version"], installed.env, tmp_path)
    assert version.returncode == 0, version.stderr
    assert "0.1.0" in version.stdout


def test_wheel_installs_its_packages_and_not_the_checkout(installed):
    found = _run(
        [str(installed.python), "-c", "import difftest_engines, difftest_fixtures; print('ok')"],
        installed.env,
        installed.site,
    )
    assert found.returncode == 0, found.stderr
    assert not installed.site.is_relative_to(ROOT)
    assert not (installed.site / "engines").exists() and not (installed.site / "fixtures").exists()


def test_every_module_imports_or_misses_only_what_its_engine_environment_provides(installed):
    """Engine adapters' worker modules import their engine (vllm, sglang, triton...): those run in the
    engine's own environment, whose pins list it. Anything else missing is an undeclared dependency."""
    script = r"""
import importlib, json, pkgutil, sys
failed = {}
for pkg in sys.argv[1:]:
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            failed[info.name] = e.name.split(".")[0]
        except Exception as e:
            failed[info.name] = "error: " + repr(e)
print(json.dumps(failed))
"""
    import json

    done = _run([str(installed.python), "-c", script, *PACKAGES], installed.env, installed.site, timeout=300)
    assert done.returncode == 0, done.stderr
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    undeclared = {}
    for module, missing in failed.items():
        parts = module.split(".")
        engine_dir = installed.site / "difftest_engines" / parts[1] if parts[0] == "difftest_engines" else None
        reqs = engine_dir / "requirements-cpu.txt" if engine_dir else None
        pins = (
            {re.split(r"[=<>;\s]", ln)[0].lower().replace("-", "_") for ln in reqs.read_text().splitlines()}
            if (reqs and reqs.is_file())
            else set()
        )
        if not (engine_dir and (missing == parts[1] or missing in pins)):
            undeclared[module] = missing
    assert undeclared == {}


def test_wheel_carries_every_file_of_the_packages(installed):
    """Requirement files, setup scripts, release recipes, SGLang's kernel shim, vLLM's rank start-up hook,
    the uv-pip wrapper: whatever the source tree's packages hold, the installed wheel holds too."""
    missing = [str(rel) for rel in _source_files(ROOT) if not (installed.site / rel).is_file()]
    assert missing == []


def test_workers_import_the_installed_packages_from_an_interpreter_without_difftest(installed, tmp_path):
    """An engine environment has no difftest: the import root the pool puts on a worker's PYTHONPATH
    gives it all three packages, from the installed wheel, without the core venv's site-packages."""
    root = _run(
        [str(installed.python), "-c", "from difftest.base.paths import import_root; print(import_root())"],
        installed.env,
        tmp_path,
    )
    assert root.returncode == 0, root.stderr
    import_root = Path(root.stdout.strip())
    assert not import_root.is_relative_to(ROOT) and import_root != installed.site
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    probe = "import difftest, difftest_engines, difftest_fixtures, os; print(os.path.realpath(difftest.__file__))"
    done = _run([str(bare / "bin" / "python"), "-c", probe], dict(installed.env, PYTHONPATH=str(import_root)), tmp_path)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).is_relative_to(installed.site)
    assert (import_root / "scripts" / "uv-pip").is_file()  # where the engines' setup scripts find it


def test_env_create_from_the_wheel_finds_the_environment_the_checkout_built(installed, tmp_path):
    plan = envs.plan("sglang", root=ROOT)
    if not plan.built:
        pytest.skip(f"SGLang's environment is not built ({plan.directory}); scripts/setup-engine sglang builds it")
    # a cache of its own that holds the checkout's build (linked): the links `env create` writes stay in
    # tmp_path, not in the user's cache
    cache = tmp_path / "cache"
    (cache / "envs").mkdir(parents=True)
    (cache / "envs" / plan.directory.name).symlink_to(plan.directory)
    env = dict(installed.env, DIFFTEST_CACHE=str(cache))
    done = _run([str(installed.difftest), "env", "create", "sglang"], env, tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"-> {cache / 'envs' / plan.directory.name} (built)" in done.stdout
    assert "building" not in done.stderr


def test_run_of_the_tiny_case_on_ref_passes_from_outside_the_checkout(installed, tmp_path):
    case = tmp_path / "tiny_llama.yaml"
    shutil.copy(TINY_CASE, case)
    # recaptured: a cached capture would skip the worker this checks starts from the wheel
    done = _run(
        [str(installed.difftest), "run", case.name, "--engines=ref", "--no-capture-cache"], installed.env, tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "passed" in done.stdout


def test_init_then_run_from_the_wheel_checks_a_draft_given_by_its_folders(installed, tmp_path):
    """The README's second screen from an installed wheel: `difftest init` on a target and a draft folder
    writes a case (with the shipped prompt set beside it, package data), and `difftest run` passes it."""
    shown = _run([str(installed.difftest), "fixtures", "tiny-llama", "tiny-llama-eagle3"], installed.env, tmp_path)
    assert shown.returncode == 0, shown.stdout[-2000:] + shown.stderr[-2000:]
    paths = dict(re.findall(r"^\[fixtures\] (\S+): (\S+)$", shown.stdout, flags=re.M))
    written = _run(
        [
            str(installed.difftest),
            "init",
            "--target",
            paths["tiny-llama"],
            "--draft",
            paths["tiny-llama-eagle3"],
            "--out",
            "mine.yaml",
        ],
        installed.env,
        tmp_path,
    )
    assert written.returncode == 0, written.stdout[-2000:] + written.stderr[-2000:]
    assert (tmp_path / "prompts" / "chat_small.jsonl").is_file()
    done = _run([str(installed.difftest), "run", "mine.yaml", "--engines=ref"], installed.env, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "passed" in done.stdout
