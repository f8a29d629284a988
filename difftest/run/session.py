"""What the pytest plugin and the CLI hold for one harness run: the engine pool
(difftest.run.pool.EnginePool) and each case's run over it (difftest.run.case_run.CaseRun), by case
path. Nothing here is global.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from difftest.case.case import Case
from difftest.run.case_run import CaseRun
from difftest.run.pool import EnginePool, Options
from difftest.run.phase_clock import PhaseClock

if TYPE_CHECKING:  # annotations only: difftest.run.baseline builds on the case runs
    from difftest.run.baseline import BaselineSource


class Session:
    def __init__(self, options: Options):
        self.pool = EnginePool(options)
        self._runs: dict[str, CaseRun] = {}

    @property
    def options(self) -> Options:
        return self.pool.options

    @property
    def clock(self) -> PhaseClock:
        return self.pool.clock

    def run(self, case: Case) -> CaseRun:
        """The case's run (one per case file, made on first use)."""
        if case.path not in self._runs:
            self._runs[case.path] = CaseRun(self.pool, case)
        return self._runs[case.path]

    def add_stored(self, source: BaselineSource) -> None:
        self.pool.add_stored(source)

    def begin_case(self, path: str) -> None:
        self.pool.begin_case(path)

    def close(self) -> None:
        self.pool.close()

    def abort(self) -> None:
        self.pool.abort()


__all__ = ["Options", "Session"]
