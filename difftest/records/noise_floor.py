"""NoiseFloorRecord: a case's noise floor as its report keeps it (`noise_floor` of the report JSON),
and TensorFloor, one tensor's measured floor.

difftest.compare.noise measures the floor (NoiseFloor, which judges with it) and writes it as this record;
the report, the HTML and `difftest report` read it back by field. Its JSON is the one
NoiseFloor.to_dict wrote before the record existed: a floor that could not be computed has no
`router_noise` and no `constants`, and an `error`; a computed one has no `error`.

Report schema 3 added `router_margin_noise` and to each TensorFloor the rows captured (`total_rows`), whether the floor counts
as measured on the rows it stands on (`measured`) and, where it does not, why (`source`); a schema-2
report's floors read back with total_rows None ("not recorded"), measured True and no source.
Report schema 4 added `declared`: the floor each engine the case declares a matmul precision for
(`precision: {ENGINE: tf32|bf16}`) is judged against instead (difftest.run.case_run.CaseRun.noise_floor_for);
absent where the case declares none, and in older reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from difftest.records.fields import encode_fields


@dataclass
class TensorFloor:
    name: str
    floor: float  # FLOOR_QUANTILE of the reference's own per-row error against float64
    max: float  # the largest such row error
    rows: int  # rows the floor stands on (rows after a discrete event left out; the draft's own rows added)
    threshold: float  # SAFETY * max(floor, unit roundoff); where not measured, the fallback (`source`)
    total_rows: int | None = None  # rows captured (the draft's own included), events too; None: not recorded (schema 2)
    measured: bool = True  # False: too few rows (difftest.compare.noise.MIN_FLOOR_ROWS), `source` says how it fell back
    source: str = ""  # "" where measured; else "measured on N rows (too few; ...)"

    def to_dict(self) -> dict:
        return encode_fields(self, omit_none=("total_rows",))


@dataclass
class DeclaredFloor:
    """The floor one engine is judged against because the case declares the matmul format it serves in."""

    engine: str  # its spec id
    precision: str  # the declared format (tf32, bf16)
    measured: bool
    source: str  # how that floor was obtained ("measured: ref[matmul=tf32] in float32 vs float64 ..."), or why not


@dataclass
class NoiseFloorRecord:
    dtype: str | None
    measured: bool
    source: str  # one line: how the floor was obtained, or why it was not
    excluded: list[str] = field(default_factory=list)  # "prompt 2: steps >= 2 (float64 drafted another token)"
    router_noise: dict[str, float] | None = None  # MoE layer k -> score noise; None: not computed
    tensors: dict[str, TensorFloor] = field(default_factory=dict)
    constants: dict[str, float] | None = None  # difftest.compare.noise's settings the floor was judged with
    error: str | None = None  # why it could not be computed (the exception, every line)
    # MoE layer k -> routing-margin noise (report schema 3); None: not measured (no run recorded its experts)
    router_margin_noise: dict[str, float] | None = None
    # the declared-precision floors, by engine (report schema 4); None: the case declares no precision
    declared: list[DeclaredFloor] | None = None

    def to_dict(self) -> dict:
        return encode_fields(self, omit_none=("router_noise", "constants", "error", "router_margin_noise", "declared"))
