"""`difftest rules discover`: a release's layer-id rule measured on the real engine, with designed draft
configs, never read from the rule tables; then compared with the rule on record. Releases whose rules
are known stand in for one nobody has read yet: the measurement must recover their rule exactly (over
the places probed: the top level, eagle_config's own key, eagle_config.layer_ids).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_engine_vllm import vllm_python
from test_upgrade_real_releases import OLD_SGLANG, _python

from difftest.base import exit_codes
from helpers import ROOT


def _discover(tmp_path: Path, engine: str, python: str) -> tuple[subprocess.CompletedProcess, dict]:
    name = engine.split("[")[0].split("@")[0]
    key = engine.split("[")[0]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "difftest.cli",
            "rules",
            "discover",
            engine,
            "--out",
            str(tmp_path),
            "--engine-python",
            f"{key}={python}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert name
    return done, json.loads((tmp_path / f"{engine}.json").read_text())


def test_model_runner_v2_is_rediscovered_exactly(tmp_path):
    done, rule = _discover(tmp_path, "vllm", vllm_python())
    assert rule["compared_with"] == "vLLM 0.32.0 Model Runner V2" and rule["differences"] == [], done.stdout
    assert rule["ids_from"] == ["top level", "eagle_config.layer_ids"]
    assert (rule["shift"], rule["sorted_by_layer"], rule["defaults_formula"]) == (0, True, "2, L//2, L-3")


def test_model_runner_v1_is_rediscovered_exactly(tmp_path):
    done, rule = _discover(tmp_path, "vllm[runner=v1]", vllm_python())
    assert rule["compared_with"] == "vLLM 0.32.0 Model Runner V1" and rule["differences"] == [], done.stdout
    assert rule["ids_from"] == ["top level", "eagle_config"]


def test_an_older_sglang_release_is_rediscovered_exactly(tmp_path):
    python = _python("sglang", OLD_SGLANG)
    done, rule = _discover(tmp_path, f"sglang@{OLD_SGLANG}", python)
    assert rule["compared_with"] == f"SGLang {OLD_SGLANG}" and rule["differences"] == [], done.stdout
    assert (rule["ids_from"], rule["shift"]) == (["eagle_config"], 1)


def test_a_target_too_shallow_to_probe_is_one_line(tmp_path):
    from difftest.run.case_run import resolve_fixture

    shallow = resolve_fixture("fixture:tiny-qwen3")  # 4 layers
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "difftest.cli",
            "rules",
            "discover",
            "vllm",
            "--target",
            shallow,
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == exit_codes.TROUBLE  # the command could not answer
    assert "discovery needs a target of at least 6 layers" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "argv,words",
    [
        (["rules", "discover", "vllm", "--engine-python", "vllm"], "is not NAME=PATH"),
        (["rules", "discover", "vlm"], "unknown engine"),
    ],
)
def test_a_bad_argument_is_a_usage_error_in_one_line(tmp_path, argv, words):
    done = subprocess.run(
        [sys.executable, "-m", "difftest.cli", *argv, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == exit_codes.USAGE and words in done.stderr and "Traceback" not in done.stderr
