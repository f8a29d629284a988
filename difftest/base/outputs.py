"""Output paths: checked before a command starts work, written atomically.

A command that fails to write only after minutes of computation (an unwritable --json, an
--out-dir that is a file) wastes the run and, written in place, can leave half a file behind.
So every command checks each output path first (`check_output_file`, `check_output_dir`: one
line naming the option, the path and why), and writes through a temporary file in the same
directory and a rename (`atomic_write`, `atomic_path`): a reader sees the old file or the new
one, never half of one, and a failed write leaves no temporary file behind.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from difftest.base.errors import ConfigError


def check_output_dir(path: str | Path, option: str) -> Path:
    """A directory the command will create (with its parents) or write into; refused when it, or
    the nearest ancestor that exists, is not a directory or is not writable. Creates nothing."""
    path = Path(path)
    _check_dir(path, option, path)
    return path


def check_output_file(path: str | Path, option: str) -> Path:
    """A file the command will write (replacing one that exists); refused when it is a directory,
    or its directory cannot be created or written. Creates nothing."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{option}: {path} is a directory; give a file path")
    if path.exists() and not os.access(path, os.W_OK):
        # the rename would replace it even so, but a read-only file is a user's "do not overwrite"
        raise ConfigError(f"{option}: {path} is not writable")
    _check_dir(path.parent, option, path)
    return path


def _check_dir(directory: Path, option: str, needed_for: Path) -> None:
    p = directory
    while not p.exists() and p != p.parent:
        p = p.parent
    needed = f" (needed for {needed_for})" if p != needed_for else ""
    if not p.is_dir():
        raise ConfigError(f"{option}: {p} is not a directory{needed}")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ConfigError(f"{option}: {p} is not writable{needed}")


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write (by any means: tarfile, torch...); renamed onto
    `path` when the block ends without an error, removed when it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write text or bytes through a temporary file and a rename (see atomic_path)."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
