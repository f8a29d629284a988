"""Reading JSON the user handed us: one-line errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path

from difftest.base.errors import ConfigError


def read_json(path: str | Path, what: str = "file") -> object:
    """Parsed JSON; a missing, malformed or too deeply nested file is a ConfigError naming it (and the line)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON in {what} ({e.msg} at line {e.lineno})") from None
    except RecursionError:  # nested deeper than Python's parser recurses: no file difftest reads is
        raise ConfigError(f"{path}: not a {what} (JSON nested too deeply to read)") from None


def read_json_object(path: str | Path, what: str = "file") -> dict:
    """As read_json, for a file that must hold a JSON object (a config.json): anything else is a
    ConfigError naming the file and what it holds instead."""
    data = read_json(path, what)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
