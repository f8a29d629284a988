"""Imported by Python at start-up in a process whose PYTHONPATH holds this directory.

A Model Runner V2 worker on a CPU (difftest_engines/vllm/triton_cpu.py) puts it there, with
DIFFTEST_VLLM_TRITON_INTERPRETER=1, before vLLM starts: vLLM's tensor-parallel rank processes are
spawned fresh interpreters that import vllm before anything of ours runs, and each must find Triton's
interpreter backend already installed, or its V2 kernels are vLLM's Triton placeholders (measured: TP = 2
failed with "'function' object is not subscriptable"). Any other process leaves it unused.
"""

import os

if os.environ.get("DIFFTEST_VLLM_TRITON_INTERPRETER") == "1":
    from difftest_engines.vllm import triton_cpu

    triton_cpu.install()
