"""Content digests of checkpoint files and data directories, for capture-cache keys.

A cached capture is valid only for the bytes it was computed from. Size and mtime do not say
that: a checkpoint rewritten in place with new weights can keep both (`os.utime`, a copy tool
that preserves times, a clock step). So keys hash the files themselves (blake2b over every byte,
safetensors headers and data alike). Hashing runs at disk speed (about 1 s/GB); within one process
a file's digest is memoised under (path, size, mtime_ns, ctime_ns, inode), and ctime cannot be set
back by a user, so a rewrite between two uses in one process is still seen.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CHUNK = 1 << 20
_memo: dict[tuple, str] = {}


def file_digest(path: str | Path) -> str:
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key not in _memo:
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        _memo[key] = h.hexdigest()
    return _memo[key]


def signature(path: str | Path) -> list:
    """[(relative name, size, digest)] of a file or of every file under a directory (hidden files
    and directories such as `.cache/` aside); a string that names nothing is its own signature."""
    p = Path(path)
    if p.is_file():
        return [(p.name, p.stat().st_size, file_digest(p))]
    if not p.is_dir():
        return [str(path)]
    out = []
    for root, dirs, files in os.walk(p):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            f = Path(root) / name
            if f.is_file():
                out.append((str(f.relative_to(p)), f.stat().st_size, file_digest(f)))
    return out


def paths_signature(values: object) -> dict:
    """Signatures of every string in `values` (nested dicts/lists too) that names an existing file
    or directory: per-engine settings and spec parameters that point at checkpoints or data."""
    found: dict = {}

    def walk(v: object) -> None:
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, str) and v and not v.startswith("fixture:") and len(v) < 4096:
            try:
                exists = os.path.exists(v)
            except (OSError, ValueError):
                return
            if exists and v not in found:
                found[v] = signature(v)

    walk(values)
    return found
