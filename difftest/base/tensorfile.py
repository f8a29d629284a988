"""Tensor files without copies: a capture's tensors as one safetensors file, written straight from
the tensors' memory and read back as views of a memory map of the file.

This is how captures travel between an engine's worker process and the harness (difftest.records.capture,
difftest.run.worker): the worker writes the file, the harness maps it. Writing is one copy, the one
into the file (the page cache); reading copies nothing: each tensor is a view of the mapped file,
whose pages the kernel shares with the page cache and may drop and read again under memory
pressure. A copy-on-write (private) mapping keeps the file as written should a caller change a
tensor in place. Where a file cannot be mapped (a file system without mmap), it is read into memory
once instead.

The files are the safetensors format (an 8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and byte range, then the bytes), so `safetensors.torch.load_file` reads
them too; the format is written here rather than through `save_file` because older safetensors
releases (the project allows >= 0.4, and an engine's environment brings its own) build the whole
file in memory before writing it and copy every tensor again when loading.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import torch

from difftest.base.errors import ConfigError

# safetensors' dtype names (its format documentation)
DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):  # newer torch releases only
        DTYPE_CODES[getattr(torch, _name)] = _code
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
HEADER_ALIGN = 8  # the data starts 8-byte aligned (safetensors pads its header the same way)
WRITE_CHUNK = 1 << 30  # bytes per write call: some platforms refuse a single write over 2 GiB


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor holding `t`'s values; `t` itself when it already is one (no copy)."""
    return t.detach().to("cpu").contiguous()


def write(path: str | Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write `tensors` (names to tensors) as a safetensors file at `path`; returns the file's size.

    Each tensor's bytes go to the file from its own memory. The caller makes the write atomic
    (difftest.records.capture writes into a temporary directory renamed into place)."""
    plain = {name: _plain(t) for name, t in tensors.items()}
    for name, t in plain.items():
        if t.dtype not in DTYPE_CODES:
            raise ConfigError(f"{path}: tensor {name}: dtype {t.dtype} cannot be stored")
    # widest elements first: every tensor starts aligned to its element size with no gap between
    # them (the format allows none)
    order = sorted(plain, key=lambda n: -plain[n].element_size())
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        t = plain[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % HEADER_ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in order:
            t = plain[name]
            if t.numel() == 0:
                continue
            raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            for start in range(0, len(raw), WRITE_CHUNK):
                f.write(raw[start : start + WRITE_CHUNK])
        return f.tell()


def _header(f, path: Path) -> tuple[dict, int]:
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise ConfigError(f"{path}: not a tensor file ({size} bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
        raise ConfigError(f"{path}: damaged tensor file (header of {n} bytes in a file of {size})")
    try:
        header = json.loads(f.read(n))
    except ValueError:
        raise ConfigError(f"{path}: damaged tensor file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: damaged tensor file (its header is not an object)")
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
            numel = 1
            for d in shape:
                numel *= int(d)
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}: damaged tensor file (entry {name!r} unreadable)") from None
        if not 0 <= begin <= end <= size - data_start or end - begin != numel * dtype.itemsize:
            raise ConfigError(
                f"{path}: damaged tensor file (tensor {name!r}: bytes {begin}..{end} of {size - data_start})"
            )
    return header, data_start


def read(path: str | Path, mapped: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, as views of a private memory map of it (no copy), or
    read into memory once where the file cannot be mapped (or with `mapped=False`).

    A damaged file (truncated, a header that does not describe it) is a ConfigError naming it."""
    path = Path(path)
    with open(path, "rb") as f:
        header, data_start = _header(f, path)
        buffer: mmap.mmap | bytearray | None = None
        if mapped and os.fstat(f.fileno()).st_size > 0:
            try:
                buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError):
                buffer = None  # no mmap here: read it below
        if buffer is None:
            f.seek(0)
            buffer = bytearray(f.read())
    out = {}
    for name, entry in header.items():
        dtype, shape, (begin, end) = DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        if end == begin:  # frombuffer refuses an empty range
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        count = (end - begin) // dtype.itemsize
        out[name] = torch.frombuffer(buffer, dtype=dtype, offset=data_start + begin, count=count).reshape(shape)
    return out
