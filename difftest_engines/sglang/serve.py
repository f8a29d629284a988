"""`python -m difftest_engines.sglang.serve ARGS...`: SGLang 0.5.23's own HTTP server (`sglang.launch_server`,
run as its `__main__`) with the adapter's environment: caches and sockets under the difftest cache,
no hub, and on a machine without SGLang's compiled kernels the CPU shim (difftest_engines/sglang/cpu_shim:
the `sgl_kernel` stand-in on PYTHONPATH for the scheduler processes it spawns, and the AMX platform
report that keeps the shimmed intel_amx attention backend). ARGS are SGLang's server arguments,
passed through unchanged. Used by the live-server tests (`difftest probe`); on a GPU machine with
the real kernels it is plain `python -m sglang.launch_server`.

Tensor parallelism (`--tp-size N`, alias `--tensor-parallel-size`) on CPU: each rank gets its own
cores through SGLANG_CPU_OMP_THREADS_BIND (difftest_engines/sglang/cpu_ranks.py), as the adapter's engine
does; without it SGLang asks for one NUMA node per rank and a one-node machine fails at N = 2.
"""

from __future__ import annotations

import os
import runpy
import sys
import tempfile

from difftest.api import cache_root
from difftest_engines.launch_args import int_option, option
from difftest_engines.sglang import cpu_ranks, cpu_shim

TP_OPTIONS = ("--tp-size", "--tensor-parallel-size")  # srt/arg_groups/fields/parallel.py::tp_size (0.5.23)


def prepare_environment() -> str:
    """The adapter's private directories (difftest_engines/sglang/engine.py::SglangEngine._private_dirs); returns the kernels."""
    base = cache_root() / "sglang"
    for var, sub in (
        ("HF_HOME", "hf"),
        ("XDG_CACHE_HOME", "xdg"),
        ("TRITON_CACHE_DIR", "triton"),
        ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
        ("OUTLINES_CACHE_DIR", "outlines"),
    ):
        os.environ.setdefault(var, str(base / sub))
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    (base / "tmp").mkdir(parents=True, exist_ok=True)
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=f"serve{os.getpid()}-", dir=base / "tmp")
    tempfile.tempdir = None
    kernels = cpu_shim.choose_kernels()
    if kernels == cpu_shim.CPU_SHIM:
        cpu_shim.activate()
    return kernels


def bind_ranks(argv: list[str], kernels: str) -> str | None:
    """On CPU with `--tp-size` > 1, each rank's cores (a binding the user set is kept); the scheduler
    processes, one per rank, inherit it. Returns the binding in force, if any."""
    if option(argv, ("--device",)) == "cpu" or kernels == cpu_shim.CPU_SHIM:
        cpu_ranks.bind(int_option(argv, TP_OPTIONS, 1))
    return os.environ.get(cpu_ranks.BIND_ENV)


def main(argv: list[str]) -> None:
    kernels = prepare_environment()
    import sglang  # noqa: F401  (the platform override needs it imported)

    if kernels == cpu_shim.CPU_SHIM:
        cpu_shim.install_platform_override()
    bound = bind_ranks(argv, kernels)
    binding = f"; {cpu_ranks.BIND_ENV}={bound}" if bound else ""
    print(
        f"[difftest sglang serve] kernels {kernels}{binding}; sglang.launch_server {' '.join(argv)}",
        file=sys.stderr,
        flush=True,
    )
    sys.argv = ["sglang.launch_server", *argv]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
