"""The engine interface and engine specs (the registry is difftest.base.registry).

An engine adapter answers two questions for a case:
  capture(case, prompt_ids)              -> Capture  (canonical names, see difftest.base.names)
  speculate(case, prompts, num_steps, max_new_tokens) -> AcceptStats
Adapters live in `difftest_engines/` and register under the entry-point group `difftest.engines`;
the core never imports them directly: they run inside a worker process (difftest.run.worker).

Engine specs on the command line: `NAME[@LABEL][[key=value,...]]`, e.g. `ref`,
`ref[wiring=sglang]`, `ref[wiring=h0+h3+h31]`, `sglang@old`. LABEL tells two
environments of one engine apart (`--engine-python sglang@old=/path/python`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from difftest.records.acceptance import AcceptStats
from difftest.records.capture import Capture
from difftest.base.errors import ConfigError
from difftest.base.registry import SPEC, engine_schema, registered_engines
from difftest.base.settings import Schema, settings_of, unknown_key, validate
from difftest.records.check_data import ReplayRow
from difftest.records.engine_info import EngineInfo

if TYPE_CHECKING:  # annotations only: the case sits below the engine (it reads difftest.base.registry)
    from difftest.case.case import Case


@dataclass(frozen=True)
class EngineSpec:
    name: str
    label: str | None = None
    params: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        """name@label: what --engine-python and environment lookups use."""
        return f"{self.name}@{self.label}" if self.label else self.name

    @property
    def id(self) -> str:
        p = ",".join(f"{k}={v}" for k, v in self.params)
        return self.key + (f"[{p}]" if p else "")

    def param(self, key: str, default: str | None = None) -> str | None:
        return dict(self.params).get(key, default)

    def to_dict(self) -> dict:
        return {"name": self.name, "label": self.label, "params": [list(p) for p in self.params]}

    @classmethod
    def from_dict(cls, d: dict) -> "EngineSpec":
        return cls(d["name"], d.get("label"), tuple(tuple(p) for p in d.get("params", [])))


def split_engine_list(text: str) -> list[str]:
    """Split on commas that are not inside [...]."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [s.strip().strip("'\"") for s in out if s.strip()]


def parse_spec(text: str) -> EngineSpec:
    m = SPEC.fullmatch(text.strip())
    if not m:
        raise ConfigError(f"--engines: cannot parse engine spec {text!r}; expected NAME[@LABEL][[key=value,...]]")
    params: list[tuple[str, str]] = []
    raw = m.group("params")
    if raw is not None and not raw.strip():
        raise ConfigError(f"--engines {text}: empty parameter list []")
    for item in raw.split(",") if raw else []:
        if "=" not in item:
            raise ConfigError(f"--engines {text}: parameter {item.strip()!r} is not key=value")
        k, v = (x.strip() for x in item.split("=", 1))
        if not k:
            raise ConfigError(f"--engines {text}: empty parameter name in {item.strip()!r}")
        if not v:
            raise ConfigError(f"--engines {text}: parameter {k} has an empty value")
        if any(k == seen for seen, _ in params):
            raise ConfigError(f"--engines {text}: parameter {k} given twice")
        params.append((k, v))
    return EngineSpec(m.group("name"), m.group("label"), tuple(params))


def parse_engine_list(text: str) -> list[EngineSpec]:
    specs = [parse_spec(s) for s in split_engine_list(text)]
    if not specs:
        raise ConfigError("--engines: no engine given")
    ids = [s.id for s in specs]
    dup = next((i for i in ids if ids.count(i) > 1), None)
    if dup:
        raise ConfigError(f"--engines: {dup} given twice")
    return specs


def check_settings(schema: Schema, spec: "EngineSpec", case: Case | None = None) -> dict:
    """Validate the case's `engines.<name>` section (when a case is given) merged with the spec's
    parameters; ConfigError names the case file and field, or the --engines spec."""
    section = case.engines.get(spec.name) if case is not None else None
    return validate(
        schema,
        section,
        spec.params,
        section_where=f"{case.path if case else '?'}: engines.{spec.name}",
        spec_where=f"--engines {spec.id}",
    )


def check_case_settings(case: Case, specs: Sequence[EngineSpec] = (), merged=None) -> None:
    """Every `engines.<name>` section of the case (also of engines not run now: a typo is a typo)
    against its engine's schema, then each spec's parameters merged with its section
    (`merged(case, spec)`: the case a labelled spec's worker is sent). ConfigError at the first problem."""
    known = registered_engines()
    for key in case.engines:
        name = key.partition("@")[0]
        if name not in known:
            raise unknown_key(f"{case.path}: engines.{key}", name, known, "engine")
        schema = engine_schema(name)
        if schema is not None:
            validate(schema, case.engines[key], section_where=f"{case.path}: engines.{key}")
    for spec in specs:
        if spec.name not in known:  # a stored baseline standing in for an engine: nothing to set
            continue
        schema = engine_schema(spec.name)
        if schema is not None:
            check_settings(schema, spec, merged(case, spec) if merged else case)


class Engine(ABC):
    """Base class of adapters; instances live in a worker process.

    SETTINGS declares every setting the adapter reads (difftest.base.settings); the default, an empty
    schema, refuses any case setting or spec parameter."""

    SETTINGS: Schema = Schema("")
    # True for the one engine that calibrates (difftest.base.registry.calibration_engine): it computes any
    # case in float64 as well as its dtype (the noise floor) and captures every target hidden state
    CALIBRATES: bool = False

    def __init__(self, spec: EngineSpec):
        self.spec = spec

    def settings_for(self, case: Case | None) -> Any:
        """The case's engines section merged with the spec's parameters, validated against SETTINGS, as
        SETTINGS' record (settings_record): one attribute per setting."""
        return settings_of(self.SETTINGS, check_settings(self.SETTINGS, self.spec, case))

    @abstractmethod
    def info(self) -> EngineInfo:
        """Raise EngineUnavailable (with the setup command) when the engine cannot be imported."""

    @abstractmethod
    def capture(self, case: Case, prompt_ids: list[int]) -> Capture: ...

    @abstractmethod
    def speculate(self, case: Case, prompts: list[list[int]], num_steps: int, max_new_tokens: int) -> AcceptStats: ...

    def capture_draft_from(self, case: Case, prompt_ids: list[int], fc_in) -> Capture:
        """Optional (layerwise golden inputs): run only the draft, on the given `draft.fc_in`
        ([n, A*H], the reference's) instead of the engine's own target features, and return
        the draft tensors under their canonical names. Engines that cannot inject fc inputs
        keep this default; the harness then reports the golden re-run as not supported."""
        raise NotImplementedError(f"{self.spec.id}: capture_draft_from (golden fc inputs) is not supported")

    def replay(
        self, case: Case, requests: list[tuple[list[int], list[int]]], num_steps: int, topk: int, num_draft_tokens: int
    ) -> list[ReplayRow]:
        """Optional (live servers): per (prompt, output) pair, the acceptance this engine's draft predicts
        on those tokens and where its target would have chosen another token."""
        raise NotImplementedError(f"{self.spec.id}: replaying another engine's tokens is not supported")

    def close(self) -> None:  # noqa: B027 - a default: an engine that holds nothing has nothing to release
        """Release models and child processes."""
