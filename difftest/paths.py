"""Where difftest keeps what outlives a run: one answer for every module and engine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$DIFFTEST_CACHE` (with `~` expanded), else `~/.cache/difftest`: fixtures, capture cache,
    engine environments and engine-side overlays all live under it."""
    env = os.environ.get("DIFFTEST_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "difftest"
