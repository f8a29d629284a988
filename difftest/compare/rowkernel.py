"""Build, cache and call the native row kernel (rowkernel.cpp) of difftest.compare.rowstats (and of
difftest.compare.noise's float64 per-row relative error).

The kernel is plain C++ (no torch headers, no ninja): one g++ call of a few seconds, made on
first use and cached under `cache_root()/kernels/` in a file named by the hash of the source,
the compiler's identity and the flags, so a changed source, compiler or build variant never
loads a stale library, and every later process (CI's many pytest processes included) loads it
in milliseconds. It is called through ctypes, which releases the GIL for the call; the kernel
runs its own threads (torch.get_num_threads() of them).

Two builds of one source: "x86-64-v3" (-mavx2 -mfma -mf16c) where torch itself dispatches to
AVX2 or AVX-512 on this CPU, else "generic" (the compiler's baseline for the machine). Never
-march=native: a cache directory shared between machines (or a CI image built elsewhere) must
not hand one machine's instructions to another, and the variant is part of the file name.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from difftest.base.paths import cache_root

SOURCE = Path(__file__).with_name("rowkernel.cpp")
ABI = 2  # difftest_rowkernel_abi() of the source this module speaks to

# field order of the kernel's float64 and int64 outputs (rowkernel.cpp's O_* enums)
FLOAT_FIELDS = ("max_abs", "sum_abs", "sum_sq", "sum_ab", "sum_aa", "sum_bb", "max_rel", "kl", "tv")
INT_FIELDS = ("max_col", "mismatched", "nonfinite", "nan_a", "nan_b", "inf_a", "inf_b", "rank")
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
MAX_COLS = 2**31 - 8  # column indices are int32 lanes in the kernel

BASE_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-Wno-psabi"]
VARIANT_FLAGS = {"x86-64-v3": ["-mavx2", "-mfma", "-mf16c"], "generic": []}


def default_variant() -> str:
    """x86-64-v3 where torch's own kernels use AVX2/AVX-512 here (so the CPU has AVX2, FMA, F16C)."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return "x86-64-v3" if x86 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "generic"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _compiler_id(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.splitlines()[0] if out.returncode == 0 and out.stdout else cxx


def library_path(variant: str, cxx: str) -> Path:
    flags = BASE_FLAGS + VARIANT_FLAGS[variant]
    key = hashlib.sha256(
        "\n".join([SOURCE.read_text(), _compiler_id(cxx), " ".join(flags), platform.machine()]).encode()
    ).hexdigest()[:16]
    return cache_root() / "kernels" / f"rowkernel-{variant}-{key}.so"


def build(variant: str) -> Path:
    """The cached library of this variant, compiled first if needed; raises RuntimeError on failure."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++/c++ not on PATH, CXX unset)")
    path = library_path(variant, cxx)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # compiled beside the target and renamed into place: processes building at once (pytest -n)
    # each write their own file, and no process ever loads a half-written one
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
    os.close(fd)
    try:
        cmd = [cxx, *BASE_FLAGS, *VARIANT_FLAGS[variant], "-o", tmp, str(SOURCE)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode:
            tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"{' '.join(cmd[:1] + cmd[-3:])} failed: " + " | ".join(tail))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@dataclass
class Kernel:
    variant: str
    path: Path
    lib: ctypes.CDLL

    def row_stats(
        self, a2: torch.Tensor, b2: torch.Tensor, atol: float, rtol: float, logits: bool, threads: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Per-row statistics of CPU [R, C] tensors of one dtype in DTYPES with unit column
        stride (the caller checks: `supports`); float64/int64 tensors of [R] as the eager path."""
        R, C = a2.shape
        fout = torch.empty(len(FLOAT_FIELDS), R, dtype=torch.float64)
        iout = torch.empty(len(INT_FIELDS), R, dtype=torch.int64)
        rc = self.lib.difftest_row_stats(
            ctypes.c_void_p(a2.data_ptr()),
            ctypes.c_void_p(b2.data_ptr()),
            DTYPES[a2.dtype],
            a2.stride(0),
            b2.stride(0),
            R,
            C,
            atol,
            rtol,
            int(logits),
            threads or torch.get_num_threads(),
            ctypes.c_void_p(fout.data_ptr()),
            ctypes.c_void_p(iout.data_ptr()),
        )
        if rc:
            raise RuntimeError(f"rowkernel: dtype {a2.dtype} not handled (code {rc})")
        out = {k: fout[i] for i, k in enumerate(FLOAT_FIELDS)} | {k: iout[i] for i, k in enumerate(INT_FIELDS)}
        if not logits:
            for k in ("kl", "tv", "rank"):
                del out[k]
        return out

    def rel_err_sums(self, x2: torch.Tensor, r2: torch.Tensor, threads: int | None = None) -> dict[str, torch.Tensor]:
        """noise.row_rel_err's per-row sums in float64 of CPU [R, C] tensors of any dtypes in DTYPES
        with unit column stride (`supports(x2, r2, mixed=True)`): `num` (sum of (x - ref)^2 where
        both are finite and differ), `den` (sum of ref^2 where both are finite), `bad` (elements
        where one is NaN/inf and they differ)."""
        R, C = r2.shape
        num, den = torch.empty(R, dtype=torch.float64), torch.empty(R, dtype=torch.float64)
        bad = torch.empty(R, dtype=torch.int64)
        rc = self.lib.difftest_rel_err(
            ctypes.c_void_p(x2.data_ptr()),
            DTYPES[x2.dtype],
            ctypes.c_void_p(r2.data_ptr()),
            DTYPES[r2.dtype],
            x2.stride(0),
            r2.stride(0),
            R,
            C,
            threads or torch.get_num_threads(),
            ctypes.c_void_p(num.data_ptr()),
            ctypes.c_void_p(den.data_ptr()),
            ctypes.c_void_p(bad.data_ptr()),
        )
        if rc:
            raise RuntimeError(f"rowkernel: dtypes {x2.dtype}/{r2.dtype} not handled (code {rc})")
        return {"num": num, "den": den, "bad": bad}


def supports(a2: torch.Tensor, b2: torch.Tensor, mixed: bool = False) -> bool:
    """Whether the native kernel takes this pair as it is (no copy): CPU, handled dtypes (one
    dtype unless `mixed`: rel_err_sums takes any two), contiguous rows, column indices within int32."""
    return (
        a2.device.type == "cpu"
        and b2.device.type == "cpu"
        and a2.dtype in DTYPES
        and b2.dtype in DTYPES
        and (mixed or a2.dtype == b2.dtype)
        and a2.dim() == 2
        and a2.shape == b2.shape
        and 0 < a2.shape[1] <= MAX_COLS
        and (a2.stride(1) == 1 or a2.shape[1] == 1)
        and (b2.stride(1) == 1 or b2.shape[1] == 1)
    )


def load(variant: str | None = None) -> Kernel:
    """Build (or find cached) and load the kernel; raises RuntimeError with the reason on failure."""
    variant = variant or default_variant()
    path = build(variant)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise RuntimeError(f"cannot load {path}: {e}") from e
    lib.difftest_rowkernel_abi.restype = ctypes.c_int
    if lib.difftest_rowkernel_abi() != ABI:
        raise RuntimeError(f"{path}: ABI {lib.difftest_rowkernel_abi()}, expected {ABI}")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.difftest_row_stats.argtypes = [
        ptr,
        ptr,
        ctypes.c_int,
        i64,
        i64,
        i64,
        i64,
        ctypes.c_float,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
        ptr,
        ptr,
    ]
    lib.difftest_row_stats.restype = ctypes.c_int
    lib.difftest_rel_err.argtypes = [
        ptr,
        ctypes.c_int,
        ptr,
        ctypes.c_int,
        i64,
        i64,
        i64,
        i64,
        ctypes.c_int,
        ptr,
        ptr,
        ptr,
    ]
    lib.difftest_rel_err.restype = ctypes.c_int
    return Kernel(variant, path, lib)
