"""The one registry of checks: the core's own and those engine packages contribute, one record each.

As pytest loads its built-in plugins and outside ones through one mechanism, every check is a
`CheckSpec` named by "module:attr" and loaded the same way: the core's are listed in `BUILTIN` (each
declared next to its function, difftest.checks.checks), an engine's under the `difftest.checks`
entry points or DIFFTEST_CHECKS (difftest.base.extensions), e.g. the training-data engine's
train_accuracy. The case's check names and `expect:` keys, the items a case gets per engine, the
check that runs an item and the report's figure definitions are all read from here.

A check brings what only it knows: the `expect.<its name>` keys a case may set for it (`expect`), the
figures its verdicts report with their definitions (`figures`, `definitions`), the record its
verdicts carry (`data`), and the engines it is for. A check that `replaces` an item runs that item
for its engines (the `server` engine's accept_length: a running server's counters against the
reference's replay of its tokens) and is never an item of its own.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass
from typing import Any, Callable

from difftest.base.definitions import Definition
from difftest.base.errors import ConfigError
from difftest.base.extensions import CHECK_GROUP, load_registered, load_targets

REFERENCE = "reference"  # the item is the reference engine's
ENGINE = "engine"  # the item is each other engine's
APPLIES_TO = (REFERENCE, ENGINE)

# The core's checks, in the order a case's items are made (reference items, then each engine's):
# loaded as entry points are; a name an engine package also registers stays the core's.
BUILTIN = {
    "capture": "difftest.checks.checks:CAPTURE_CHECK",
    "lint": "difftest.checks.checks:LINT_CHECK",
    "fc_inputs": "difftest.checks.checks:FC_INPUTS_CHECK",
    "draft_logits": "difftest.checks.checks:DRAFT_LOGITS_CHECK",
    "top1_agreement": "difftest.checks.checks:TOP1_CHECK",
    "accept_length": "difftest.checks.checks:ACCEPT_LENGTH_CHECK",
}


@dataclass(frozen=True)
class CheckSpec:
    name: str
    run: Callable[..., Any]  # the check itself, as difftest.checks.checks.run_check calls it -> a Verdict
    applies_to: str  # REFERENCE or ENGINE: whose item it is
    doc: str = ""
    when: Callable[[Any], bool] | None = None  # (case) -> does this case get the item; None: every case
    engines: tuple[str, ...] = ()  # engine names the item is for (e.g. only `train`); empty: every engine
    # the difftest.records.check_data.CheckData subclass its verdicts carry: a report names it by its
    # KIND, and reading the report back finds the record here
    data: type | None = None
    # the case's `expect.<name>`: a mapping of these keys, each a finite number >= 0 (difftest.case.case
    # refuses any other key, naming the file); empty: the check reads no such mapping
    expect: tuple[str, ...] = ()
    # the figures a result of this check reports: its data record (None: a result without one, e.g. an
    # error) -> figure names (difftest.base.definitions names, or those in `definitions`)
    figures: Callable[[Any], list[str]] | None = None
    definitions: tuple[Definition, ...] = ()  # the figures only this check reports, defined here
    replaces: str = ""  # an item this one runs instead, for `engines` (never an item of its own)

    def __post_init__(self) -> None:
        if self.applies_to not in APPLIES_TO:
            close = difflib.get_close_matches(str(self.applies_to), APPLIES_TO, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(APPLIES_TO)}"
            raise ConfigError(f"check {self.name!r}: applies_to {self.applies_to!r} is unknown ({hint})")

    def applies(self, case: Any, is_reference: bool, engine: str | None = None) -> bool:
        """Does `case` get this item for an engine (the reference or another; engine None: any)."""
        return (
            self.applies_to == (REFERENCE if is_reference else ENGINE)
            and (self.when is None or self.when(case))
            and (not self.engines or engine is None or engine in self.engines)
        )


@functools.cache
def check_specs() -> dict[str, CheckSpec]:
    """Every registered check by name: the core's first, then those engines contribute."""
    builtin = load_targets(BUILTIN, "built-in check", CheckSpec)
    contributed = load_registered(CHECK_GROUP, CheckSpec)
    return {**builtin, **{name: c for name, c in contributed.items() if name not in builtin}}


def items() -> dict[str, CheckSpec]:
    """The checks that are items of their own (not replacements of another item), in item order."""
    return {name: c for name, c in check_specs().items() if not c.replaces}


def known_checks() -> tuple[str, ...]:
    """Every item name a case file may name (e.g. in `expect_failure:`)."""
    return tuple(items())


def items_for(case: Any, is_reference: bool, engine: str | None = None) -> tuple[str, ...]:
    """The items a case gets for an engine: the core's, then those engines contribute that apply to
    it (e.g. train_accuracy, when the case names training data; chat_template only on `train`)."""
    return tuple(name for name, c in items().items() if c.applies(case, is_reference, engine))


def replacement(item: str, engine: str) -> CheckSpec | None:
    """The check that runs item `item` for engine `engine` instead of the item's own, if any."""
    return next((c for c in check_specs().values() if c.replaces == item and engine in c.engines), None)


def runner(item: str, engine: str) -> CheckSpec:
    """The check that runs `item` for `engine`: its replacement there, else the item's own."""
    return replacement(item, engine) or items()[item]


def contributed_expect() -> dict[str, tuple[str, ...]]:
    """`expect.<check>` -> the keys it may hold, for every item that declares such a mapping."""
    return {name: c.expect for name, c in items().items() if c.expect}


def figure_definitions() -> dict[str, Definition]:
    """name -> definition of every figure a check defines itself."""
    return {d.name: d for c in check_specs().values() for d in c.definitions}
