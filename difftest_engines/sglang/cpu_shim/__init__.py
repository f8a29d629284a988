"""Run SGLang's real EAGLE-3 path on a CPU without its compiled kernels (0.5.23, and 0.5.16 on:
the first release whose EAGLE worker has an intel_amx draft backend; see docs/sglang-releases.md).

SGLang's kernel wheels (`sglang-kernel`, `sgl-kernel`) are CUDA builds, and its own CPU
backend wants an AMX Xeon and a source build. `activate()` makes SGLang usable anyway:

  * puts `site/` (a package named `sgl_kernel` backed by `ops.py`) first on `sys.path` and
    on PYTHONPATH, so the scheduler processes SGLang spawns import it too;
  * SGLANG_USE_CPU_ENGINE=1 (SGLang's CPU platform) and TRITON_INTERPRET=1 (a Triton kernel
    of SGLang's on the CPU path runs interpreted; the tree build/verify ops are the shim's own,
    held to SGLang's Triton kernels by tests/sglang_shim_checks.py);
  * after `import sglang`, `install_platform_override()` reports AMX so that server-arg
    resolution keeps the `intel_amx` attention backend (whose two ops the shim provides)
    instead of `torch_native`, which has no EAGLE support.

It is used only when no real kernel package is importable (or when forced with
DIFFTEST_SGLANG_KERNELS=cpu-shim), and every capture says which: meta `kernels` is
"cpu-shim" or "sgl-kernel". Nothing is installed into the engine's environment: the
environment is shared by every clone, the shim belongs to this one.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from difftest.api import EngineUnavailable

SITE = Path(__file__).resolve().parent / "site"
CPU_SHIM, REAL = "cpu-shim", "sgl-kernel"
MODES = ("auto", CPU_SHIM, REAL)


def choose_kernels(mode: str | None = None) -> str:
    """CPU_SHIM or REAL, from DIFFTEST_SGLANG_KERNELS (auto | cpu-shim | sgl-kernel)."""
    mode = mode or os.environ.get("DIFFTEST_SGLANG_KERNELS", "auto")
    if mode not in MODES:
        raise EngineUnavailable(f"DIFFTEST_SGLANG_KERNELS={mode!r}: expected one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    if str(SITE) in sys.path:  # activated earlier in this process: the spec found is the shim
        return CPU_SHIM
    return REAL if importlib.util.find_spec("sgl_kernel") is not None else CPU_SHIM


def activate(env: dict | None = None) -> None:
    """Make the shim the `sgl_kernel` of this process and of the processes it spawns."""
    env = os.environ if env is None else env
    site = str(SITE)
    if site not in sys.path:
        sys.path.insert(0, site)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    # the shim package imports difftest_engines.sglang.cpu_shim.ops: the project root must be importable too
    root = str(SITE.parents[3])
    env["PYTHONPATH"] = os.pathsep.join([site] + ([root] if root not in parts else []) + parts)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["TRITON_INTERPRET"] = "1"
    if "sgl_kernel" in sys.modules and not getattr(sys.modules["sgl_kernel"], "DIFFTEST_CPU_SHIM", False):
        raise EngineUnavailable("a real sgl_kernel is already imported in this process; cannot switch to the CPU shim")
    from difftest_engines.sglang.cpu_shim import ops

    ops.register_torchvision_nms_schema()  # before anything imports torchvision


# Where releases without runtime_context.override_platform (first in 0.5.19) decide, while resolving
# server args, whether `intel_amx` falls back to torch_native (`... and not cpu_has_amx_support()`):
# 0.5.15-0.5.18 arg_groups/overrides.py::_attention_backend_platform_fallbacks, <= 0.5.14
# server_args.py::ServerArgs._handle_attention_backend_compatibility.
_AMX_CHECKS = ("sglang.srt.arg_groups.overrides", "sglang.srt.server_args")


def install_platform_override() -> None:
    """Call after `import sglang`: report AMX so the intel_amx backend (shimmed) is kept.

    Only server-arg resolution in this (the caller's) process sees it: SGLang's layers decide their
    own AMX paths in the scheduler processes, where nothing is overridden."""
    import importlib

    try:
        from sglang.srt.runtime_context import override_platform
    except ImportError:
        override_platform = None
    if override_platform is not None:
        override_platform(has_amx=True).install()
        return
    patched = []
    for name in _AMX_CHECKS:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "cpu_has_amx_support"):
            mod.cpu_has_amx_support = lambda: True
            patched.append(name)
    if not patched:
        raise EngineUnavailable(
            "cpu-shim: found neither runtime_context.override_platform nor a cpu_has_amx_support "
            f"check in {', '.join(_AMX_CHECKS)}: cannot keep the intel_amx backend"
        )
