#!/usr/bin/env bash
# Fill the speculators oracle environment: setup-env.sh PYTHON REQUIREMENTS_FILE
# Called by `scripts/setup-engine speculators` (which owns the environment's location and caching).
set -euo pipefail
py=${1:?usage: setup-env.sh PYTHON REQUIREMENTS_FILE}
reqs=${2:?usage: setup-env.sh PYTHON REQUIREMENTS_FILE}
root=$(cd "$(dirname "$0")/../../../.." && pwd)
bash "$root/scripts/uv-pip" "$py" install -q -r <(grep -v -- '# no-deps' "$reqs")
bash "$root/scripts/uv-pip" "$py" install -q --no-deps -r <(grep -- '# no-deps' "$reqs" | sed 's/ *#.*//')
# Smoke test: what the oracle tests import.
"$py" -W ignore -c '
import speculators, hs_connectors.transfer
from speculators.models.metrics import compute_accuracy_single_step
from speculators.models.eagle3.metrics import compute_metrics
from speculators.train.data import ArrowDataset
from importlib.metadata import version
v = version("speculators")
print(f"setup-env: speculators {v} imports")
'
