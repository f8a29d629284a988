"""scripts/uv-pip: every environment the project builds installs through uv, with pip's own sources.

uv reads no pip configuration; the wrapper passes the machine's on (its find-links folder holds the
CPU build of torch 2.13.0, which PyPI does not serve under that name) and keeps pip's choice of the
best version across every index. Resolution runs for real (`--dry-run`: nothing is installed).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UV_PIP = ROOT / "scripts" / "uv-pip"


@pytest.fixture(scope="module")
def empty_env(tmp_path_factory) -> str:
    """A fresh environment with nothing installed: what a dry run would install there is everything."""
    env = tmp_path_factory.mktemp("uv-pip") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    return str(env / "bin" / "python")


def uv_pip(python: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(UV_PIP), python, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"},
    )


def pip_find_links() -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    return [v for m in re.finditer(r"find-links='([^']*)'", out) for v in m.group(1).split() if Path(v).exists()]


def test_an_unknown_action_is_refused_in_one_line_naming_the_actions(empty_env):
    run = uv_pip(empty_env, "freeze")
    assert run.returncode == 2
    assert run.stderr.strip() == "scripts/uv-pip: unknown action 'freeze' (install or uninstall)"


def test_pips_find_links_reach_uv_so_a_pin_resolves_to_the_local_cpu_build(empty_env):
    local = [w for d in pip_find_links() for w in Path(d).glob("torch-2.13.0+cpu-*.whl")]
    if not local:
        pytest.skip("this machine's pip has no find-links folder with torch 2.13.0+cpu")
    run = uv_pip(empty_env, "install", "--dry-run", "--no-deps", "torch==2.13.0")
    assert run.returncode == 0, run.stderr
    assert "+ torch==2.13.0+cpu" in run.stdout + run.stderr, run.stdout + run.stderr


def test_a_pin_served_by_a_later_index_resolves_as_pip_resolves_it(empty_env):
    """pip takes the best match over every index; uv's default would stop at the first index that
    lists the name (here a partial local index that lacks the pinned version)."""
    run = uv_pip(empty_env, "install", "--dry-run", "--no-deps", "aiohttp==3.14.5")
    assert run.returncode == 0, run.stderr
    assert "+ aiohttp==3.14.5" in run.stdout + run.stderr, run.stdout + run.stderr
