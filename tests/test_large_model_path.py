"""The large-model path: cases whose checkpoints live elsewhere (${VAR} paths, skipped where the
variable is unset), tensor-parallel settings, and a reference that refuses a target it cannot hold."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from difftest.case.case import load_case
from difftest.base.errors import CaseNotConfigured, EngineUnavailable
from difftest_engines.ref import target as target_mod
from helpers import ROOT, run_pytest

KIMI_CASE = ROOT / "cases" / "kimi_k25_gpu.yaml"


def test_unset_variable_makes_the_case_not_configured(tmp_path, monkeypatch):
    monkeypatch.delenv("DIFFTEST_T", raising=False)
    (tmp_path / "c.yaml").write_text("target: ${DIFFTEST_T}\ndraft: x\nprompts: [{ids: [1]}]\n")
    with pytest.raises(CaseNotConfigured, match=r"c\.yaml: target needs \$\{DIFFTEST_T\}, which is not set here"):
        load_case(tmp_path / "c.yaml")


def test_variables_and_defaults_expand_in_paths_and_engine_settings(tmp_path, monkeypatch, models):
    target, draft = models
    monkeypatch.setenv("DIFFTEST_T", str(target))
    monkeypatch.delenv("DIFFTEST_TP", raising=False)
    (tmp_path / "c.yaml").write_text(
        f"target: ${{DIFFTEST_T}}\ndraft: ${{DIFFTEST_D:-{draft}}}\nprompts: [{{ids: [1]}}]\n"
        "engines: {vllm: {tensor_parallel_size: '${DIFFTEST_TP:-8}'}}\n"
    )
    case = load_case(tmp_path / "c.yaml")
    assert (case.target, case.draft) == (str(target), str(draft))
    assert case.engines["vllm"]["tensor_parallel_size"] == "8"


def test_kimi_case_skips_naming_the_variable_when_its_checkpoints_are_absent(tmp_path):
    (tmp_path / "cases").mkdir()
    shutil.copy(KIMI_CASE, tmp_path / "cases")
    env = {"DIFFTEST_KIMI_TARGET": "", "DIFFTEST_KIMI_DRAFT": ""}
    run = run_pytest(tmp_path, "cases/", "--engines=ref,fake", env=env)
    assert run.returncode == 0, run.output
    assert "1 skipped" in run.output
    assert "target needs ${DIFFTEST_KIMI_TARGET}, which is not set here" in run.output


def test_kimi_case_loads_with_tensor_parallel_settings_when_configured(monkeypatch, models):
    target, draft = models
    monkeypatch.setenv("DIFFTEST_KIMI_TARGET", str(target))
    monkeypatch.setenv("DIFFTEST_KIMI_DRAFT", str(draft))
    monkeypatch.delenv("DIFFTEST_TP", raising=False)
    case = load_case(KIMI_CASE)
    assert case.engines["sglang"]["tp_size"] == "8"
    assert case.engines["vllm"]["tensor_parallel_size"] == "8"
    assert case.wiring == ["h0", "h3", "h31"]
    assert case.dtype == "bfloat16"


def _fake_checkpoint(directory: Path, stored_dtype: str, numel: int) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"torch_dtype": stored_dtype}))
    save_file({"w": torch.zeros(numel, dtype=getattr(torch, stored_dtype))}, str(directory / "model.safetensors"))
    return directory


def test_checkpoint_bytes_scale_from_the_stored_dtype_to_the_load_dtype(tmp_path):
    path = _fake_checkpoint(tmp_path / "ckpt", "bfloat16", 1 << 20)
    stored = (path / "model.safetensors").stat().st_size
    assert target_mod.checkpoint_bytes(path, torch.bfloat16) == stored
    assert target_mod.checkpoint_bytes(path, torch.float32) == stored * 2


def test_reference_refuses_a_target_larger_than_memory_with_the_way_out(tmp_path, monkeypatch):
    path = _fake_checkpoint(tmp_path / "big", "bfloat16", 1 << 20)
    monkeypatch.setattr(target_mod, "available_memory", lambda: 1 << 20)
    with pytest.raises(EngineUnavailable) as e:
        target_mod.load_target(path, torch.bfloat16)
    msg = str(e.value)
    assert msg.startswith(f"ref cannot hold target {path}: 0.0 GiB of weights in bfloat16, 0.0 GiB of memory available")
    assert "--reference=sglang" in msg and "--engines=train,sglang" in msg


def test_reference_loads_a_target_that_fits(models):
    model = target_mod.load_target(models[0], torch.float32)
    assert model.config.num_hidden_layers == 6
