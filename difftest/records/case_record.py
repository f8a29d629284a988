"""CaseRecord: everything one case's run measured that its report shows, gathered once the checks
ran (difftest.run.case_run.CaseRun.record). difftest.report.writer.build turns it into the Report
without asking any engine, so a live run, `difftest report` and `difftest bundle` render the same
thing by construction; a record read back from JSON (CaseRecord.from_dict) builds the same report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from difftest.records.check_result import CheckResult
from difftest.records.fields import decode, encode_fields
from difftest.records.memory_plan import MemoryPlanRecord
from difftest.records.noise_floor import NoiseFloorRecord
from difftest.records.report import EngineEntry, PromptComparison
from difftest.records.timings import Timings
from difftest.records.wiring_inference import WiringInference


@dataclass
class CaseRecord:
    case: str  # the case's name
    case_file: str  # its path (report file names and the reproduce command)
    case_yaml: str  # the case file's text as the run read it (or why it could not be read)
    reference: str  # the reference engine's spec id
    engine_ids: list[str]  # the run's engines in --engines order (the reproduce command)
    engines: dict[str, EngineEntry]  # by spec id: what each said about itself, or why it did not start
    checks: list[CheckResult]
    comparisons: dict[str, list[PromptComparison]] = field(default_factory=dict)  # by engine spec id
    noise_floor: NoiseFloorRecord | None = None  # None: nothing compared
    wiring_inference: WiringInference | None = None  # `wiring: infer` cases (difftest.run.infer_case)
    timings: Timings | None = None  # where the case's time went, by phase (difftest.run.phase_clock)
    memory_plan: MemoryPlanRecord | None = None  # the plan the pool followed (difftest.run.pool.EnginePool.plan_record)

    def to_dict(self) -> dict:
        return encode_fields(self)

    @classmethod
    def from_dict(cls, data: object, where: str) -> CaseRecord:
        return decode(cls, data, where)


__all__ = ["CaseRecord"]
