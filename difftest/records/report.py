"""Report: one case's run, the JSON in reports/ that the Markdown, the HTML, the session summary,
`difftest report` and `difftest bundle` are rendered from (difftest.report.writer writes it).

Schema versions: `schema` names the kind of file ("difftest.report"), `schema_version` its layout.
2: typed check data with a `kind`. 3 is this record: each prompt comparison's per-MoE-layer routing
(`routing`, difftest.records.routing) and each noise-floor tensor's row counts and whether it counts as
measured (difftest.records.noise_floor). 4: the memory plan the run followed (`memory_plan`,
difftest.records.memory_plan) and the noise floor's declared-precision floors (`noise_floor.declared`). Versions 2 and 3 are still read (the later fields absent: no routing
recorded, row counts "not recorded", no memory plan recorded). A report without `schema_version` is version 1,
written before typed records: it is refused, naming the version and the command that writes it
again (its `reproduce` line), rather than read with its untyped check data guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from difftest.base.jsonfile import read_json
from difftest.records.check_result import CheckResult
from difftest.records.engine_info import EngineInfo
from difftest.records.fields import decode, encode_fields, fail
from difftest.records.memory_plan import MemoryPlanRecord
from difftest.records.noise_floor import NoiseFloorRecord
from difftest.records.routing import RoutingLayer
from difftest.records.tensor_diff import TensorDiff
from difftest.records.wiring_inference import WiringInference
from difftest.records.timings import Timings

SCHEMA = "difftest.report"
SCHEMA_VERSION = 4
READABLE_VERSIONS = (2, 3, 4)  # 2 and 3 lack only fields that have defaults (module docstring)
LEGACY_SCHEMA = "difftest.report/1"  # version 1 named its version in `schema` and had no schema_version
# what each version added: a report of an older readable version shows these as not recorded
ADDED_IN = {
    3: "the per-MoE-layer routing and the noise floor's row counts",
    4: "the memory plan and the declared-precision floors",
}


def older_version_note(data: object) -> str | None:
    """One line for a report of an older readable version (read, never refused): its version, what it
    lacks (shown as not recorded), and the command that writes it at this version; None for a current
    one. Reading it silently would let a reader take an absent memory plan or routing for none."""
    if not isinstance(data, dict):
        return None
    version = data.get("schema_version")
    if not isinstance(version, int) or version not in READABLE_VERSIONS or version >= SCHEMA_VERSION:
        return None
    lacks = "; ".join(what for since, what in ADDED_IN.items() if since > version)
    again = f"; `{data['reproduce']}` writes it again" if isinstance(data.get("reproduce"), str) else ""
    return (
        f"report schema version {version} (this difftest writes {SCHEMA_VERSION}): not recorded in it: {lacks}{again}"
    )


@dataclass
class EngineEntry:
    """An engine of the run: what it reported about itself, or why it did not start."""

    info: EngineInfo | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        return encode_fields(self, omit_none=("info", "error"))


@dataclass
class PromptComparison:
    """One prompt's tensor comparison against the reference (difftest.compare.compare.CaptureDiff)."""

    prompt: int
    first_divergence: str | None  # where the error is introduced, else the first tensor above noise
    first_introduced: str | None
    first_above_noise: str | None
    first_differs: str | None
    tie: str  # the draft steps left out at a tie, or ""
    tensors: list[TensorDiff]  # in data-flow order
    routing: list[RoutingLayer] = field(default_factory=list)  # per MoE layer; empty: no MoE router recorded


@dataclass
class FigureDefinition:
    """What one figure of the report counts and how the engines' own figures convert to it
    (difftest.base.definitions)."""

    name: str
    counts: str
    converts: str


@dataclass
class Report:
    case: str
    case_file: str
    created: str
    reference: str  # the reference engine's spec id
    accept_length_definition: str
    engines: dict[str, EngineEntry]  # by spec id, the reference included
    checks: list[CheckResult]
    noise_floor: NoiseFloorRecord | None = None  # None: nothing compared
    wiring_inference: WiringInference | None = None  # `wiring: infer` cases (difftest.run.infer_case)
    comparisons: dict[str, list[PromptComparison]] = field(default_factory=dict)  # by engine spec id
    environment: dict[str, object] = field(
        default_factory=dict
    )  # the harness side (difftest.report.writer.environment)
    reproduce: str = ""
    case_yaml: str = ""
    interrupted: bool = False
    definitions: list[FigureDefinition] = field(
        default_factory=list
    )  # every figure the report shows  # the run stopped before every check of the case ran
    timings: Timings | None = None  # where the case's time went, by phase (difftest.run.phase_clock)
    memory_plan: MemoryPlanRecord | None = None  # schema 4; None: not recorded (older report, or no worker asked for)

    def results(self, engine: str, check: str | None = None) -> list[CheckResult]:
        return [c for c in self.checks if c.engine == engine and (check is None or c.check == check)]

    def result(self, engine: str, check: str) -> CheckResult | None:
        return next(iter(self.results(engine, check)), None)

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **encode_fields(self)}

    @classmethod
    def from_dict(cls, data: object, where: str) -> "Report":
        if not isinstance(data, dict):
            raise fail(where, "", f"not a difftest report (a JSON {type(data).__name__}, expected an object)")
        schema, version = data.get("schema"), data.get("schema_version")
        if schema == LEGACY_SCHEMA and version is None:
            again = f": write it again with `{data['reproduce']}`" if isinstance(data.get("reproduce"), str) else ""
            raise fail(
                where,
                "schema_version",
                f"report schema version 1 ({LEGACY_SCHEMA}, before typed records); "
                f"this difftest reads version {SCHEMA_VERSION}{again}",
            )
        if schema != SCHEMA:
            raise fail(where, "schema", f"{schema!r}, expected {SCHEMA!r}")
        if version not in READABLE_VERSIONS:
            problem = (
                "field missing"
                if version is None
                else f"report schema version {version!r}; this difftest reads {SCHEMA_VERSION}"
            )
            raise fail(where, "schema_version", problem)
        return decode(cls, data, where, skip=("schema", "schema_version"))

    @classmethod
    def load(cls, path: str | Path) -> "Report":
        """A report file, validated: a missing, malformed or incomplete one is one line naming it."""
        return cls.load_noting(path)[0]

    @classmethod
    def load_noting(cls, path: str | Path) -> tuple["Report", str | None]:
        """As load, with older_version_note's line for the file (None: current)."""
        data = read_json(path, "difftest report")
        return cls.from_dict(data, str(path)), older_version_note(data)
