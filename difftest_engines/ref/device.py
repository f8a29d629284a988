"""Where the reference runs (`ref[device=cuda]`): the device its worker resolves, what that device's
float32 precision is, and the captures brought back to the CPU.

On the CPU nothing here touches the computation: no device context, no copy (the captures are the
tensors the models returned, bit for bit as before the setting existed). On CUDA the models are
moved once, every request runs inside `torch.device(...)` (so the tensors the reference's own code
makes, prompt ids, positions, masks, land there too), and every capture comes back contiguous on the
CPU, in the case's dtype.

TF32 is never changed here: float32 matmuls on CUDA use TF32 exactly when the user's torch settings
say so (torch's default is off). The worker is a process of its own: a user's TF32 reaches it through
the environment (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1, NVIDIA_TF32_OVERRIDE=0 to forbid it) or a
sitecustomize that sets torch's flags. What the worker has is recorded in its EngineInfo, and a TF32 run
says so in every capture's notes: its error (about 1e-4 relative, measured on an H200) sits far above
a float32 noise floor, so its tensor checks fail at the target's first layer by design.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

import torch

from difftest.api import EngineUnavailable

CPU = "cpu"
# environment variables that switch TF32 on outside torch's Python settings (cuBLAS reads the first,
# torch the second at start-up): recorded when set, since the Python settings then do not tell the whole story
TF32_ENVIRONMENT = ("NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")


def resolve(spec_id: str, asked: str) -> str:
    """The device the worker runs on, as torch names it ('cpu' or 'cuda:N'), from the validated setting
    (difftest_engines/ref/settings.py DEVICES). EngineUnavailable, in one line, where this torch has no
    such device: checked when the worker starts, before any model loads."""
    if asked == CPU:
        return CPU
    if not torch.cuda.is_available():
        return _refuse(f"{spec_id}: torch {torch.__version__} here has no CUDA device")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if asked == "cuda" else int(asked.partition(":")[2])
    if index >= count:
        return _refuse(
            f"{spec_id}: torch {torch.__version__} here sees {count} CUDA device{'s' if count != 1 else ''} "
            f"(cuda:0..cuda:{count - 1})"
        )
    return f"cuda:{index}"


def _refuse(message: str) -> str:
    raise EngineUnavailable(message)


def _read(getter) -> str:
    """One precision setting as text; torch >= 2.9 refuses to read a legacy flag after the new API set
    it (a RuntimeError naming the mix): recorded as such rather than failing the worker's start."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the legacy flags' deprecation notice, once per process
            return str(getter())
    except (RuntimeError, AttributeError) as e:
        return f"unreadable ({str(e).splitlines()[0][:80]})"


def precision() -> dict[str, str]:
    """The worker's float32 precision settings on CUDA, as it found them (never changed by difftest)."""
    matmul = torch.backends.cuda.matmul
    out = {
        "allow_tf32": _read(lambda: matmul.allow_tf32),
        "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
        "cudnn.allow_tf32": _read(lambda: torch.backends.cudnn.allow_tf32),
    }
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9's API beside the legacy flags
        out["matmul.fp32_precision"] = _read(lambda: matmul.fp32_precision)
    for name in TF32_ENVIRONMENT:
        if os.environ.get(name):
            out[name] = os.environ[name]
    return out


def tf32(record: dict[str, str]) -> bool:
    """Whether float32 matmuls may run in TF32 under `record` (precision()): any setting that allows it,
    unless NVIDIA_TF32_OVERRIDE=0 (the driver's switch: 0 turns TF32 off everywhere, other values do nothing)."""
    if record.get("NVIDIA_TF32_OVERRIDE") == "0":
        return False
    return (
        record.get("allow_tf32") == "True"
        or record.get("float32_matmul_precision") in ("high", "medium")
        or record.get("matmul.fp32_precision") == "tf32"
        or record.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "0") not in ("", "0")
    )


def describe(device: str, record: dict[str, str] | None) -> str:
    """The device as a report's kernels column names it: "torch on cpu", "torch on cuda:0 (NVIDIA H200,
    TF32 off)"."""
    if device == CPU:
        return "torch on cpu"
    name = torch.cuda.get_device_name(torch.device(device))
    return f"torch on {device} ({name}, TF32 {'on' if tf32(record or {}) else 'off'})"


@contextlib.contextmanager
def running_on(device: str) -> Iterator[None]:
    """The reference's code on `device`: tensors it makes without naming a device land there. On the
    CPU, nothing at all (the computation as it always was)."""
    if device == CPU:
        yield
        return
    with torch.device(device):
        yield
    torch.cuda.synchronize(device)


def to_host(tensors: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    """Captures as the harness reads them: on the CPU, contiguous. On the CPU, the very tensors."""
    if device == CPU:
        return tensors
    return {k: v.detach().to(CPU).contiguous() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
