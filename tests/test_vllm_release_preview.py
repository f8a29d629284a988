"""`difftest preview vllm==X`: releases that cannot run here (CUDA-only: 0.33.0, 0.34.0) answered by their
own config code, unpacked from their wheels, on every shipped case, beside the pinned release's own answer.

Needs vLLM's environment (its interpreter runs the release's code) and PyPI once per cache (the wheels).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_engine_vllm import vllm_python

from helpers import ROOT

V2_IDS = "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py::get_eagle3_aux_layers_from_config"
V1_IDS = "v1/worker/gpu_model_runner.py::GPUModelRunner._get_eagle3_aux_layers_from_config"
SHIPPED = sorted(p for p in (ROOT / "cases").glob("*.yaml"))


def _preview(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "difftest.cli", "preview", *args, f"--engine-python={vllm_python()}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )


@pytest.fixture(scope="module", params=["0.33.0", "0.34.0"])
def preview(request):
    done = _preview(f"vllm=={request.param}", *map(str, SHIPPED))
    return request.param, done


def _block(output: str, case: str) -> list[str]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{case}: "))
    end = next((j for j in range(start + 1, len(lines)) if not lines[j].startswith("  ")), len(lines))
    return lines[start:end]


def test_the_preview_runs_the_releases_own_code_on_every_shipped_case(preview):
    version, done = preview
    assert done.returncode in (0, 1), done.stderr[-2000:]
    assert f"vllm {version} preview: its own config code" in done.stdout
    for path in SHIPPED:
        name = path.stem
        if name == "kimi_k25_gpu":  # its target lives on a GPU machine: one line, the rest goes on
            assert "DIFFTEST_KIMI_TARGET" in done.stdout
            continue
        block = "\n".join(_block(done.stdout, name))
        assert f"vllm {version} runner v2: " in block and V2_IDS in block, block
        assert "vllm 0.32.0 runner v1: " in block and "vllm 0.32.0 runner v2: " in block, block


def test_the_preview_finds_v2_feeding_its_defaults_to_nested_ids(preview):
    version, done = preview
    block = "\n".join(_block(done.stdout, "catalogue_ids_nested_only"))
    assert (
        f"vllm {version} runner v2: no ids ({V2_IDS}) -> its defaults [2, 4, 5] -> feeds [h2, h4, h5]  DIFFERS" in block
    )
    assert "vllm 0.32.0 runner v1: ids [0, 2, 4]" in block and "(as trained)" in block
    assert done.returncode == 1  # the release feeds a shipped case otherwise than trained


def test_the_preview_says_which_release_still_has_model_runner_v1(preview):
    version, done = preview
    block = "\n".join(_block(done.stdout, "tiny_llama"))
    has_v1 = f"vllm {version} runner v1: ids [2, 4, 5] ({V1_IDS})" in block
    assert has_v1 == (version == "0.33.0"), block  # read in the wheels: 0.34.0 removed V1


def test_a_release_without_a_wheel_is_one_line():
    done = _preview("vllm==0.0.99", str(ROOT / "cases" / "tiny_llama.yaml"))
    assert done.returncode == 2
    assert "vllm 0.0.99: no wheel could be downloaded" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_release_of_another_engine_is_refused_naming_the_form():
    done = _preview("sglang==0.5.24", str(ROOT / "cases" / "tiny_llama.yaml"))
    assert done.returncode == 4 and "expected vllm==VERSION" in done.stderr and "Traceback" not in done.stderr


def test_the_unpacked_release_is_reused(preview, tmp_path: Path):
    from difftest.base.paths import cache_root

    version, _ = preview
    assert (cache_root() / "releases" / f"vllm-{version}" / ".complete").is_file()


def test_the_preview_shows_the_draft_flags_as_the_releases_config_loading_leaves_them(preview):
    """A speculators-format draft's flags reach the model through the release's config conversion
    (configs/speculators/algos.py::update_eagle3): the preview runs it."""
    _, done = preview
    block = "\n".join(_block(done.stdout, "release_vllm_speculators_norm_output"))
    assert "draft flags after its config loading: " in block and "norm_output: top level True" in block, block
