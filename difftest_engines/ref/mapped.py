"""A checkpoint's safetensors tensors as views of the files, memory-mapped: read through the page
cache as they are used, never copied into the worker's own memory.

The streamed float64 run (difftest_engines/ref/streamed.py) upcasts one decoder layer's weights at a
time. Reading them from a model loaded in the case's dtype means holding that model whole (16 GB at
the Llama-3.1-8B shape) beside the float64 run; reading them from the files means holding none of it:
the kernel pages them in while a layer is upcast and may drop them again under pressure (they are
the files' own pages, clean).

Each file is mapped copy-on-write (`mmap.ACCESS_COPY`): torch wants a writable buffer, and nothing
writes to it, so every page stays the file's. A view is the very bytes the file stores: a load in
the stored dtype (or a wider one) holds the same values, so the float64 run computed from a view
equals the one computed from that load bit for bit (tests/test_streamed_float64.py).
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import torch

from difftest.api import stored_tensors

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class Mapped:
    """The tensors of one checkpoint directory (through its index when there is one), by stored name."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        stored, _ = stored_tensors(self.path)
        self._where: dict[str, tuple[Path, int, int, str, tuple[int, ...]]] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        for f in sorted({t.file for t in stored.values()}):
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
            for name, entry in header.items():
                if name == "__metadata__" or name not in stored or stored[name].file != f:
                    continue  # a shard the index does not assign this tensor to
                start, stop = entry["data_offsets"]
                self._where[name] = (
                    f,
                    8 + n + int(start),
                    int(stop) - int(start),
                    entry["dtype"],
                    tuple(entry["shape"]),
                )

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return list(self._where)

    def offset(self, name: str) -> int:
        """Where the tensor's bytes start in its file."""
        return self._where[name][1]

    def tensor(self, name: str) -> torch.Tensor:
        """The stored tensor as a view of its file (KeyError: not stored; TypeError: a dtype torch
        cannot view, e.g. float8)."""
        f, offset, size, code, shape = self._where[name]
        if code not in DTYPES:
            raise TypeError(f"{name}: stored as {code}")
        dtype = DTYPES[code]
        count = 1
        for d in shape:
            count *= d
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        if f not in self._maps:
            with open(f, "rb") as fh:
                self._maps[f] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self._maps[f], dtype=dtype, count=count, offset=offset)
        return flat.view(shape)
