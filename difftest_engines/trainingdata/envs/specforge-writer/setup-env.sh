#!/usr/bin/env bash
# Fill the environment SpecForge's hidden-state writer runs in: setup-env.sh PYTHON REQUIREMENTS_FILE
# Called by `scripts/setup-engine specforge-writer` (which owns the environment's location and caching).
# Everything is installed --no-deps from the exact pins (see requirements-cpu.txt for why).
set -euo pipefail
py=${1:?usage: setup-env.sh PYTHON REQUIREMENTS_FILE}
reqs=${2:?usage: setup-env.sh PYTHON REQUIREMENTS_FILE}
root=$(cd "$(dirname "$0")/../../../.." && pwd)
bash "$root/scripts/uv-pip" "$py" install -q --no-deps -r "$reqs"
# Smoke test: what the writer imports (scripts/prepare_hidden_states.py of SpecForge 0.2.0), on the CPU.
# PyPI's torchvision is a CUDA build; the two operator schemas its meta registrations name are
# defined first, as the writer's runner (tests/trainer_oracle/specforge_prepare_hs.py) does.
SGLANG_USE_CPU_ENGINE=1 SPECFORGE_DEVICE=cpu "$py" -W ignore -c '
import torch
lib = torch.library.Library("torchvision", "FRAGMENT")
for s in ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
          "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"):
    lib.define(s)
import sglang
from specforge.offline_capture.sglang_backend import OfflineSGLangCaptureBackend
from specforge.application import resolve_offline_capture
from specforge.data.preprocessing import build_eagle3_dataset
from importlib.metadata import version
v = version("specforge")
print(f"setup-env: specforge {v} with sglang {sglang.__version__} imports")
'
