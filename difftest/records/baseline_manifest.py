"""BaselineManifest: a stored golden run's manifest.json (difftest.run.baseline writes and reads it).

    manifest.json            this record
    <case>/<engine>.safetensors   each prompt's tensors, named p<i>/<canonical name>

Schema `difftest.baseline/1`. Its fields and their types are the schema, declared once here: a
damaged or hand-edited manifest is one line naming the field (`cases.c.engines.ref.captures:
field missing`) when the baseline is opened, never a KeyError when it is read at session end.
Two forms written before this record still read: an engine entry with `"info": {}` (nothing was
known of the engine: None) and capture metas without `schema_version` (CaptureMeta's version 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from difftest.base.jsonfile import read_json
from difftest.records.acceptance import AcceptStats
from difftest.records.engine_info import EngineInfo
from difftest.records.fields import READER, decode, encode, fail, reader_without_properties
from difftest.records.meta import CaptureMeta

SCHEMA = "difftest.baseline/1"


@dataclass
class ScatteredLogits:
    """A `*.logits_target` stored as the columns its `*.logits` fill in the target vocabulary (-inf
    elsewhere): rebuilt bit for bit from `scatter` and the `<name>#columns` tensor."""

    scatter: str  # the canonical name of the draft-vocabulary logits it is scattered from
    vocab: int  # the target vocabulary's size


@dataclass
class StoredPrompt:
    """One prompt's capture: which tensors the file holds for it, and its meta."""

    tensors: list[str]
    derived: dict[str, ScatteredLogits] = field(default_factory=dict)
    meta: CaptureMeta = field(default_factory=CaptureMeta)


@dataclass
class StoredSpec:
    """The engine spec the entry was captured with (difftest.run.engine.EngineSpec, as data)."""

    name: str
    label: str | None = None
    params: list[list[str]] = field(default_factory=list)


def _info(value: object, where: str, at: str) -> EngineInfo | None:
    # `{}`: the session knew nothing of the engine when it saved (baselines before this record)
    return None if value == {} or value is None else EngineInfo.from_json(value, where, at)


@dataclass
class StoredEngineRun:
    """One engine's run of one case: where its tensors are and what it was."""

    file: str  # relative to the baseline directory
    captures: list[StoredPrompt]
    accept: AcceptStats = field(metadata={READER: reader_without_properties(AcceptStats)})
    info: EngineInfo | None = field(default=None, metadata={READER: _info})
    engine: StoredSpec | None = None
    device: str = "unknown"
    dtype: str = ""
    bytes: int = 0

    def to_dict(self) -> dict:
        out = {k: encode(v) for k, v in vars(self).items()}
        out["info"] = self.info.to_dict() if self.info is not None else {}
        return out


@dataclass
class StoredCase:
    """One case: its content fingerprint (a changed case is refused) and each engine's run."""

    fingerprint: str
    engines: dict[str, StoredEngineRun]  # by engine spec id
    case_file: str = ""
    dtype: str = ""
    prompts: list[list[int]] = field(default_factory=list)
    spec_prompts: list[list[int]] = field(default_factory=list)  # the speculative run's prompts


@dataclass
class BaselineManifest:
    created: str
    harness: dict[str, object]  # difftest, python, platform, torch, transformers at save time
    git_sha: str | None
    cases: dict[str, StoredCase]
    name: str = ""

    def engine_versions(self) -> dict[str, object]:
        """Engine id -> the release each entry was saved from, over every case."""
        return {
            eid: run.info.version if run.info is not None else None
            for case in self.cases.values()
            for eid, run in case.engines.items()
        }

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, **{k: encode(v) for k, v in vars(self).items()}}

    @classmethod
    def from_dict(cls, data: object, where: str) -> "BaselineManifest":
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            got = data.get("schema") if isinstance(data, dict) else None
            raise fail(where, "", f"schema {got!r}, expected {SCHEMA!r}")
        return decode(cls, data, where, skip=("schema",))

    @classmethod
    def load(cls, path: str | Path) -> "BaselineManifest":
        return cls.from_dict(read_json(path, "baseline manifest"), str(path))
