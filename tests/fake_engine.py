"""A fake engine for the harness's own tests: injects divergence, errors, crashes and hangs.

Registered through DIFFTEST_ENGINES="fake=fake_engine:FakeEngine" (tests/ on PYTHONPATH);
behaviour comes from the spec, e.g. `fake[mode=hang]`:
  mode=same         the reference engine's capture, unchanged
  mode=diverge      as `same`, with draft.logits perturbed at one element
  mode=unavailable  info() raises EngineUnavailable with a setup command
  mode=error        capture raises an ordinary exception (an engine bug)
  mode=crash        the worker process dies with SIGKILL mid-request
  mode=spent        capture raises EngineSpent (an engine that cannot start again in this process)
  mode=hang         capture never returns
  mode=wrong_type   capture returns a dict of tensors instead of a Capture (an adapter bug)
  mode=spawn_hang   capture starts a child process (as engines start schedulers), logs
                    "child pid N" and never returns
  mode=synthetic    a capture of fixed seeded tensors (synthetic_tensors), no model loaded: what
                    a transfer between worker and harness must deliver unchanged
  mode=crash_writing  as `synthetic`, and the worker dies with SIGKILL half-way through writing it
  golden=no         (any mode) no golden-input re-run: Engine.capture_draft_from's default
  release=N==V      (any mode) info() answers as engine N at release V (e.g. sglang==0.5.24)
"""

import os
import signal
import subprocess
import sys
import time

import torch

from difftest.base import tensorfile
from difftest.records.capture import Capture
from difftest.run.engine import Engine, EngineInfo
from difftest.base.errors import EngineSpent, EngineUnavailable
from difftest.base.settings import Schema, Setting
from difftest_engines.ref.engine import RefEngine
from difftest_engines.ref.settings import SCHEMA as REF_SETTINGS


def synthetic_tensors() -> dict[str, torch.Tensor]:
    """Seeded tensors of every kind a capture holds (widths, dtypes, an empty and a 0-d one)."""
    g = torch.Generator().manual_seed(29)
    return {
        "target.h.0": torch.randn(5, 8, generator=g).to(torch.bfloat16),
        "target.logits": torch.randn(5, 33, generator=g).to(torch.float16),
        "draft.fc_in": torch.randn(5, 24, generator=g),
        "draft.logits": torch.randn(3, 33, generator=g, dtype=torch.float64),
        "draft.tokens": torch.randint(0, 33, (3,), generator=g),
        "draft.mask": torch.tensor([True, False, True]),
        "draft.empty": torch.zeros(0, 8),
        "draft.scalar": torch.tensor(2.5),
    }


def _write_half_then_die(path, tensors):
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class FakeEngine(RefEngine):
    SETTINGS = Schema(
        "fake",
        REF_SETTINGS.settings
        + (
            Setting(
                "mode",
                "choice",
                "injected behaviour",
                default="same",
                choices=(
                    "same",
                    "diverge",
                    "unavailable",
                    "error",
                    "crash",
                    "spent",
                    "hang",
                    "spawn_hang",
                    "wrong_type",
                    "synthetic",
                    "crash_writing",
                ),
            ),
            Setting("golden", "choice", "no: no golden-input re-run", choices=("no",)),
            Setting("release", "str", "NAME==VERSION: answer as that engine release (one outside the supported range)"),
        ),
    )

    def info(self) -> EngineInfo:
        if self.spec.param("mode") == "unavailable":
            raise EngineUnavailable("fake: not installed; set it up with: scripts/setup-engine fake")
        if self.spec.param("release"):
            name, _, version = self.spec.param("release").partition("==")
            return EngineInfo(name=name, version=version, versions={}, kernels="none")
        return EngineInfo(name="fake", version="fake-1", versions={}, kernels="none")

    def capture(self, case, prompt_ids):
        mode = self.settings_for(case).mode or "same"  # the spec's parameter, else the case's section
        if mode == "error":
            raise RuntimeError("fake engine exploded\nsecond line that must not appear")
        if mode == "crash":
            print("fatal: simulated scheduler crash", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "spent":
            raise EngineSpent("fake: engine failed to start: ValueError: no model_type in config.json")
        if mode == "hang":
            time.sleep(3600)
        if mode in ("synthetic", "crash_writing"):
            if mode == "crash_writing":
                tensorfile.write = _write_half_then_die  # this worker's next capture file is its last
            return Capture(synthetic_tensors(), {"engine": self.spec.id, "prompt_ids": list(prompt_ids)})
        if mode == "wrong_type":
            return dict(super().capture(case, prompt_ids).tensors)
        if mode == "spawn_hang":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
            print(f"child pid {child.pid}", flush=True)
            time.sleep(3600)
        cap = super().capture(case, prompt_ids)
        cap.meta.engine = self.spec.id
        if mode == "diverge":
            cap.tensors["draft.logits"] = cap.tensors["draft.logits"].clone()
            cap.tensors["draft.logits"][1, 7] += 0.5
        return cap

    def capture_draft_from(self, case, prompt_ids, fc_in):
        if self.spec.param("golden") == "no":
            return Engine.capture_draft_from(self, case, prompt_ids, fc_in)
        return super().capture_draft_from(case, prompt_ids, fc_in)
