#!/usr/bin/env bash
# Fill the SpecForge oracle environment: setup-env.sh PYTHON REQUIREMENTS_FILE
# Called by `scripts/setup-engine specforge` (which owns the environment's location and caching).
set -euo pipefail
py=${1:?usage: setup-env.sh PYTHON REQUIREMENTS_FILE}
reqs=${2:?usage: setup-env.sh PYTHON REQUIREMENTS_FILE}
root=$(cd "$(dirname "$0")/../../../.." && pwd)
bash "$root/scripts/uv-pip" "$py" install -q -r <(grep -v -- '# no-deps' "$reqs")
bash "$root/scripts/uv-pip" "$py" install -q --no-deps -r <(grep -- '# no-deps' "$reqs" | sed 's/ *#.*//')
# Smoke test: what the oracle tests import.
"$py" -W ignore -c '
from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
from specforge.algorithms.eagle3.model import _compute_metric_counts, _compute_metric_acc
from importlib.metadata import version
v = version("specforge")
print(f"setup-env: specforge {v} imports")
'
