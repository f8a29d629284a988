"""The engine registry: which adapters are installed (entry points `difftest.engines`, or
DIFFTEST_ENGINES without packaging), the settings each declares, which one calibrates, and the
grammar of an engine spec on the command line. Here, below the case, so that a case file can name
the registered engines (`expect_failure:`) without importing the engine interface above it."""

from __future__ import annotations

import functools
import os
import re
from importlib import metadata
import importlib

from difftest.base.errors import ConfigError
from difftest.base.settings import Schema, suggest

ENTRY_POINT_GROUP = "difftest.engines"
SPEC = re.compile(r"(?P<name>[A-Za-z_][\w-]*)(?:@(?P<label>[\w.-]+))?(?:\[(?P<params>[^\]]*)\])?")


@functools.lru_cache(maxsize=1)
def _installed_engines() -> tuple[tuple[str, str], ...]:
    """The adapters' entry points, read once per process: scanning every installed distribution's
    metadata takes milliseconds, and the session looks an engine up for every cache key it builds."""
    return tuple((ep.name, ep.value) for ep in metadata.entry_points(group=ENTRY_POINT_GROUP))


def registered_engines() -> dict[str, str]:
    """name -> 'module:attr' for every installed adapter.

    Besides entry points, DIFFTEST_ENGINES="name=module:attr;..." registers adapters
    without packaging them (the harness's own tests use it for a fake engine).
    """
    found = dict(_installed_engines())
    for item in filter(None, os.environ.get("DIFFTEST_ENGINES", "").split(";")):
        name, sep, target = item.partition("=")
        if not sep or ":" not in target:
            raise ConfigError(f"DIFFTEST_ENGINES: {item!r} is not name=module:attr")
        found[name.strip()] = target.strip()
    return found


def engine_target(name: str) -> str:
    known = registered_engines()
    if name not in known:
        raise ConfigError(
            f"--engines: unknown engine {name!r}{suggest(name, known)} (registered: {', '.join(sorted(known)) or 'none'})"
        )
    return known[name]


def _engine_class(target: str) -> type | None:
    """The adapter class at 'module:attr', or None where it cannot be imported here (it lives in
    another environment)."""
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception:
        return None


def engine_declared(name: str, attr: str) -> object:
    """What the adapter class registered under `name` declares as `attr` (e.g. MEMORY, read by
    difftest.run.memory_plan), or None where it declares nothing or cannot be imported here."""
    return getattr(_engine_class(engine_target(name)), attr, None)


def engine_schema(name: str) -> Schema | None:
    """The settings schema the adapter registered under `name` declares (its class's SETTINGS), or
    None where the adapter cannot be imported here (it lives in another environment): its worker
    then validates the same schema when it reads the settings."""
    return getattr(_engine_class(engine_target(name)), "SETTINGS", None)


@functools.lru_cache(maxsize=8)
def _calibration(registered: tuple[tuple[str, str], ...]) -> str | None:
    for name, target in registered:
        if getattr(_engine_class(target), "CALIBRATES", False):
            return name
    return None


def calibration_engine() -> str:
    """The name of the registered engine that calibrates (its class sets CALIBRATES): it measures
    the noise floor in float64, is the default engine and reference, and captures the evidence of
    `wiring: infer`. The core names no engine: the registry says which."""
    name = _calibration(tuple(registered_engines().items()))
    if name is None:
        raise ConfigError(
            "no registered engine calibrates (an adapter class with CALIBRATES = True, difftest.engines "
            "entry points): reinstall difftest (bash scripts/setup)"
        )
    return name
