"""SGLang's forward hooks (difftest_engines/sglang/hooks.py) record only while the adapter captures: their
directory exists for a capture's generation alone, and every other forward (a speculative run's
hundreds) neither writes nor computes anything. The hooks' records themselves are checked on the
real engine (tests/test_engine_sglang.py, the shipped run)."""

from __future__ import annotations

import importlib

import pytest

from difftest_engines.sglang import hooks


class Untouchable:
    """A module, input or output a hook must not look at: any attribute or index read fails."""

    def __getattr__(self, name):
        raise AssertionError(f"a hook read .{name} while not recording")

    def __getitem__(self, key):
        raise AssertionError(f"a hook read [{key!r}] while not recording")


RECORDING = [spec for spec in hooks.hook_specs("unused") if spec["name"] != "difftest-golden"]


def _hook(spec: dict, out_dir: str):
    module, factory = spec["hook_factory"].split(":")
    return getattr(importlib.import_module(module), factory)({"out_dir": out_dir})


@pytest.mark.parametrize("spec", RECORDING, ids=[s["name"] for s in RECORDING])
def test_a_hook_outside_a_capture_reads_nothing_and_writes_nothing(spec, tmp_path):
    out_dir = tmp_path / "hooks"
    hook = _hook(spec, str(out_dir))
    assert hook(Untouchable(), (Untouchable(), Untouchable(), Untouchable(), Untouchable()), Untouchable()) is None
    assert list(tmp_path.iterdir()) == []


def test_recording_follows_the_directory_the_adapter_makes_for_a_capture(tmp_path):
    config = {"out_dir": str(tmp_path / "hooks")}
    assert not hooks.recording(config)
    (tmp_path / "hooks").mkdir()
    assert hooks.recording(config)


def test_every_hook_but_the_golden_input_is_gated():
    """The golden hook replaces the target's aux states when a golden file waits beside the records
    (capture_draft_from); every other spec only records."""
    names = {s["name"] for s in hooks.hook_specs("unused")}
    assert names - {s["name"] for s in RECORDING} == {"difftest-golden"}
    assert len(RECORDING) == 9
