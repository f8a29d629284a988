#!/usr/bin/env bash
# GPU check for the vLLM adapter, in one go (a session with a GPU machine runs it):
#   bash scripts/gpu_check.sh            # or: VLLM_SPEC='vllm==0.32.0' WHEELHOUSE=/path bash scripts/gpu_check.sh
# 1. builds a CUDA environment with the `vllm` package (pinned like the CPU one: 0.32.0; pip needs
#    PyPI or a wheelhouse: WHEELHOUSE=/dir is passed as --find-links, with --no-index if NO_INDEX=1)
#    plus difftest's own requirements, in ${DIFFTEST_CACHE:-~/.cache/difftest}/envs/vllm-gpu;
# 2. runs the tiny cases with dtype bfloat16 on the GPU: `pytest cases/ --engines=ref,vllm`
#    (the reference runs on CPU in bf16; vLLM on CUDA in bf16) and the same cases in float32;
# 3. prints a summary: outcome per case x check, accept lengths, greatest |diff| per tensor kind;
# 4. with the Kimi-K2.5 checkpoints (DIFFTEST_KIMI_TARGET, _DRAFT, _TRAIN_DATA) and DIFFTEST_TP GPUs
#    (default 8, the deployment's), cases/kimi_k25_gpu.yaml on vLLM at that tensor_parallel_size
#    against its training dump; otherwise it says SKIP and why.
# Expected: tiny_llama* pass (or fail only within bf16 noise, which the summary shows),
# seed_miswired_training fails fc_inputs on draft.fc_in.0 and accept_length.
# Untested so far: written on a CPU-only machine (no device was lent to that task).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${DIFFTEST_CACHE:-$HOME/.cache/difftest}
env_dir=$cache/envs/vllm-gpu
work=${GPU_CHECK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/difftest-gpu.XXXXXX")}
started=$(date +%s)
say() { echo "[gpu_check $(( $(date +%s) - started ))s] $*"; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || say "nvidia-smi not found"

# -- 1. environment --------------------------------------------------------------------------
pip_src=()
[ -n "${WHEELHOUSE:-}" ] && pip_src+=(--find-links "$WHEELHOUSE")
[ "${NO_INDEX:-0}" = 1 ] && pip_src+=(--no-index)
if [ ! -x "$env_dir/bin/python" ] || ! "$env_dir/bin/python" -c "import vllm, yaml, pytest" 2>/dev/null; then
  say "building $env_dir"
  rm -rf "$env_dir"
  ${PYTHON:-python3} -m venv "$env_dir"
  # the CUDA build of vllm brings its CUDA torch; difftest's pins minus torch go on top
  PIP_CONSTRAINT= "$env_dir/bin/python" -m pip install -q "${pip_src[@]}" "${VLLM_SPEC:-vllm==0.32.0}"
  grep -v -E '^(torch|numpy)==' "$root/requirements-cpu.txt" | grep -v '^#' > "$work/req.txt"
  PIP_CONSTRAINT= "$env_dir/bin/python" -m pip install -q "${pip_src[@]}" -r "$work/req.txt"
fi
py=$env_dir/bin/python
"$py" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
say "environment ready"

# -- 2. cases: bf16 copies (GPU memory share capped) and the float32 originals ---------------------
mkdir -p "$work/bf16/cases" "$work/fp32/cases"
"$py" - "$root/cases" "$work" <<'PY'
import sys, pathlib, yaml
src, work = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for f in sorted(src.glob("*.yaml")):
    case = yaml.safe_load(f.read_text())
    for dtype, sub in (("bfloat16", "bf16"), ("float32", "fp32")):
        c = dict(case, dtype=dtype)
        c.setdefault("engines", {}).setdefault("vllm", {}).setdefault("llm_args", {})["gpu_memory_utilization"] = 0.3
        (work / sub / "cases" / f.name).write_text(yaml.safe_dump(c, sort_keys=False))
PY
for sub in bf16 fp32; do
  say "pytest cases/ --engines=ref,vllm ($sub)"
  (cd "$work/$sub" && PYTHONPATH="$root" "$py" -m pytest -p difftest.plugin -p no:cacheprovider -q -rfEs \
      --rootdir "$work/$sub" -c /dev/null cases/ --engines=ref,vllm --require-engines --no-capture-cache \
      --engine-python "vllm=$py" --engine-timeout 600) > "$work/$sub.out" 2>&1 || true
  tail -n 3 "$work/$sub.out"
done

# -- 3. summary --------------------------------------------------------------------------------
"$py" - "$work" <<'PY'
import json, sys, pathlib
work = pathlib.Path(sys.argv[1])
for sub in ("bf16", "fp32"):
    for rep in sorted((work / sub / "reports").glob("*.json")):
        r = json.loads(rep.read_text())
        print(f"== {sub} {rep.stem}")
        for c in r["checks"]:
            line = c["message"].splitlines()[0] if c.get("message") else ""
            print(f"  {c['engine']:6s} {c['check']:15s} {c['outcome']:8s} {line[:150]}")
        worst = {}
        for p in (r.get("comparisons") or {}).get("vllm", []):
            for t in p["tensors"]:
                kind = t["name"].split(".step")[0] if ".step" in t["name"] else t["name"]
                kind = "target.h.*" if kind.startswith("target.h.") else kind
                worst[kind] = max(worst.get(kind, 0.0), t.get("max_abs") or 0.0)
        if worst:
            print("  greatest |diff| vs ref: " + ", ".join(f"{k} {v:.3g}" for k, v in worst.items()))
PY
# -- 4. Kimi-K2.5 at the deployment's TP -----------------------------------------------------------
tp=${DIFFTEST_TP:-8}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || echo 0)
if [ -z "${DIFFTEST_KIMI_TARGET:-}" ] || [ -z "${DIFFTEST_KIMI_DRAFT:-}" ] || [ -z "${DIFFTEST_KIMI_TRAIN_DATA:-}" ]; then
  say "kimi_k25_gpu tensor_parallel_size=$tp: SKIP: set DIFFTEST_KIMI_TARGET, DIFFTEST_KIMI_DRAFT and" \
      "DIFFTEST_KIMI_TRAIN_DATA (the training dump is the reference at full size)"
elif [ "$gpus" -lt "$tp" ]; then
  say "kimi_k25_gpu tensor_parallel_size=$tp: SKIP: $gpus GPU(s); DIFFTEST_TP sets the TP"
else
  (cd "$root" && DIFFTEST_TP=$tp "$py" -m pytest -p difftest.plugin -p no:cacheprovider -q -rfEs \
      cases/kimi_k25_gpu.yaml --engines=train,vllm --reference=train --require-engines \
      --engine-python "vllm=$py" --engine-timeout 3600 --out "$work/reports-kimi-tp$tp") \
      > "$work/kimi.out" 2>&1 || true
  say "kimi_k25_gpu tensor_parallel_size=$tp: $(tail -n 1 "$work/kimi.out")"
fi
say "done; outputs and reports in $work"
