"""`expect_failure:` in a case: a known failure the harness must keep catching, with its cause.

A case that demonstrates a bug (the seed's miswiring, an engine convention) fails by design.
Declaring that failure turns it green while it happens exactly as declared, with pytest's
strict-xfail semantics: the item passes (as xfailed) when the named check fails on the named
engine *and* its message names the cause; it fails when the failure disappears (an engine
upgrade fixed it) or when the cause changes (the check now fails for another reason).
"""

from __future__ import annotations

import difflib
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path

from difftest.base.errors import ConfigError
from difftest.base.registry import SPEC, registered_engines

FIELDS = ("engine", "check", "cause", "reference", "variant")
REQUIRED = ("engine", "check", "cause")
ANY = "*"


@dataclass(frozen=True)
class ExpectedFailure:
    engine: str  # an engine name (any spec of it), a full spec id such as ref[wiring=vllm], or "*"
    check: str  # a check name or "*"
    cause: str  # text the failure message must contain
    # the run's reference this failure is declared against (a spec id such as sglang@0.5.16, or a
    # name); "*": any. An upgrade check (`--engines=sglang@OLD,sglang`) declares its own entries.
    reference: str = ANY
    # the code path the engine's worker reports it ran (EngineInfo.variant, e.g. "runner v2"); "*": any.
    # A failure that belongs to one of an engine release's code paths (vLLM's Model Runner V2) is
    # declared for it, so the other path passing is not a changed expectation.
    variant: str = ANY

    def matches(
        self, spec_name: str, spec_id: str, check: str, reference: tuple[str, ...] = (ANY, ANY), variant: str = ""
    ) -> bool:
        """`reference`: what the run's reference answers to: its name and spec id, and for a stored
        baseline those of the engine it was saved from (CaseRun.reference_names); `variant`: the code
        path the engine reported."""
        return (
            self.check in (check, ANY)
            and self.engine in (spec_name, spec_id, ANY)
            and self.reference in (*reference, ANY)
            and self.variant in (variant, ANY)
        )

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("reference", "variant") or v != ANY}


@dataclass(frozen=True)
class Outcome:
    expected: bool  # the failure happened with the declared cause
    message: str


def parse(
    value: object, path: Path, checks: tuple[str, ...], engines: Collection[str] | None = None
) -> list[ExpectedFailure]:
    """`expect_failure:` as a mapping or a list of mappings {engine, check, cause[, reference][, variant]}.

    `engine` and `reference` are checked against the engines installed here (`engines`, default:
    difftest.base.registry.registered_engines()), not against the run's --engines: a case declares
    failures for engines a given run leaves out (`vllm@0.24.0` while this run is ref,vllm,sglang),
    so only what can never apply is refused. Each is `*` or an engine spec, NAME[@LABEL][[k=v,...]]
    as --engines takes it, whose NAME is a registered engine (a typo such as `reff` names the
    closest); the LABEL is free (a release such as 0.24.0, or a name such as old), as on the
    command line. Either may also be a stored run, baseline:NAME[:ENGINE] (--baseline).
    """
    if engines is None:
        engines = registered_engines()
    entries = [value] if isinstance(value, dict) else value
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: expect_failure: expected a mapping {{engine, check, cause}} or a list of them")
    out = []
    for i, entry in enumerate(entries):
        where = f"{path}: expect_failure[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected a mapping {{engine, check, cause}}, got {entry!r}")
        for key in entry:
            if key not in FIELDS:
                close = difflib.get_close_matches(str(key), FIELDS, n=1)
                raise ConfigError(f"{where}: unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        for key in FIELDS:
            if (key in REQUIRED or key in entry) and (not isinstance(entry.get(key), str) or not entry[key].strip()):
                raise ConfigError(f"{where}.{key}: expected a non-empty string")
        if entry["check"] not in (*checks, ANY):
            close = difflib.get_close_matches(entry["check"], checks, n=1)
            raise ConfigError(
                f"{where}.check: unknown check {entry['check']!r}"
                + (f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(checks)}")
            )
        for key in ("engine", "reference"):
            if key in entry:
                _check_engine(entry[key], f"{where}.{key}", engines)
        out.append(
            ExpectedFailure(
                entry["engine"], entry["check"], entry["cause"], entry.get("reference", ANY), entry.get("variant", ANY)
            )
        )
    return out


BASELINE_PREFIX = "baseline:"  # difftest.run.baseline.PREFIX: a stored run standing in as the reference


def _check_engine(text: str, where: str, engines: Collection[str]) -> None:
    """`*`, a stored run (baseline:NAME), or a spec whose name is a registered engine: an entry for
    an engine that does not exist never applies, so its failure fails the run while the case
    declares it known."""
    if text == ANY or (text.startswith(BASELINE_PREFIX) and text[len(BASELINE_PREFIX) :].strip()):
        return
    m = SPEC.fullmatch(text)  # --engines' grammar, as matches() compares it: unstripped
    if m is None:
        raise ConfigError(
            f"{where}: cannot read engine {text!r}; expected NAME, NAME@LABEL (e.g. vllm@0.24.0), "
            "a spec id such as ref[wiring=vllm], or '*'"
        )
    name = m.group("name")
    if name not in engines:
        known = sorted(engines)
        close = difflib.get_close_matches(name, known, n=1)
        raise ConfigError(
            f"{where}: unknown engine {name!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f"; registered: {', '.join(known) or 'none'}"
        )


def judge(expected: ExpectedFailure, passed: bool, message: str) -> Outcome:
    if passed:
        return Outcome(
            False,
            f"expected failure did not occur: {expected.check} on {expected.engine} now passes "
            f"(it was declared to fail naming {expected.cause!r}); if an engine upgrade fixed the "
            "behaviour, remove the expect_failure entry",
        )
    if expected.cause not in message:
        return Outcome(
            False,
            f"failed as expected, but the cause changed: the message no longer names {expected.cause!r}:\n{message}",
        )
    return Outcome(True, f"expected failure, cause {expected.cause!r} named:\n{message}")
