"""Floor 2, typed records for what difftest writes and reads back: capture meta, check results with their
per-check data, and the case report. Each is a plain dataclass with a JSON round trip
(`to_dict` / `from_dict`), a `schema_version` in its JSON, and validation on load that refuses an
unknown, missing or wrong-typed field in one line naming the file and the field
(difftest.records.fields)."""

from difftest.records.check_data import (
    AcceptLengthData,
    CaptureData,
    CheckData,
    ComparisonData,
    FixData,
    GoldenData,
    LintData,
    ReplayRow,
    ServerAcceptData,
    Top1Data,
)
from difftest.records.check_result import CheckResult, ExpectedFailureRecord
from difftest.records.engine_info import EngineInfo, StoredBaseline
from difftest.base.fc_wiring import Wiring  # CaptureMeta.wiring; in the base so rule data can build it
from difftest.records.meta import CaptureMeta
from difftest.records.noise_floor import NoiseFloorRecord, TensorFloor
from difftest.records.report import EngineEntry, PromptComparison, Report
from difftest.records.tensor_diff import TensorDiff, TensorStatus

__all__ = [
    "AcceptLengthData",
    "CaptureData",
    "CaptureMeta",
    "CheckData",
    "CheckResult",
    "ComparisonData",
    "EngineEntry",
    "EngineInfo",
    "ExpectedFailureRecord",
    "FixData",
    "GoldenData",
    "LintData",
    "NoiseFloorRecord",
    "PromptComparison",
    "ReplayRow",
    "Report",
    "ServerAcceptData",
    "StoredBaseline",
    "TensorDiff",
    "TensorFloor",
    "TensorStatus",
    "Top1Data",
    "Wiring",
]
