"""Captures travel from an engine's worker to the harness without copies (difftest.base.tensorfile):
the worker writes the tensors from their memory, the harness maps the file. Content, dtypes and
shapes arrive unchanged; nothing half-written stays behind when a worker dies writing; each phase
of the transfer is timed (difftest.run.phase_clock)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from difftest.base import tensorfile
from difftest.records.capture import Capture, partial_prefix, remove_partial
from difftest.case.case import Case
from difftest.run.engine import EngineSpec
from difftest.base.errors import ConfigError, EngineError
from difftest.run.pool import EnginePool, Options
from difftest.run.protocol import CaptureRequest
from difftest.run.worker import WorkerClient
from fake_engine import synthetic_tensors
from helpers import TESTS


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b) or sorted(a) == sorted(b)
    for name, t in a.items():
        assert (b[name].dtype, tuple(b[name].shape)) == (t.dtype, tuple(t.shape)), name
        assert torch.equal(b[name], t), name


def test_a_written_tensor_file_reads_back_identical_in_content_dtype_and_shape(tmp_path):
    tensors = {**synthetic_tensors(), "strided": torch.arange(12.0).reshape(3, 4).t()}
    tensorfile.write(tmp_path / "t.safetensors", tensors)
    same(tensors, tensorfile.read(tmp_path / "t.safetensors"))


def test_safetensors_reads_what_tensorfile_writes_and_the_other_way(tmp_path):
    tensors = synthetic_tensors()
    tensorfile.write(tmp_path / "ours.safetensors", tensors)
    same(tensors, safetensors.torch.load_file(str(tmp_path / "ours.safetensors")))
    safetensors.torch.save_file(tensors, str(tmp_path / "theirs.safetensors"))
    same(tensors, tensorfile.read(tmp_path / "theirs.safetensors"))


def _mapping_of(ptr: int) -> str | None:
    """The file a process address lies in, from /proc/self/maps (None: anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= ptr < hi:
            return fields[5] if len(fields) == 6 else None
    return None


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_a_read_tensor_is_a_view_of_the_mapped_file_not_a_copy(tmp_path):
    path = tmp_path / "t.safetensors"
    tensorfile.write(path, {"logits": torch.randn(64, 1024).to(torch.bfloat16)})
    t = tensorfile.read(path)["logits"]
    assert _mapping_of(t.data_ptr()) == str(path)
    assert _mapping_of(tensorfile.read(path, mapped=False)["logits"].data_ptr()) != str(path)


def test_changing_a_read_tensor_in_place_leaves_the_file_as_written(tmp_path):
    path = tmp_path / "t.safetensors"
    tensorfile.write(path, {"x": torch.zeros(4, 4)})
    tensorfile.read(path)["x"].add_(1)
    assert torch.equal(tensorfile.read(path)["x"], torch.zeros(4, 4))


def test_where_the_file_cannot_be_mapped_it_is_read_into_memory(tmp_path, monkeypatch):
    tensors = synthetic_tensors()
    tensorfile.write(tmp_path / "t.safetensors", tensors)

    def no_mmap(*args, **kwargs):
        raise OSError(19, "No such device")

    monkeypatch.setattr(mmap, "mmap", no_mmap)
    same(tensors, tensorfile.read(tmp_path / "t.safetensors"))


@pytest.mark.parametrize(
    "damage",
    [lambda b: b[: len(b) // 2], lambda b: b[:5], lambda b: b"\xff" * 8 + b[8:]],
    ids=["truncated", "no header", "header length beyond the file"],
)
def test_a_damaged_tensor_file_is_one_line_naming_it(tmp_path, damage):
    path = tmp_path / "t.safetensors"
    tensorfile.write(path, {"x": torch.randn(16, 16)})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ConfigError, match=f"^{path}: .*(damaged|not a tensor file)"):
        tensorfile.read(path)


def test_what_a_dead_writer_left_is_removed_and_what_a_running_one_writes_is_kept(tmp_path):
    final = tmp_path / "cap"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f".cap.{int(dead.stdout)}.abc123"
    left.mkdir()
    (left / "tensors.safetensors").write_bytes(b"half")
    mine = tmp_path / (partial_prefix(final) + "fc_in.safetensors")
    mine.write_bytes(b"being written")
    other = tmp_path / ".capital.1.x"  # another entry's: not touched
    other.mkdir()
    assert remove_partial(final) == [left]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])


def _worker(tmp_path: Path, mode: str) -> WorkerClient:
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    client = WorkerClient(
        EngineSpec("fake", params=(("mode", mode),)),
        "fake_engine:FakeEngine",
        sys.executable,
        tmp_path / "worker.log",
        timeout=300,
        env=env,
    )
    client.start()
    return client


def _capture_request(out: Path) -> CaptureRequest:
    return CaptureRequest(Case(name="x", path="x.yaml", target="t", draft="d"), [1, 2], str(out))


def _pool(tmp_path: Path) -> EnginePool:
    spec = EngineSpec("fake")
    return EnginePool(Options(engines=[spec], reference=spec, log_dir=tmp_path / "logs"))


def test_a_capture_crosses_from_the_worker_to_the_harness_unchanged_and_timed(tmp_path):
    pool, client = _pool(tmp_path), _worker(tmp_path, "synthetic")
    out = tmp_path / "cache" / "ab" / "abkey"
    try:
        with pool.clock.phase("session", "x.yaml", "fake", "float32"):
            pool.request(client, _capture_request(out), out)
            capture = pool.load(out)
    finally:
        client.close()
    same(synthetic_tensors(), capture.tensors)
    assert sorted(p.name for p in out.parent.iterdir()) == ["abkey"]
    phases = {p.phase: p for p in pool.clock.timings("x.yaml").phases}
    assert set(phases) == {"session", "request", "engine.capture", "transfer.write", "transfer.read"}
    assert phases["transfer.write"].bytes == phases["transfer.read"].bytes == Capture(synthetic_tensors()).nbytes > 0
    assert phases["engine.capture"].owner == "engine" and phases["transfer.write"].owner == "harness"


def test_a_worker_killed_while_writing_a_capture_leaves_nothing_half_written(tmp_path):
    pool, client = _pool(tmp_path), _worker(tmp_path, "crash_writing")
    out = tmp_path / "cache" / "ab" / "abkey"
    try:
        with pytest.raises(EngineError, match="worker died"):
            pool.request(client, _capture_request(out), out)
    finally:
        client.kill()
    assert list(out.parent.iterdir()) == []


def test_phases_nest_each_counting_only_its_own_time():
    from difftest.records.timings import WorkerPhase
    from difftest.run.phase_clock import PhaseClock

    clock = PhaseClock()
    with clock.phase("session", "c.yaml#float64", "ref", "float64"):
        with clock.phase("request"):
            clock.add_inner([WorkerPhase("engine.capture", 5.0), WorkerPhase("transfer.write", 1.0, 100)])
    t = clock.timings("c.yaml")
    by = {p.phase: p for p in t.phases}
    assert by["request"].seconds == 0.0  # the worker's 6 s are not the request's own
    assert (by["engine.capture"].seconds, by["transfer.write"].bytes, by["engine.capture"].dtype) == (
        5.0,
        100,
        "float64",
    )
    assert (t.engine_seconds, round(t.harness_seconds)) == (5.0, 1)
