"""Capture records: named tensors in data-flow order plus the metadata to trust them.

On disk a capture is one directory: `tensors.safetensors` and `manifest.json`
(schema `difftest.capture/2`; /1, written before any tensor was stored reduced, still reads). A
`*.logits_target` that its `*.logits` rebuild bit for bit is stored as its column index
(difftest.records.scattered; its manifest entry names the source under `scatter`) and rebuilt on
load: what a comparison reads is what was captured. Directories are written under a temporary name and
renamed into place, so a reader never sees half a capture. The temporary name carries the
writer's process id: what a writer killed mid-write (an engine worker's crash, a timeout's
SIGKILL) leaves is removed by `remove_partial` once that process is gone.

The tensors travel between an engine's worker and the harness through this file without copies
(difftest.base.tensorfile): the worker writes them from their memory, the harness maps the file.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from difftest.base import names

from difftest.base import tensorfile
from difftest.records import scattered
from difftest.base.errors import ConfigError
from difftest.base.jsonfile import read_json
from difftest.records.meta import SCHEMA_VERSION as META_VERSION
from difftest.records.meta import CaptureMeta

SCHEMA = "difftest.capture/2"
READABLE = ("difftest.capture/1", SCHEMA)  # /1: every tensor stored whole


@dataclass
class Capture:
    tensors: dict[str, torch.Tensor]
    meta: CaptureMeta = field(default_factory=CaptureMeta)

    def __post_init__(self) -> None:
        # adapters describe their capture as a mapping of the current version (their own keys under
        # `extra`); it is checked here, once, like a file's
        if isinstance(self.meta, dict):
            where = f"capture meta of {self.meta.get('engine') or 'an engine'}"
            self.meta = CaptureMeta.from_dict({"schema_version": META_VERSION, **self.meta}, where, "")

    @property
    def fc_chunk_size(self) -> int | None:
        return self.meta.target_hidden_size

    def names(self) -> list[str]:
        """Stored names plus the fc_in chunk views, in data-flow order."""
        out = list(self.tensors)
        fc = self.tensors.get(names.FC_IN)
        size = self.fc_chunk_size
        if fc is not None and size and fc.shape[-1] % size == 0:
            out += [names.fc_chunk_name(j) for j in range(fc.shape[-1] // size)]
        return names.in_dataflow_order(out)

    def __contains__(self, name: str) -> bool:
        return name in self.names()

    def get(self, name: str) -> torch.Tensor:
        if name in self.tensors:
            return self.tensors[name]
        j = names.fc_chunk_index(name)
        fc, size = self.tensors.get(names.FC_IN), self.fc_chunk_size
        if j is not None and fc is not None and size and fc.shape[-1] % size == 0 and j < fc.shape[-1] // size:
            return fc[..., j * size : (j + 1) * size]
        raise KeyError(f"capture of {self.meta.engine or '?'} has no tensor {name}")

    @property
    def nbytes(self) -> int:
        """The bytes its tensors hold in memory (its file holds less where a scattered
        `*.logits_target` is stored as its columns: difftest.records.scattered)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    # -- persistence -----------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(directory), dir=directory.parent))
        try:
            ordered = names.in_dataflow_order(self.tensors)
            stored, derived = scattered.pack({n: self.tensors[n] for n in ordered})
            tensorfile.write(tmp / "tensors.safetensors", stored)
            manifest = {
                "schema": SCHEMA,
                "meta": self.meta.to_dict(),
                "tensors": [
                    {
                        "name": n,
                        "shape": list(self.tensors[n].shape),
                        "dtype": str(self.tensors[n].dtype).removeprefix("torch."),
                        **({"scatter": derived[n]} if n in derived else {}),
                    }
                    for n in ordered
                ],
            }
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            if directory.exists():
                shutil.rmtree(directory)
            os.rename(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return directory

    @classmethod
    def load(cls, directory: str | Path, device: str = "cpu") -> "Capture":
        """A capture from its directory; its tensors are views of the mapped file (difftest.base.tensorfile)."""
        directory = Path(directory)
        manifest_path = directory / "manifest.json"
        manifest = read_json(manifest_path, "capture manifest")
        if not isinstance(manifest, dict) or manifest.get("schema") not in READABLE:
            got = manifest.get("schema") if isinstance(manifest, dict) else None
            raise ConfigError(f"{manifest_path}: schema {got!r}, expected {SCHEMA!r}")
        meta = CaptureMeta.from_dict(manifest.get("meta", {}), str(manifest_path))
        flat = tensorfile.read(directory / "tensors.safetensors")
        if device != "cpu":
            flat = {n: t.to(device) for n, t in flat.items()}
        entries = manifest["tensors"]
        order = [t["name"] for t in entries]
        derived = {t["name"]: t["scatter"] for t in entries if "scatter" in t}
        need = [n + scattered.COLUMNS_SUFFIX if n in derived else n for n in order] + list(derived.values())
        missing = [n for n in need if n not in flat]
        if missing:
            raise ConfigError(f"{directory}: tensors listed in the manifest but absent: {', '.join(missing)}")
        vocab = {t["name"]: t["shape"][-1] for t in entries if t["name"] in derived}
        tensors = {
            n: (
                scattered.scatter(flat[derived[n]], flat[n + scattered.COLUMNS_SUFFIX], vocab[n])
                if n in derived
                else flat[n]
            )
            for n in order
        }
        return cls(tensors, meta)


def partial_prefix(final: Path) -> str:
    """The name prefix of what the current process writes on its way to `final` (a temporary
    directory renamed into place, a file handed to a worker)."""
    return f".{final.name}.{os.getpid()}."


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_partial(final: str | Path) -> list[Path]:
    """Remove what a writer that is no longer running left on its way to `final` (see
    partial_prefix); what a running process writes now is kept. Returns what was removed."""
    final = Path(final)
    removed: list[Path] = []
    try:
        candidates = list(final.parent.glob(f".{glob.escape(final.name)}.*.*"))
    except OSError:
        return removed
    for p in candidates:
        pid = p.name[len(final.name) + 2 :].split(".", 1)[0]
        if not pid.isdigit() or _running(int(pid)):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def cache_key(*parts: object) -> str:
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class CaptureCache:
    """Captures on disk keyed by (engine spec, engine version, case fingerprint, prompt ids)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def get(self, key: str) -> Capture | None:
        p = self.path(key)
        if not (p / "manifest.json").exists():
            return None
        try:
            return Capture.load(p)
        except (ConfigError, OSError, ValueError):
            return None  # a damaged entry is a cache miss; it is rewritten below

    def put(self, key: str, capture: Capture) -> Path:
        return capture.save(self.path(key))
