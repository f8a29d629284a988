"""Timings: where a case's time went, by phase (difftest.run.phase_clock measures them), in its report.

Each phase's time is its own: a phase that contains others (a capture request contains the
worker's capture and the write of its file) counts only what the contained ones do not, so the
phases of a case add up to the time the harness spent on it, and `harness_seconds` against
`engine_seconds` is the harness's own share of that time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from difftest.records.fields import CHOICES

OWNERS = ("harness", "engine")


@dataclass
class WorkerPhase:
    """A phase the engine's worker measured itself, sent back in its reply (difftest.run.worker)."""

    phase: str
    seconds: float
    bytes: int = 0


@dataclass
class PhaseTime:
    """One phase of a case on one engine in one dtype, summed over its occurrences."""

    phase: str  # a name of difftest.run.phase_clock.PHASES
    owner: str = field(metadata={CHOICES: OWNERS})  # whose work it is: the harness's or the engine's
    seconds: float  # its own time (the phases inside it excluded)
    count: int  # how many times it ran
    engine: str | None = None  # the engine spec id it ran for, where one
    dtype: str | None = None  # the dtype of the case it ran for (float64: the noise floor's calibration)
    bytes: int = 0  # bytes moved (transfers)


@dataclass
class Timings:
    phases: list[PhaseTime]
    harness_seconds: float  # the phases the harness owns, summed
    engine_seconds: float  # the phases the engines own, summed
    # what the figures leave out: the report's own writing, pytest's collection, a worker's exit
    scope: str = ""
