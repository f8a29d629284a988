#!/usr/bin/env bash
# SGLang on a GPU machine: real kernels (sgl-kernel), float32 and bfloat16, the tiny Llama case and the tiny
# DeepSeek-V3 cases (MLA + MoE target; Llama and MLA drafts) against the reference; with 2+ GPUs the
# same cases at tp_size 2 (NCCL); with the checkpoints and DIFFTEST_TP GPUs (default 8, the deployment's),
# the Kimi-K2.5 case (cases/kimi_k25_gpu.yaml) at that TP against its training dump.
#   scripts/gpu_check_sglang.sh [PYTHON]      PYTHON: an interpreter with a normal `pip install sglang==0.5.23`
# Callable on its own or from scripts/gpu_check.sh. Lent GPU machines reach no network, so the
# SGLang environment must already be there: without it this prints SKIP and exits 0.
# Output: reports under ${OUT:-/tmp/gpu-check}/sglang, one summary line per run.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${1:-${DIFFTEST_PYTHON_SGLANG:-python3}}
out=${OUT:-/tmp/gpu-check}/sglang
mkdir -p "$out"
if ! "$py" -c 'import torch, sglang, sgl_kernel; assert torch.cuda.is_available()' 2>"$out/probe.err"; then
  echo "gpu_check_sglang: SKIP: $py has no CUDA torch + sglang + sgl_kernel ($(tail -1 "$out/probe.err"))"
  exit 0
fi
harness=${DIFFTEST_HARNESS_PYTHON:-$root/.venv/bin/python}
export DIFFTEST_SGLANG_KERNELS=sgl-kernel   # never the CPU shim here
status=0
for dtype in float32 bfloat16; do
  case_dir=$out/$dtype/cases; mkdir -p "$case_dir"   # the plugin collects YAML files in a folder named cases
  for c in tiny_llama tiny_deepseek_v3 tiny_deepseek_v3_mla_draft; do
    sed "s/^dtype: .*/dtype: $dtype/" "$root/cases/$c.yaml" > "$case_dir/$c.yaml"
  done
  start=$(date +%s)
  (cd "$root" && "$harness" -m pytest -p difftest.plugin -q -rfEs "$case_dir" \
      --engines=ref,sglang --require-engines --engine-python "sglang=$py" --engine-timeout 600 \
      --out "$out/reports-$dtype") > "$out/pytest-$dtype.log" 2>&1
  rc=$?
  echo "gpu_check_sglang: $dtype rc=$rc in $(( $(date +%s) - start ))s: $(tail -1 "$out/pytest-$dtype.log")"
  [ $rc -eq 0 ] || status=1
done

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
# -- the tiny cases tensor-parallel: each rank's captures joined (difftest_engines/sglang/tensor_parallel.py)
if [ "${gpus:-0}" -ge 2 ]; then
  start=$(date +%s)
  (cd "$root" && "$harness" -m pytest -p difftest.plugin -q -rfEs "$out/float32/cases" \
      "--engines=ref,sglang[tp_size=2]" --require-engines --engine-python "sglang=$py" --engine-timeout 600 \
      --out "$out/reports-tp2") > "$out/pytest-tp2.log" 2>&1
  rc=$?
  echo "gpu_check_sglang: float32 tp_size=2 rc=$rc in $(( $(date +%s) - start ))s: $(tail -1 "$out/pytest-tp2.log")"
  [ $rc -eq 0 ] || status=1
else
  echo "gpu_check_sglang: tp_size=2: SKIP: ${gpus:-0} GPU(s)"
fi

# -- Kimi-K2.5 at the deployment's TP ---------------------------------------------------------------
tp=${DIFFTEST_TP:-8}
if [ -z "${DIFFTEST_KIMI_TARGET:-}" ] || [ -z "${DIFFTEST_KIMI_DRAFT:-}" ] || [ -z "${DIFFTEST_KIMI_TRAIN_DATA:-}" ]; then
  echo "gpu_check_sglang: kimi_k25_gpu tp_size=$tp: SKIP: set DIFFTEST_KIMI_TARGET, DIFFTEST_KIMI_DRAFT and" \
       "DIFFTEST_KIMI_TRAIN_DATA (the training dump is the reference at full size)"
elif [ "${gpus:-0}" -lt "$tp" ]; then
  echo "gpu_check_sglang: kimi_k25_gpu tp_size=$tp: SKIP: ${gpus:-0} GPU(s); DIFFTEST_TP sets the TP"
else
  start=$(date +%s)
  (cd "$root" && DIFFTEST_TP=$tp "$harness" -m pytest -p difftest.plugin -q -rfEs cases/kimi_k25_gpu.yaml \
      --engines=train,sglang --reference=train --require-engines --engine-python "sglang=$py" \
      --engine-timeout 3600 --out "$out/reports-kimi-tp$tp") > "$out/pytest-kimi.log" 2>&1
  rc=$?
  echo "gpu_check_sglang: kimi_k25_gpu tp_size=$tp rc=$rc in $(( $(date +%s) - start ))s: $(tail -1 "$out/pytest-kimi.log")"
  [ $rc -eq 0 ] || status=1
fi
exit $status
