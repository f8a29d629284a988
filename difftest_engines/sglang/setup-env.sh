#!/usr/bin/env bash
# Fill SGLang's CPU environment: setup-env.sh PYTHON REQUIREMENTS_FILE
# Called by `scripts/setup-engine sglang` (which owns the environment's location and caching).
# Everything is installed --no-deps from the exact pins in requirements-cpu.txt: torch 2.13.0
# is the machine's local CPU wheel; sglang's own metadata would pull torch 2.14.1 + CUDA kernels.
# The CPU kernel shim is not installed here: the adapter activates it from the clone at run
# time (difftest_engines/sglang/cpu_shim), because this environment is shared by every clone.
set -euo pipefail
py=${1:?usage: setup-env.sh PYTHON REQUIREMENTS_FILE}
reqs=${2:?usage: setup-env.sh PYTHON REQUIREMENTS_FILE}
root=$(cd "$(dirname "$0")/../.." && pwd)
bash "$root/scripts/uv-pip" "$py" install -q --no-deps -r "$reqs"
# Smoke test: SGLang's engine module and the EAGLE-3 draft import with the shim active.
PYTHONPATH="$root" "$py" -W ignore -c '
from difftest_engines.sglang.cpu_shim import activate, choose_kernels
kernels = choose_kernels()
if kernels == "cpu-shim":
    activate()
import sglang, sglang.srt.entrypoints.engine, sglang.srt.models.llama_eagle3
print(f"setup-env: sglang {sglang.__version__} imports ({kernels})")
'
