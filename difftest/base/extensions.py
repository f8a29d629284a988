"""What an engine package contributes to the core besides its adapter: checks and CLI commands.

The core names no engine. A package registers, in its `pyproject.toml`:

    [project.entry-points."difftest.checks"]      # a check item some cases get per engine
    train_accuracy = "engines.trainingdata.train_check:CHECK"        # an ExtraCheck
    [project.entry-points."difftest.commands"]    # a `difftest NAME ...` subcommand
    train-acc = "engines.trainingdata.commands:TRAIN_ACC"            # a Command
    [project.entry-points."difftest.drafts"]      # a draft model the core runs itself (wiring: infer)
    eagle3 = "engines.ref.infer_draft:LOADER"                         # a DraftLoader

(adapters themselves register under `difftest.engines`, fixtures under `difftest.fixtures`).
Besides entry points, DIFFTEST_CHECKS / DIFFTEST_COMMANDS / DIFFTEST_DRAFTS = "name=module:attr;..."
register them without packaging (as DIFFTEST_ENGINES does adapters: difftest.run.engine).
Entry points are read once per process; one that cannot be loaded is a one-line ConfigError.

A check an engine contributes brings what only it knows: the `expect.<its name>` keys a case may
set for it (`expect`), the figures its verdicts report with their definitions (`figures`,
`definitions`), and the engines it is for. A check that `replaces` a core item runs that item
for its engines (the `server` engine's accept_length: a running server's counters against the
reference's replay of its tokens).
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Callable

from difftest.base.errors import ConfigError

if TYPE_CHECKING:  # the records layer reads this registry back (check_data.data_kinds)
    from difftest.base.definitions import Definition
    from difftest.records.check_data import CheckData

CHECK_GROUP = "difftest.checks"
COMMAND_GROUP = "difftest.commands"
DRAFT_GROUP = "difftest.drafts"


@dataclass(frozen=True)
class ExtraCheck:
    name: str
    run: Callable  # (session, case, spec) -> difftest.checks.verdict.Verdict
    applies: Callable  # (case, is_reference: bool) -> bool: does this case get the item for that engine
    doc: str = ""
    engines: tuple[str, ...] = ()  # engine names the item is for (e.g. only `train`); empty: every engine
    # the difftest.records.check_data.CheckData subclass its verdicts carry: a report names it by its
    # KIND, and reading the report back finds the record here
    data: type[CheckData] | None = None
    # the case's `expect.<name>`: a mapping of these keys, each a finite number >= 0 (difftest.case.case
    # refuses any other key, naming the file); empty: the check reads no expectation
    expect: tuple[str, ...] = ()
    # the figures a verdict of this check reports: data record -> figure names (difftest.base.definitions
    # names, or those in `definitions`); the report lists each figure's definition
    figures: Callable[[CheckData], list[str]] | None = None
    definitions: tuple[Definition, ...] = ()  # the figures only this check reports, defined here
    replaces: str = ""  # a core check item this one runs instead, for `engines` (never an item of its own)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class DraftLoader:
    """Loads a draft checkpoint as a runnable model for the core's own draft forwards (`wiring: infer`)."""

    name: str
    load: Callable  # (draft_dir, target_dir) -> a loaded draft (engines.ref.draft_loading.LoadedDraft)


def _variable(group: str) -> str:
    """difftest.checks -> DIFFTEST_CHECKS: the environment variable that registers without packaging."""
    return "DIFFTEST_" + group.rpartition(".")[2].upper()


def registered(group: str) -> dict[str, str]:
    """name -> 'module:attr' registered in `group`: entry points, then the group's variable."""
    found = {ep.name: ep.value for ep in metadata.entry_points(group=group)}
    variable = _variable(group)
    for item in filter(None, os.environ.get(variable, "").split(";")):
        name, sep, target = item.partition("=")
        if not sep or ":" not in target:
            raise ConfigError(f"{variable}: {item!r} is not name=module:attr")
        found[name.strip()] = target.strip()
    return found


def _load(group: str, kind: type) -> dict:
    import importlib

    found = {}
    for name, value in registered(group).items():
        module, _, attr = value.partition(":")
        try:
            obj = getattr(importlib.import_module(module), attr)
        except Exception as e:  # a broken plugin must not take the harness down with a traceback
            raise ConfigError(
                f"entry point {group}:{name} = {value} cannot be loaded ({type(e).__name__}: {e})"
            ) from None
        if not isinstance(obj, kind) or getattr(obj, "name", None) != name:
            raise ConfigError(f"entry point {group}:{name} = {value} is not a {kind.__name__} named {name!r}")
        found[name] = obj
    return found


@functools.cache
def extra_checks() -> dict[str, ExtraCheck]:
    return _load(CHECK_GROUP, ExtraCheck)


def contributed_definitions() -> dict[str, Definition]:
    """name -> definition of every figure only a contributed check reports."""
    return {d.name: d for c in extra_checks().values() for d in c.definitions}


def replacement(item: str, engine: str) -> ExtraCheck | None:
    """The contributed check that runs the core item `item` for engine `engine`, if any."""
    return next((c for c in extra_checks().values() if c.replaces == item and engine in c.engines), None)


def own_items() -> dict[str, ExtraCheck]:
    """The contributed checks that are check items of their own (not replacements of a core item)."""
    return {name: c for name, c in extra_checks().items() if not c.replaces}


@functools.cache
def commands() -> dict[str, Command]:
    return _load(COMMAND_GROUP, Command)


@functools.cache
def draft_loader() -> DraftLoader:
    """The registered draft model (`difftest.drafts` entry points: the reference's EAGLE-3 draft)."""
    loaders = _load(DRAFT_GROUP, DraftLoader)
    if not loaders:
        raise ConfigError(
            "no draft model is registered (difftest.drafts entry points): reinstall difftest (bash scripts/setup)"
        )
    return loaders.get("eagle3") or next(iter(loaders.values()))
