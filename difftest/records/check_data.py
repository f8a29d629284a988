"""What each check records beside its message: one record per kind of check, tagged with `kind`.

A check returns one of these in its Verdict; the report stores it as `checks[i].data` with
`"kind": KIND` first, and reading a report picks the class by that tag (an unknown kind is
refused, naming the closest). Checks engines contribute (difftest.base.check_registry.CheckSpec) declare
their own record there as `data`, e.g. the training-data engine's `train_accuracy`.

Nested records other modules define (AcceptStats, lint Findings, fc ChunkMatches) are read back as
those dataclasses, in the form their own to_dict gives them.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import ClassVar

from difftest.base import check_registry
from difftest.records.accept_gate import AcceptGate, PositionJudgement
from difftest.records.acceptance import AcceptStats
from difftest.records.chunk_match import ChunkMatch, Similarity
from difftest.records.finding import Finding
from difftest.records.wiring_inference import WiringInference
from difftest.records.fields import READER, decode, encode_fields, fail, join, kind_of, reader_without_properties


@dataclass
class CheckData:
    """Base of the per-check records: `kind` names the record in JSON."""

    KIND: ClassVar[str] = ""

    @property
    def kind(self) -> str:
        return self.KIND

    def to_dict(self) -> dict:
        return {"kind": self.KIND, **encode_fields(self)}

    @classmethod
    def from_json(cls, data: object, where: str, at: str) -> "CheckData":
        return decode(cls, data, where, at, skip=("kind",))


_accept_stats = reader_without_properties(AcceptStats)
_chunk_match = reader_without_properties(ChunkMatch)
_POSITION_DERIVED = {n for n, v in vars(PositionJudgement).items() if isinstance(v, property)}


def _accept_gate(data: object, where: str, at: str) -> AcceptGate | None:
    """AcceptGate.to_dict: its fields, each position with its derived `z` (dropped and recomputed)."""
    if data is None:
        return None
    if isinstance(data, dict) and isinstance(data.get("positions"), list):
        positions = [
            {k: v for k, v in p.items() if k not in _POSITION_DERIVED} if isinstance(p, dict) else p
            for p in data["positions"]
        ]
        data = {**data, "positions": positions}
    return decode(AcceptGate, data, where, at)


def _chunk_matches(data: object, where: str, at: str) -> list[ChunkMatch] | None:
    if data is None:
        return None
    if not isinstance(data, list):
        raise fail(where, at, f"expected a list or null, got {kind_of(data)}")
    return [_chunk_match(m, where, join(at, i)) for i, m in enumerate(data)]


@dataclass
class CaptureData(CheckData):
    """`capture`: the reference captured every prompt; how a `wiring: infer` case's wiring was found."""

    KIND: ClassVar[str] = "capture"
    wiring_inference: WiringInference | None = None  # difftest.run.infer_case's inference


@dataclass
class LintData(CheckData):
    KIND: ClassVar[str] = "lint"
    findings: list[Finding] = field(default_factory=list)


@dataclass
class FixData:
    """The draft-config edit the layer-id rule computed (difftest.checks.layer_reading), or why none exists."""

    patch: dict[str, object] | None = None
    ids: list[int] | None = None
    impossible: str | None = None
    fc_order: list[int] | None = None
    alternatives: list[str] = field(default_factory=list)
    side_effects: list[str] = field(default_factory=list)


@dataclass
class GoldenData:
    """The engine's draft re-run on the reference's draft.fc_in (difftest.checks.golden)."""

    outcome: str  # diverges | matches | unsupported | error
    first_divergence: str | None = None
    tensors: list[str] = field(default_factory=list)  # draft tensors above noise in the re-run

    def to_dict(self) -> dict:
        # an unsupported or failed re-run has nothing else to say
        return encode_fields(self) if self.outcome in ("diverges", "matches") else {"outcome": self.outcome}


@dataclass
class ComparisonData(CheckData):
    """`fc_inputs` and `draft_logits`: tensor comparisons against the reference, judged by the noise.
    A passing one holds the noise source and ties; a failing one where the error is introduced, the
    fc diagnosis (for fc_inputs) and the golden re-run (for draft_logits)."""

    KIND: ClassVar[str] = "comparison"
    noise: str = ""  # the noise floor's source line
    ties: list[str] = field(default_factory=list)
    prompt: int | None = None  # the first prompt that diverges
    tensor: str | None = None  # first divergence within this check's scope
    first_divergence: str | None = None  # where the error is introduced (what the message leads with)
    introduced: str | None = None
    first_above_noise: str | None = None
    first_differs: str | None = None
    fc_chunks: list[ChunkMatch] | None = field(default=None, metadata={READER: _chunk_matches})  # per chunk
    similarity: Similarity | None = None  # chunk-vs-candidate cosines (difftest.compare.diagnose.match_chunks)
    fed: list[str | None] | None = None  # fc_inputs: the reference tensors the engine's fc chunks are, by value
    rule: str | None = None  # the engine's layer-id rule, explained
    rule_predicted: list[str] | None = None
    fix: FixData | None = None
    known_causes: list[str] | None = None  # lint codes naming this engine
    golden: GoldenData | None = None
    # the engine computes below the case's float32 (difftest.compare.diagnose.reduced_precision): the finding
    precision: str | None = None

    def to_dict(self) -> dict:
        # a passing comparison stays as small as it always was
        optional = tuple(f.name for f in dataclasses.fields(self) if f.name not in ("noise", "ties"))
        return {"kind": self.KIND, **encode_fields(self, omit_none=optional)}


@dataclass
class Top1Data(CheckData):
    KIND: ClassVar[str] = "top1_agreement"
    agree: int
    total: int
    rate: float
    ties: int  # positions whose reference top-1 is a tie within noise (not judged)
    ties_agree: int
    noise: str
    excused: int = 0  # positions after a numerical event the comparison excused (not judged)


@dataclass
class AcceptLengthData(CheckData):
    """`accept_length` of an engine the harness drives: both measurements and the allowed difference."""

    KIND: ClassVar[str] = "accept_length"
    reference: AcceptStats = field(metadata={READER: _accept_stats})
    engine: AcceptStats = field(metadata={READER: _accept_stats})
    allowed: float
    spread: float
    gate: AcceptGate | None = field(default=None, metadata={READER: _accept_gate})  # the per-position verdict


@dataclass
class ServerAcceptData(CheckData):
    """`accept_length` of a running server (the `server` engine's check, difftest_engines/server/probe.py): its counters against the reference's
    replay of the very tokens it generated."""

    KIND: ClassVar[str] = "server_acceptance"
    reference: AcceptStats = field(metadata={READER: _accept_stats})
    engine: AcceptStats = field(metadata={READER: _accept_stats})
    allowed: float
    spread: float
    server_settings: dict[str, object] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)
    per_request: list[dict[str, object]] = field(default_factory=list)
    numbers: str = ""  # exact | deltas
    verdict: str = ""
    gate: AcceptGate | None = field(default=None, metadata={READER: _accept_gate})  # the per-position verdict


@dataclass
class ReplayRow:
    """One server request replayed through the reference's draft (difftest.run.engine.Engine.replay): the
    acceptance it predicts on the server's very tokens, and where its target would have chosen another."""

    stats: AcceptStats = field(metadata={READER: _accept_stats})
    target_mismatches: int  # output positions where the reference target's greedy token is not the server's
    first_mismatch: int | None  # the first of them

    def to_dict(self) -> dict:
        return encode_fields(self)

    @classmethod
    def from_json(cls, data: object, where: str, at: str) -> "ReplayRow":
        return decode(cls, data, where, at)


CORE_KINDS: dict[str, type[CheckData]] = {
    c.KIND: c for c in (CaptureData, LintData, ComparisonData, Top1Data, AcceptLengthData, ServerAcceptData)
}


def data_kinds() -> dict[str, type[CheckData]]:
    """The core's kinds and those engine packages contribute with their checks."""
    contributed = {
        c.data.KIND: c.data
        for c in check_registry.check_specs().values()
        if isinstance(c.data, type) and issubclass(c.data, CheckData)
    }
    return {**CORE_KINDS, **contributed}


def decode_data(data: object, where: str, at: str) -> CheckData | None:
    """A check's data record by its `kind` (None: a result without data, e.g. an error)."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise fail(where, at, f"expected an object with a kind, got {kind_of(data)}")
    if "kind" not in data:
        raise fail(where, join(at, "kind"), "field missing")
    kind = data["kind"]
    kinds = CORE_KINDS if kind in CORE_KINDS else data_kinds()
    if kind not in kinds:
        close = difflib.get_close_matches(str(kind), sorted(kinds), n=1)
        raise fail(
            where,
            join(at, "kind"),
            f"unknown kind {kind!r}"
            + (f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(kinds))})"),
        )
    return kinds[kind].from_json(data, where, at)
