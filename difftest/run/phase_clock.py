"""A phase clock: where a case's time goes (engine start, capture, transfer, compare, report), so the
harness's own share of a case's time is known. The session times its steps with it, the worker
sends the phases it measured in its replies, and each case's report holds the result
(difftest.records.timings).

Phases nest: the time of a phase excludes the phases opened inside it, so a case's phases add up
to the time spent on it without counting anything twice. A phase without a case of its own (an
engine started by the first capture that needs it) belongs to the case of the phase it runs in.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from difftest.records.timings import PhaseTime, Timings, WorkerPhase

# name -> (owner, what it counts): declared once, read by the report and docs/benchmarks.md
PHASES: dict[str, tuple[str, str]] = {
    "collect": ("harness", "a case file collected: read, checked against the engines' settings"),
    "engine.start": (
        "engine",
        "a worker's interpreter start, its imports and the adapter's set-up (the hello request)",
    ),
    "engine.capture": ("engine", "the adapter's capture in the worker: models loaded on first use, forward passes"),
    "engine.speculate": ("engine", "the adapter's speculative decoding in the worker"),
    "engine.replay": ("engine", "the adapter's replay of another engine's tokens in the worker"),
    "transfer.write": (
        "harness",
        "a capture's tensors written to their file (by the worker; the golden fc_in by the harness)",
    ),
    "transfer.read": ("harness", "a capture file mapped into the reading process, its manifest read"),
    "request": ("harness", "a worker request less the worker's own phases: JSON over the pipes, waiting"),
    "session": (
        "harness",
        "the session's own steps around requests: fixtures, prompts, cache keys (checkpoint digests), cache look-ups",
    ),
    "compare": ("harness", "a capture compared with the reference's"),
    "noise_floor": ("harness", "the noise floor computed from the reference's captures and their float64 twins"),
    "check": ("harness", "a check's own logic, outside the phases above"),
    "report": ("harness", "the case's report built (its writing is not in it)"),
}
SCOPE = (
    "the phases the harness timed for this case; not in them: the report's writing, pytest's own work, workers' exits"
)


def owner(phase: str) -> str:
    return PHASES[phase][0]


def case_of(path: str) -> str:
    """The case a path belongs to: the noise floor's float64 twin (`PATH#float64`) is its case's."""
    return path.split("#", 1)[0]


@dataclass
class _Frame:
    phase: str
    case: str | None
    engine: str | None
    dtype: str | None
    start: float
    inner: float = 0.0  # time of the phases opened inside this one
    bytes: int = 0


class PhaseClock:
    """Per case, per (phase, engine, dtype): own seconds, count and bytes."""

    def __init__(self) -> None:
        self._open: list[_Frame] = []
        self._totals: dict[tuple[str | None, str, str | None, str | None], list] = {}
        self.current_case: str | None = None  # the case a phase outside any other belongs to

    @contextmanager
    def phase(
        self, name: str, case: str | None = None, engine: str | None = None, dtype: str | None = None
    ) -> Iterator[_Frame]:
        """Time a phase; the case, engine and dtype default to the enclosing phase's. The frame it
        yields takes the bytes the phase moved (`frame.bytes = n`)."""
        if name not in PHASES:
            raise KeyError(f"difftest.run.phase_clock: unknown phase {name!r}")  # a harness bug
        outer = self._open[-1] if self._open else None
        frame = _Frame(
            name,
            case_of(case) if case else (outer.case if outer else self.current_case),
            engine or (outer.engine if outer else None),
            dtype or (outer.dtype if outer else None),
            time.perf_counter(),
        )
        self._open.append(frame)
        try:
            yield frame
        finally:
            self._open.pop()
            elapsed = time.perf_counter() - frame.start
            self._add(frame, max(elapsed - frame.inner, 0.0), frame.bytes)
            if outer is not None:
                outer.inner += elapsed

    def add_inner(self, measured: list[WorkerPhase]) -> None:
        """Phases measured elsewhere (by the worker) while the innermost open phase waited on them."""
        outer = self._open[-1] if self._open else None
        for p in measured:
            if p.phase not in PHASES:
                continue  # a worker of another difftest version: its phase is not ours to name
            case = (outer.case if outer is not None else None) or self.current_case
            engine, dtype = (outer.engine, outer.dtype) if outer is not None else (None, None)
            self._add(_Frame(p.phase, case, engine, dtype, 0.0), p.seconds, p.bytes)
            if outer is not None:
                outer.inner += p.seconds

    def _add(self, frame: _Frame, seconds: float, nbytes: int) -> None:
        entry = self._totals.setdefault((frame.case, frame.phase, frame.engine, frame.dtype), [0.0, 0, 0])
        entry[0] += seconds
        entry[1] += 1
        entry[2] += nbytes

    def timings(self, case: str) -> Timings:
        """The phases of `case` (a case path), in the order PHASES declares them."""
        rank = {name: i for i, name in enumerate(PHASES)}
        rows = sorted(
            ((k, v) for k, v in self._totals.items() if k[0] == case_of(case)),
            key=lambda kv: (rank[kv[0][1]], kv[0][2] or "", kv[0][3] or ""),
        )
        phases = [
            PhaseTime(phase, owner(phase), round(s, 6), n, engine, dtype, b)
            for (_, phase, engine, dtype), (s, n, b) in rows
        ]
        total = lambda who: round(sum(p.seconds for p in phases if p.owner == who), 6)  # noqa: E731
        return Timings(phases, total("harness"), total("engine"), SCOPE)
