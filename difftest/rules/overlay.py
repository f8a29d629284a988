"""Checkpoint overlays: the same weights under an edited config.json.

Engines read a draft's settings from its config (layer ids, norm flags, vocab sizes), so
"what if this draft's config said X" is answered by an overlay directory: config.json
deep-merged with the overrides, every other file symlinked. Overlays are cached by
(source directory, overrides) and written atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from difftest.records.capture import cache_key
from difftest.base.errors import ConfigError


def deep_merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for k, v in overrides.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def overlay_checkpoint(src: str | Path, overrides: dict, cache_dir: str | Path) -> Path:
    src = Path(src).resolve()
    config_path = src / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{config_path}: not found (cannot overlay config overrides)") from None
    if not overrides:
        return src
    dest = Path(cache_dir) / "overlays" / cache_key(str(src), overrides, config_path.stat().st_mtime)
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for f in src.iterdir():
            if f.name != "config.json":
                os.symlink(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(deep_merge(config, overrides), indent=1))
        os.rename(tmp, dest)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process made the same overlay first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
