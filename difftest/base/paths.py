"""Where difftest keeps what outlives a run: one answer for every module and engine."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path


def cache_root() -> Path:
    """`$DIFFTEST_CACHE` (with `~` expanded), else `~/.cache/difftest`: fixtures, capture cache,
    engine environments and engine-side overlays all live under it."""
    env = os.environ.get("DIFFTEST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "difftest"


# The file written last into an engine environment difftest built (scripts/setup-engine, `difftest env
# create`): an environment without it is unfinished, or not ours.
ENV_BUILT_MARK = ".complete"


def log_file_name(spec_id: str) -> str:
    """A file name for an engine's log: the spec id, made safe (no '/', at most ~120 bytes: a long
    spec parameter must not make the log, and so the engine, impossible to start)."""
    name = re.sub(r"[^\w.\[\]=,@+-]", "_", spec_id)
    if len(name.encode()) > 120:
        name = name[:80] + "-" + hashlib.sha256(spec_id.encode()).hexdigest()[:12]
    return name + ".log"
