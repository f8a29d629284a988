"""CaptureMeta: what a capture says about itself, the fields the core reads to trust and compare it.

Every adapter (engines/*) writes the core's keys as fields; what one adapter alone records for its
own use or for a human (SGLang's consistency checks, the training data's identification, ...) goes
in `extra`, a mapping the core never reads. Stored in the capture manifest's `meta` (difftest.records.capture)
and in a baseline manifest, with `schema_version`.

Schema versions: 2 is this record. A meta without `schema_version` is version 1, the untyped dict
captures and baselines were written with before: its core keys are read as fields (checked like
any others) and its other keys land in `extra`, so a baseline saved before typed records still
loads. Any other version is refused, naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from dataclasses import dataclass, field

from difftest.base.fc_wiring import Wiring
from difftest.records.fields import decode, encode, fail

SCHEMA_VERSION = 2
LEGACY_VERSION = 1  # untyped dicts, before schema_version existed


@dataclass
class CaptureMeta:
    engine: str | None = None  # the engine spec id that captured
    engine_version: str | None = None
    versions: dict[str, object] = field(default_factory=dict)  # torch, transformers, ... in the engine's environment
    kernels: str | None = None
    device: str | None = None
    dtype: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    target_next_token: int | None = None  # the target's greedy token after the prompt (the draft's first input)
    draft_tokens: list[int] = field(default_factory=list)  # the draft's greedy token per step
    num_layers: int | None = None  # target layers L (target.h.0 .. target.h.L)
    target_hidden_size: int | None = None  # the width of one fc_in chunk
    wiring: Wiring | None = None  # the fc inputs the engine fed (difftest.base.fc_wiring)
    partial: list[str] = field(
        default_factory=list
    )  # name patterns this engine cannot capture (not missing by mistake)
    golden_fc_in: bool = False  # a draft re-run on another capture's draft.fc_in (golden inputs)
    compat: list[str] = field(
        default_factory=list
    )  # measures that patched the engine to run here (engines/*/compat.py)
    checkpoints: dict[str, str] = field(default_factory=dict)  # target / draft paths the engine loaded
    settings: dict[str, object] = field(default_factory=dict)  # the engine's effective settings
    draft_config: dict[str, object] = field(default_factory=dict)  # the draft config as the engine read it
    notes: list[str] = field(default_factory=list)
    baseline: str | None = None  # read back from a stored baseline (difftest.run.baseline): its name
    baseline_engine: str | None = None  # ... and the engine entry it came from
    extra: dict[str, object] = field(default_factory=dict)  # adapter-specific keys, never read by the core

    def to_dict(self) -> dict:
        """Fields at their defaults are left out: the manifest holds what the adapter recorded."""
        out: dict = {"schema_version": SCHEMA_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            if value != default:
                out[f.name] = encode(value)
        return out

    @classmethod
    def from_dict(cls, data: object, where: str, at: str = "meta") -> "CaptureMeta":
        return cls.from_json(data, where, at)

    @classmethod
    def from_json(cls, data: object, where: str, at: str) -> "CaptureMeta":
        if not isinstance(data, dict):
            return decode(cls, data, where, at)  # the one-line "expected an object"
        version = data.get("schema_version", LEGACY_VERSION)
        if version == LEGACY_VERSION and "schema_version" not in data:
            known = {f.name for f in dataclasses.fields(cls)}
            extra = {k: v for k, v in data.items() if k not in known}
            if extra and isinstance(data.get("extra", {}), dict):  # otherwise decode names the bad `extra`
                data = {k: v for k, v in data.items() if k in known} | {"extra": {**extra, **data.get("extra", {})}}
        elif version != SCHEMA_VERSION:
            raise fail(
                where,
                f"{at}.schema_version" if at else "schema_version",
                f"capture meta schema version {version!r}; this difftest reads {SCHEMA_VERSION} "
                f"(and {LEGACY_VERSION}, without schema_version): capture it again",
            )
        return decode(cls, data, where, at, skip=("schema_version",))

    def replace(self, **changes: Any) -> "CaptureMeta":
        return dataclasses.replace(self, **changes)
