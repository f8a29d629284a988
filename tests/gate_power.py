"""Whether the accept gate can call a miswired export's loss a collapse: measured on the reference.

The reference serves the export as an engine does (the layers the engine's rule feeds, the flag value
it reads, no d2t), in-process, and its accept length is judged against the correctly wired draft's by
the accept_length check's own gate and numerical move (difftest.checks.checks.check_accept_length,
CaseRun.accept_noise): the same tokens where the outputs are the correct run's (the float64 reference
replayed on them), else the correct draft replayed on the miswired run's outputs with no move. An ids
or vocab export loses more than the gate allows (but DeepSeek-V3 bf16 off_by_one as vLLM serves it);
a norm flag costs these drafts 3-21% of their accept length (docs/verdict.md, stops 52 and 53), which
no gate over 30-50 verify steps calls a collapse, but on Qwen3 in float32 it does collapse. So test_noise_matrix demands "accept length collapsed" of an
engine exactly where this says the reference, serving the export the same way, collapses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import independent_models as im
import torch

from difftest.case.case import Case, load_case
from difftest.compare import accept_judge, noise
from difftest.records.acceptance import AcceptStats
from difftest.run.case_run import calibration_case, engine_case_of
from difftest.run.engine import parse_spec


@dataclass
class Power:
    collapses: bool
    why: str  # the figures: the reference serving the export, the correct draft, what the gate allows


def serving_spec(case: im.MiswiredCase, engine: str) -> str:
    """The reference spec that serves `case`'s export as `engine` does (its rule data's reading)."""
    m, spec = case.miswire, im.TARGETS[case.target]
    if m.kind == "ids":
        trained = im.training_wiring(m, spec)
        fed = im._rule(engine, spec).predict_ids(im.served_ids(m, spec, engine), spec.num_layers, len(trained)).fed
        return f"ref[wiring={im._h(fed)}]"
    if m.kind == "flag":
        return f"ref[{m.flag}=true]"  # the exports flip a flag trained false; Expect.fails: the engine reads it
    return "ref[d2t=identity]"  # the export lost d2t: the engine maps draft ids as they are


def _merge(rows, steps: int, source: str) -> AcceptStats:
    total = AcceptStats(0, 0, steps, [0] * steps, 0, source)
    for r in rows:
        total = total.merge(r.stats)
    total.source = source
    return total


class Reference:
    """The reference engines of one session, in-process, each run computed once."""

    def __init__(self):
        self._engines: dict = {}
        self._runs: dict[tuple, AcceptStats] = {}

    def _engine(self, spec: str):
        from difftest_engines.ref.engine import RefEngine

        if spec not in self._engines:
            self._engines[spec] = RefEngine(parse_spec(spec))
        return self._engines[spec]

    def _case(self, case: Case, spec: str) -> Case:
        return engine_case_of(case, parse_spec(spec))

    def speculate(self, case: Case, spec: str, prompts: list[list[int]]) -> AcceptStats:
        key = ("speculate", case.path, case.dtype, spec)
        if key not in self._runs:
            c = self._case(case, spec)
            self._runs[key] = self._engine(spec).speculate(c, prompts, c.num_steps, c.max_new_tokens)
        return self._runs[key]

    def replay(self, case: Case, spec: str, prompts: list[list[int]], outputs: list[list[int]]) -> tuple:
        key = ("replay", case.path, case.dtype, spec, str(outputs))
        if key not in self._runs:
            c = self._case(case, spec)
            k = c.num_steps
            rows = self._engine(spec).replay(c, list(zip(prompts, outputs)), k, 1, k + 1)
            self._runs[key] = (_merge(rows, k, f"{spec} replay"), rows)
        return self._runs[key]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread for the block: tiny matmuls on two threads of a shared 2-core machine ran 7x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_collapses(case: im.MiswiredCase, engine: str, ref: Reference) -> Power:
    """Whether the reference serving `case`'s export as `engine` does fails the accept gate as a collapse."""
    with one_thread():
        return _judge(case, engine, ref)


def _judge(case: im.MiswiredCase, engine: str, ref: Reference) -> Power:
    loaded = load_case(str(Path(case.path)))
    _, prompts = im.prompts(im.TARGETS[case.target])
    serving = serving_spec(case, engine)
    correct = ref.speculate(loaded, "ref", prompts)
    served = ref.speculate(loaded, serving, prompts)
    how = "same tokens"
    if served.outputs != correct.outputs:  # judged as the check judges an engine whose outputs differ
        against, rows = ref.replay(loaded, "ref", prompts, served.outputs)
        how = "trajectory"
        if all(r.target_mismatches <= 1 for r in rows):
            correct, how = against, "on the miswired run's own tokens, no float64 move"
    gate = accept_judge.judge(correct, served)
    if not gate.ok and loaded.dtype != noise.CALIBRATION_DTYPE and how in ("same tokens", "trajectory"):
        exact = calibration_case(loaded)
        if how == "same tokens":
            moved, _ = ref.replay(exact, "ref", prompts, correct.outputs)
            how = "the float64 move on the same tokens"
        else:
            moved, how = ref.speculate(exact, "ref", prompts), "the float64 move over its own trajectory"
        gate = accept_judge.judge(correct, served, (correct, moved))
    why = (
        f"{serving} accepts {served.accept_length:.3f} against the correct draft's {correct.accept_length:.3f} "
        f"({how}): the gate allows {gate.allowed_accept:.3f}"
    )
    return Power(gate.collapsed, why)
