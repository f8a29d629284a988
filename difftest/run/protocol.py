"""The worker protocol as typed messages: one frozen record per request and per reply.

The harness (difftest.run.worker.WorkerClient) and the engine's worker process (difftest.run.worker.serve)
exchange JSON lines; each side builds and reads these records, never a dict by key. `to_wire()` is the JSON
object on the pipe (the keys and values the protocol has always had, so a line is byte for byte what it
was); `from_wire()` reads one back and refuses, in one line naming the field and the closest valid name,
an unknown op, an unknown or missing field, or a value of the wrong type.

    Hello(spec, target)                                      -> HelloReply(info)
    CaptureRequest(case, prompt_ids, out)                    -> CaptureReply(timings)
    SpeculateRequest(case, prompts, num_steps, max_new_tokens) -> SpeculateReply(stats, timings)
    CaptureDraftFromRequest(case, prompt_ids, fc_in, out)    -> CaptureReply(timings)
    ReplayRequest(case, requests, num_steps, topk, num_draft_tokens) -> ReplayReply(replays, timings)
    Close()                                                  -> CloseReply()
    any request, failed                                      -> Failure(kind, error, ends)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar, Union

from difftest.base.errors import ConfigError
from difftest.base.settings import suggest
from difftest.case.case import Case
from difftest.records.acceptance import AcceptStats
from difftest.records.check_data import ReplayRow
from difftest.records.engine_info import EngineInfo
from difftest.records.fields import READER, decode, decode_value, encode_fields, fail
from difftest.records.timings import WorkerPhase
from difftest.run.engine import EngineSpec

REQUEST_WHERE = "worker request"
R = TypeVar("R")


def _read_case(value: object, where: str, at: str) -> Case:
    if not isinstance(value, dict):
        raise fail(where, at, "expected an object")
    return Case.from_dict(value)


def _read_spec(value: object, where: str, at: str) -> EngineSpec:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise fail(where, at, "expected an engine spec object with a name")
    return EngineSpec.from_dict(value)


# -- replies (worker -> harness) ---------------------------------------------------------------


def _timings(wire: dict[str, Any]) -> list[WorkerPhase]:
    try:
        return decode_value(list[WorkerPhase], wire.get("timings", []), "worker reply", "timings")
    except ConfigError:
        return []  # a worker of another difftest version: its phases are not counted


def _refuse_unknown(wire: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in wire:
        if key not in ("ok", *known):
            raise ConfigError(f"{where}: unknown reply field {key!r}{suggest(str(key), known)}")


@dataclass(frozen=True)
class HelloReply:
    info: EngineInfo

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "info": self.info.to_dict()}

    @classmethod
    def from_wire(cls, wire: dict[str, Any], engine: str) -> HelloReply:
        where = f"{engine}'s worker"
        _refuse_unknown(wire, ("info",), where)
        return cls(EngineInfo.from_json(wire.get("info"), where, "info"))


@dataclass(frozen=True)
class CaptureReply:
    """A capture (or a golden-input capture) written where the request said."""

    timings: list[WorkerPhase] = field(default_factory=list)  # the phases the worker measured

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "timings": [asdict(p) for p in self.timings]}

    @classmethod
    def from_wire(cls, wire: dict[str, Any], engine: str) -> CaptureReply:
        _refuse_unknown(wire, ("timings",), f"{engine}'s worker")
        return cls(_timings(wire))


@dataclass(frozen=True)
class SpeculateReply:
    stats: AcceptStats
    timings: list[WorkerPhase] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, "stats": self.stats.to_dict(), "timings": [asdict(p) for p in self.timings]}

    @classmethod
    def from_wire(cls, wire: dict[str, Any], engine: str) -> SpeculateReply:
        where = f"{engine}'s worker"
        _refuse_unknown(wire, ("stats", "timings"), where)
        if not isinstance(wire.get("stats"), dict):
            raise fail(where, "stats", "expected an object")
        return cls(AcceptStats.from_dict(wire["stats"]), _timings(wire))


@dataclass(frozen=True)
class ReplayReply:
    replays: list[ReplayRow]
    timings: list[WorkerPhase] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "ok": True,
            "replays": [r.to_dict() for r in self.replays],
            "timings": [asdict(p) for p in self.timings],
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any], engine: str) -> ReplayReply:
        _refuse_unknown(wire, ("replays", "timings"), f"{engine}'s worker")
        rows = decode_value(list[ReplayRow], wire.get("replays"), f"{engine}'s replay", "replays")
        return cls(rows, _timings(wire))


@dataclass(frozen=True)
class CloseReply:
    def to_wire(self) -> dict[str, Any]:
        return {"ok": True}

    @classmethod
    def from_wire(cls, wire: dict[str, Any], engine: str) -> CloseReply:
        _refuse_unknown(wire, (), f"{engine}'s worker")
        return cls()


FAILURE_KINDS = ("unavailable", "config", "unsupported", "engine", "crash")


@dataclass(frozen=True)
class Failure:
    """A request that failed: `kind` says which error the harness raises, `ends` that the worker exits
    after this reply (errors.EngineSpent)."""

    kind: str  # one of FAILURE_KINDS
    error: str  # one line
    ends: bool = False

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"ok": False, "kind": self.kind, "error": self.error}
        if self.ends:
            wire["ends"] = True
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Failure:
        return cls(str(wire.get("kind")), str(wire.get("error", "unknown error")), bool(wire.get("ends")))


Reply = Union[HelloReply, CaptureReply, SpeculateReply, ReplayReply, CloseReply]


class Timed(Protocol):
    """A reply to a request the engine works on (capture, speculate, capture_draft_from, replay): it
    carries the phases the worker measured, which the harness's clock counts."""

    @property
    def timings(self) -> list[WorkerPhase]: ...


# -- requests (harness -> worker) --------------------------------------------------------------


@dataclass(frozen=True)
class Request(Generic[R]):
    """A request's wire form: {"op": OP, field: value, ...} in field order; R is the reply it is
    answered with (REPLY, read by reply_from_wire)."""

    OP: ClassVar[str] = ""
    REPLY: ClassVar[Any] = None

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.OP, **encode_fields(self)}

    @classmethod
    def from_wire(cls, wire: object) -> Request[Any]:
        """The request `wire` holds, of the class its "op" names (one line naming what is wrong)."""
        if not isinstance(wire, dict):
            raise ConfigError(f"{REQUEST_WHERE}: expected a JSON object")
        op = wire.get("op")
        kind = REQUESTS.get(op) if isinstance(op, str) else None
        if kind is None:
            known = sorted(REQUESTS)
            raise ConfigError(
                f"{REQUEST_WHERE}: unknown op {op!r}{suggest(str(op), known)} (known: {', '.join(known)})"
            )
        if cls is not Request and kind is not cls:
            raise ConfigError(f"{REQUEST_WHERE}: op {op!r} where {cls.OP!r} was expected")
        return decode(kind, wire, REQUEST_WHERE, str(op), skip=("op",))

    def reply_from_wire(self, wire: object, engine: str) -> R | Failure:
        """The worker's answer to this request (`engine`: the spec id, naming it in a refusal)."""
        if not isinstance(wire, dict):
            raise ConfigError(f"{engine}'s worker: expected a JSON object as its reply")
        if not wire.get("ok"):
            return Failure.from_wire(wire)
        reply: R = self.REPLY.from_wire(wire, engine)
        return reply


@dataclass(frozen=True)
class Hello(Request[HelloReply]):
    """Load the adapter `target` ("module:attr") for `spec`; answered with its EngineInfo."""

    OP: ClassVar[str] = "hello"
    REPLY: ClassVar[Any] = HelloReply
    spec: EngineSpec = field(metadata={READER: _read_spec})
    target: str


@dataclass(frozen=True)
class CaptureRequest(Request[CaptureReply]):
    """Engine.capture of `prompt_ids`, the capture written to the directory `out`."""

    OP: ClassVar[str] = "capture"
    REPLY: ClassVar[Any] = CaptureReply
    case: Case = field(metadata={READER: _read_case})
    prompt_ids: list[int]
    out: str


@dataclass(frozen=True)
class SpeculateRequest(Request[SpeculateReply]):
    """Engine.speculate: accept statistics of speculative decoding on `prompts`."""

    OP: ClassVar[str] = "speculate"
    REPLY: ClassVar[Any] = SpeculateReply
    case: Case = field(metadata={READER: _read_case})
    prompts: list[list[int]]
    num_steps: int
    max_new_tokens: int


@dataclass(frozen=True)
class CaptureDraftFromRequest(Request[CaptureReply]):
    """Engine.capture_draft_from (golden inputs): `fc_in` is a safetensors file holding "draft.fc_in"."""

    OP: ClassVar[str] = "capture_draft_from"
    REPLY: ClassVar[Any] = CaptureReply
    case: Case = field(metadata={READER: _read_case})
    prompt_ids: list[int]
    fc_in: str
    out: str


@dataclass(frozen=True)
class ReplayRequest(Request[ReplayReply]):
    """Engine.replay: per (prompt, output) pair, what this engine's draft predicts on those tokens."""

    OP: ClassVar[str] = "replay"
    REPLY: ClassVar[Any] = ReplayReply
    case: Case = field(metadata={READER: _read_case})
    requests: list[tuple[list[int], list[int]]]
    num_steps: int
    topk: int
    num_draft_tokens: int


@dataclass(frozen=True)
class Close(Request[CloseReply]):
    """Release the engine and end the worker."""

    OP: ClassVar[str] = "close"
    REPLY: ClassVar[Any] = CloseReply


REQUESTS: dict[str, type[Request[Any]]] = {
    r.OP: r for r in (Hello, CaptureRequest, SpeculateRequest, CaptureDraftFromRequest, ReplayRequest, Close)
}
