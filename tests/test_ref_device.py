"""Where the reference runs: `ref[device=cpu|cuda|cuda:N]` (difftest_engines/ref/device.py).

No GPU was lent to the session that wrote these: the CUDA path is held only as far as a CPU allows
(the refusal where torch has no CUDA device, what the info records, the check script's packing);
`scripts/gpu-check run` is the check on a GPU (docs/gpu.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TINY_CASE, make_tiny_pair, run_pytest

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
        ({"allow_tf32": "False", "float32_matmul_precision": "highest", "NVIDIA_TF32_OVERRIDE": "0"}, False),
    ],
)
def test_tf32_is_reported_on_when_any_of_the_users_settings_allows_it(record, on):
    assert placement.tf32(record) is on


def test_captures_on_the_cpu_are_returned_as_the_very_tensors():
    tensors = {"x": torch.arange(4.0)}
    assert placement.to_host(tensors, "cpu")["x"] is tensors["x"]
