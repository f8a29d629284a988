"""What an engine package contributes to the core besides its adapter: checks and CLI commands.

The core names no engine. A package registers, in its `pyproject.toml`:

    [project.entry-points."difftest.checks"]      # a check item some cases get per engine
    train_accuracy = "engines.trainingdata.train_check:CHECK"        # an ExtraCheck
    [project.entry-points."difftest.commands"]    # a `difftest NAME ...` subcommand
    train-acc = "engines.trainingdata.commands:TRAIN_ACC"            # a Command
    [project.entry-points."difftest.drafts"]      # a draft model the core runs itself (wiring: infer)
    eagle3 = "engines.ref.infer_draft:LOADER"                         # a DraftLoader

(adapters themselves register under `difftest.engines`, fixtures under `difftest.fixtures`).
Entry points are read once per process; one that cannot be loaded is a one-line ConfigError.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Callable

from difftest.errors import ConfigError

if TYPE_CHECKING:  # the records layer reads this registry back (check_data.data_kinds)
    from difftest.records.check_data import CheckData

CHECK_GROUP = "difftest.checks"
COMMAND_GROUP = "difftest.commands"
DRAFT_GROUP = "difftest.drafts"


@dataclass(frozen=True)
class ExtraCheck:
    name: str
    run: Callable  # (session, case, spec) -> difftest.verdict.Verdict
    applies: Callable  # (case, is_reference: bool) -> bool: does this case get the item for that engine
    doc: str = ""
    engines: tuple[str, ...] = ()  # engine names the item is for (e.g. only `train`); empty: every engine
    # the difftest.records.check_data.CheckData subclass its verdicts carry: a report names it by its
    # KIND, and reading the report back finds the record here
    data: type[CheckData] | None = None


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
    load: Callable  # (draft_dir, target_dir) -> a loaded draft (engines.ref.eagle3.LoadedDraft)


def _load(group: str, kind: type) -> dict:
    found = {}
    for ep in metadata.entry_points(group=group):
        try:
            obj = ep.load()
        except Exception as e:  # a broken plugin must not take the harness down with a traceback
            raise ConfigError(f"entry point {group}:{ep.name} = {ep.value} cannot be loaded ({type(e).__name__}: {e})") from None
        if not isinstance(obj, kind) or getattr(obj, "name", None) != ep.name:
            raise ConfigError(f"entry point {group}:{ep.name} = {ep.value} is not a {kind.__name__} named {ep.name!r}")
        found[ep.name] = obj
    return found


@functools.cache
def extra_checks() -> dict[str, ExtraCheck]:
    return _load(CHECK_GROUP, ExtraCheck)


@functools.cache
def commands() -> dict[str, Command]:
    return _load(COMMAND_GROUP, Command)


@functools.cache
def draft_loader() -> DraftLoader:
    """The registered draft model (`difftest.drafts` entry points: the reference's EAGLE-3 draft)."""
    loaders = _load(DRAFT_GROUP, DraftLoader)
    if not loaders:
        raise ConfigError("no draft model is registered (difftest.drafts entry points): reinstall difftest (bash scripts/setup)")
    return loaders.get("eagle3") or next(iter(loaders.values()))
