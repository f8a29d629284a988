"""Where the reference runs: `ref[device=cpu|cuda|cuda:N]` (difftest_engines/ref/device.py).

No GPU was lent to the session that wrote these: the CUDA path is held only as far as a CPU allows
(the refusal where torch has no CUDA device, what the info records, the check script's packing);
`scripts/gpu-check run` is the check on a GPU (docs/gpu.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TINY_CASE, make_tiny_pair, run_pytest

from difftest.base import exit_codes
from difftest.base.errors import ConfigError, EngineUnavailable
from difftest.case.case import load_case
from difftest.run.case_run import calibration_case
from difftest.run.engine import check_settings, parse_spec
from difftest_engines.ref import device as placement
from difftest_engines.ref.engine import RefEngine
from difftest_engines.ref.settings import SCHEMA

IDS = [1, 5, 9, 33, 77, 101, 7, 5, 0]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has a CUDA device")


@pytest.fixture(scope="module")
def tiny_case(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("device")
    target, draft = make_tiny_pair(root / "models", num_layers=4)
    path = root / "tiny.yaml"
    path.write_text(TINY_CASE.format(target=target, draft=draft) + "dtype: bfloat16\n")
    return path


def _same(a, b) -> None:
    assert a.tensors.keys() == b.tensors.keys()
    for name, t in a.tensors.items():
        assert torch.equal(t, b.tensors[name]), name
    assert (a.meta.target_next_token, a.meta.draft_tokens) == (b.meta.target_next_token, b.meta.draft_tokens)


def test_device_cpu_captures_exactly_what_the_reference_without_the_setting_captures(tiny_case):
    case = load_case(str(tiny_case))
    plain, cpu = RefEngine(parse_spec("ref")), RefEngine(parse_spec("ref[device=cpu]"))
    _same(plain.capture(case, IDS), cpu.capture(case, IDS))
    # the float64 noise-floor run (streamed from the case's own model) too
    _same(plain.capture(calibration_case(case), IDS), cpu.capture(calibration_case(case), IDS))
    a, b = plain.speculate(case, [IDS], 3, 8), cpu.speculate(case, [IDS], 3, 8)
    assert (a.num_verify, a.num_accepted, a.accepted_per_pos) == (b.num_verify, b.num_accepted, b.accepted_per_pos)


def test_a_cpu_capture_and_the_engine_info_name_the_device(tiny_case):
    engine = RefEngine(parse_spec("ref"))
    info = engine.info()
    assert (info.versions["device"], info.kernels) == ("cpu", "torch on cpu")
    assert engine.capture(load_case(str(tiny_case)), IDS).meta.device == "cpu"
    assert not any(k in info.versions for k in ("allow_tf32", "gpu"))  # recorded on CUDA only


@pytest.mark.parametrize(("value", "closest"), [("cdua", "cuda"), ("gpu", None), ("cuda:99", None), ("cpus", "cpu")])
def test_a_bad_device_value_is_refused_in_one_line_naming_the_option(value, closest):
    with pytest.raises(ConfigError) as e:
        check_settings(SCHEMA, parse_spec(f"ref[device={value}]"))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"--engines ref[device={value}]: device: expected one of cpu, cuda, cuda:0")
    if closest:
        assert message.endswith(f"did you mean {closest!r}?, got {value!r}")


def test_a_case_files_own_device_is_refused_since_the_device_is_the_workers(tiny_case, tmp_path):
    path = tmp_path / "own-device.yaml"
    path.write_text(tiny_case.read_text() + "engines:\n  ref: {device: cuda}\n")
    with pytest.raises(
        ConfigError, match=r"engines\.ref\.device: cuda, but this worker runs on cpu.*ref\[device=cuda\]"
    ):
        RefEngine(parse_spec("ref")).capture(load_case(str(path)), IDS)


@no_cuda
@pytest.mark.parametrize("value", ["cuda", "cuda:1"])
def test_device_cuda_where_torch_has_none_is_refused_when_the_worker_starts_before_any_load(value):
    with pytest.raises(EngineUnavailable) as e:
        RefEngine(parse_spec(f"ref[device={value}]"))
    assert str(e.value) == f"ref[device={value}]: torch {torch.__version__} here has no CUDA device"


@no_cuda
def test_difftest_run_with_device_cuda_and_no_cuda_ends_with_the_engine_code_in_one_line(tiny_case, tmp_path):
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "tiny.yaml").write_text(tiny_case.read_text())
    run = run_pytest(tmp_path, "cases/", "--engines=ref[device=cuda]", "-q", env={"DIFFTEST_CACHE": str(tmp_path)})
    assert run.returncode == exit_codes.ENGINE, run.output
    line = f"ref[device=cuda]: torch {torch.__version__} here has no CUDA device"
    assert line in run.output
    assert "Traceback" not in run.output


def test_the_precision_record_reads_torchs_settings_and_changes_none_of_them():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())
    record = placement.precision()
    assert (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()) == before
    assert record["allow_tf32"] == str(before[0]) and record["float32_matmul_precision"] == before[1]


@pytest.mark.parametrize(
    ("record", "on"),
    [
        ({"allow_tf32": "False", "float32_matmul_precision": "highest"}, False),
        ({"allow_tf32": "True", "float32_matmul_precision": "highest"}, True),
        ({"allow_tf32": "False", "float32_matmul_precision": "high"}, True),
        ({"allow_tf32": "False", "float32_matmul_precision": "highest", "matmul.fp32_precision": "tf32"}, True),
        ({"allow_tf32": "True", "float32_matmul_precision": "high", "NVIDIA_TF32_OVERRIDE": "0"}, False),
        ({"allow_tf32": "False", "float32_matmul_precision": "highest", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}, True),
    ],
)
def test_tf32_is_reported_on_when_a_users_setting_allows_it_and_the_driver_does_not_forbid_it(record, on):
    assert placement.tf32(record) is on


def test_captures_on_the_cpu_are_returned_as_the_very_tensors():
    tensors = {"x": torch.arange(4.0)}
    assert placement.to_host(tensors, "cpu")["x"] is tensors["x"]


def _gpu_check(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PY=sys.executable)
    if cache is not None:
        env["DIFFTEST_CACHE"] = str(cache)
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check"), *args], capture_output=True, text=True, env=env, cwd=ROOT
    )


def test_gpu_check_dry_run_lists_the_project_and_the_shipped_cases_fixtures():
    done = _gpu_check("prepare", "--dry-run")
    assert done.returncode == 0, done.stderr
    listed = done.stdout.splitlines()
    assert "project/difftest_engines/ref/engine.py" in listed
    assert "project/scripts/gpu-check" in listed
    for fixture in ("tiny-llama", "tiny-llama-eagle3", "tiny-deepseek-v3", "tiny-deepseek-v3-eagle3-mla"):
        assert f"cache/fixtures/v1/{fixture}/" in listed, fixture
    assert not any(line.startswith(("project/.venv/", "project/.git/", "project/build/")) for line in listed)
    assert {line for line in listed if line.startswith("project/reports/")} <= {"project/reports/README.md"}


def test_gpu_check_prepare_packs_one_tarball_under_50_mib_and_says_its_size(tmp_path):
    out = tmp_path / "gpu-check.tar.gz"
    done = _gpu_check("prepare", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size < 50 * 2**20
    assert f"{out}: " in done.stdout and "MiB" in done.stdout
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
    assert {"difftest-gpu-check/project/pyproject.toml", "difftest-gpu-check/MANIFEST.json"} <= names
    assert "difftest-gpu-check/cache/fixtures/v1/tiny-llama/model.safetensors" in names


def _judge(tmp_path: Path, expect: dict[str, str], outcomes: dict[str, dict[str, str]]) -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_ref", ROOT / "scripts" / "gpu_check_ref.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    report = tmp_path / "case.json"
    checks = [{"engine": e, "check": c, "outcome": o} for e, byc in outcomes.items() for c, o in byc.items()]
    report.write_text(json.dumps({"checks": checks, "engines": {}, "comparisons": {}}))
    job = {"name": "float32/case", "expect": expect}
    return module.judge({"job": job, "rc": 1, "wall_s": 1.0, "report": str(report)})


def test_gpu_check_counts_a_job_as_expected_only_when_the_twin_passes_and_the_miswiring_is_caught(tmp_path):
    ok = dict.fromkeys(("fc_inputs", "draft_logits", "top1_agreement", "accept_length"), "passed")
    caught = {**ok, "fc_inputs": "failed", "draft_logits": "failed"}
    expect = {"ref[device=cuda]": "pass", "ref[device=cuda,wiring=sglang]": "catch"}
    good = {"ref[device=cuda]": ok, "ref[device=cuda,wiring=sglang]": caught}
    assert _judge(tmp_path, expect, good)["ok"]
    missed = _judge(tmp_path, expect, {**good, "ref[device=cuda,wiring=sglang]": ok})
    assert not missed["ok"] and "fc_inputs passed (should fail)" in missed["why"]
    false_alarm = _judge(tmp_path, expect, {**good, "ref[device=cuda]": {**ok, "draft_logits": "failed"}})
    assert not false_alarm["ok"] and "ref[device=cuda]: draft_logits failed" in false_alarm["why"]


@pytest.fixture
def seen_gpu(monkeypatch):
    """torch answering as on a machine with one GPU (nothing runs on it: the info and the notes only)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: "Test GPU")


def test_the_info_on_cuda_names_the_gpu_and_the_tf32_settings_as_found(seen_gpu, monkeypatch):
    monkeypatch.delenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", raising=False)
    monkeypatch.delenv("NVIDIA_TF32_OVERRIDE", raising=False)
    info = RefEngine(parse_spec("ref[device=cuda]")).info()
    assert info.kernels == "torch on cuda:0 (Test GPU, TF32 off)"
    assert info.version.endswith("-cuda")  # never a CPU capture's cache key
    assert info.versions["device"] == "cuda:0" and info.versions["gpu"] == "Test GPU"
    assert info.versions["allow_tf32"] == str(torch.backends.cuda.matmul.allow_tf32)
    assert info.versions["float32_matmul_precision"] == torch.get_float32_matmul_precision()


def test_a_users_tf32_stays_and_the_info_and_every_capture_note_say_so(seen_gpu, monkeypatch):
    monkeypatch.setenv("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1")
    engine = RefEngine(parse_spec("ref[device=cuda:0]"))
    info = engine.info()
    assert info.version.endswith("-cuda-tf32") and "TF32 on" in info.kernels
    assert info.versions["TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"] == "1"
    assert any("may use TF32" in note for note in engine._device_notes())
    assert torch.get_float32_matmul_precision() == "highest"  # read, not set


def test_a_cuda_index_past_the_machines_devices_is_refused_naming_how_many_it_sees(seen_gpu):
    with pytest.raises(
        EngineUnavailable, match=r"ref\[device=cuda:1\]: torch .* here sees 1 CUDA device \(cuda:0..cuda:0\)"
    ):
        RefEngine(parse_spec("ref[device=cuda:1]"))
