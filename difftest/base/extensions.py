"""What an engine package contributes to the core besides its adapter: checks, CLI commands, drafts.

The core names no engine. A package registers, in its `pyproject.toml`:

    [project.entry-points."difftest.checks"]      # a check item some cases get per engine
    train_accuracy = "difftest_engines.trainingdata.train_check:CHECK"        # a CheckSpec
    [project.entry-points."difftest.commands"]    # a `difftest NAME ...` subcommand
    train-acc = "difftest_engines.trainingdata.commands:TRAIN_ACC"            # a Command
    [project.entry-points."difftest.drafts"]      # a draft model the core runs itself (wiring: infer)
    eagle3 = "difftest_engines.ref.infer_draft:LOADER"                         # a DraftLoader

(adapters themselves register under `difftest.engines`, fixtures under `difftest.fixtures`).
Besides entry points, DIFFTEST_CHECKS / DIFFTEST_COMMANDS / DIFFTEST_DRAFTS = "name=module:attr;..."
register them without packaging (as DIFFTEST_ENGINES does adapters: difftest.run.engine).
Entry points are read once per process; one that cannot be loaded is a one-line ConfigError.
Checks, the core's own included, are one registry: difftest.base.check_registry.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
from dataclasses import dataclass
from importlib import metadata
from typing import Callable

from difftest.base.errors import ConfigError

CHECK_GROUP = "difftest.checks"
COMMAND_GROUP = "difftest.commands"
DRAFT_GROUP = "difftest.drafts"


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
    load: Callable  # (draft_dir, target_dir) -> a loaded draft (difftest_engines.ref.draft_loading.LoadedDraft)


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


def load_targets(targets: dict[str, str], where: str, kind: type) -> dict:
    """name -> the `kind` object each 'module:attr' names; `where` says whose they are in an error."""
    found = {}
    for name, value in targets.items():
        module, _, attr = value.partition(":")
        try:
            obj = getattr(importlib.import_module(module), attr)
        except Exception as e:  # a broken plugin must not take the harness down with a traceback
            raise ConfigError(f"{where}:{name} = {value} cannot be loaded ({type(e).__name__}: {e})") from None
        if not isinstance(obj, kind) or getattr(obj, "name", None) != name:
            raise ConfigError(f"{where}:{name} = {value} is not a {kind.__name__} named {name!r}")
        found[name] = obj
    return found


def load_registered(group: str, kind: type) -> dict:
    """name -> the `kind` object registered in `group` (entry points, then the group's variable)."""
    return load_targets(registered(group), f"entry point {group}", kind)


@functools.cache
def commands() -> dict[str, Command]:
    return load_registered(COMMAND_GROUP, Command)


@functools.cache
def draft_loader() -> DraftLoader:
    """The registered draft model (`difftest.drafts` entry points: the reference's EAGLE-3 draft)."""
    loaders = load_registered(DRAFT_GROUP, DraftLoader)
    if not loaders:
        raise ConfigError(
            "no draft model is registered (difftest.drafts entry points): reinstall difftest (bash scripts/setup)"
        )
    return loaders.get("eagle3") or next(iter(loaders.values()))
