"""An engine adapter for benchmarks/test_bench_case.py's transfer figure: its capture is one
Kimi-width logits tensor (DIFFTEST_BENCH_LOGITS, default [1024 x 163840], bfloat16), made without
any model, so that a request times the worker-to-harness transfer of a large capture alone."""

from __future__ import annotations

import os

import torch

from difftest.records.capture import Capture
from difftest.run.engine import Engine, EngineInfo


def parse_shape(text: str) -> tuple[int, int] | None:
    """ROWSxCOLS (e.g. 1024x163840) as two positive integers; None when it is not that."""
    parts = text.strip().lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def logits_shape() -> tuple[int, int]:
    """DIFFTEST_BENCH_LOGITS, checked by the benchmark before any engine starts."""
    shape = parse_shape(os.environ.get("DIFFTEST_BENCH_LOGITS", "1024x163840"))
    if shape is None:
        raise ValueError(f"DIFFTEST_BENCH_LOGITS: expected ROWSxCOLS, got {os.environ['DIFFTEST_BENCH_LOGITS']!r}")
    return shape


def synthetic_logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(*logits_shape(), generator=g).mul_(3).to(torch.bfloat16)


class SyntheticEngine(Engine):
    def __init__(self, spec):
        super().__init__(spec)
        self._logits = synthetic_logits()  # made once: a capture request times the transfer alone

    def info(self) -> EngineInfo:
        return EngineInfo(name="synthetic", version="1", versions={"torch": torch.__version__}, kernels="none")

    def capture(self, case, prompt_ids):
        return Capture({"target.logits": self._logits}, {"engine": self.spec.id, "prompt_ids": list(prompt_ids)})

    def speculate(self, case, prompts, num_steps, max_new_tokens):
        raise NotImplementedError("the synthetic engine only captures")
