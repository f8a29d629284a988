#!/usr/bin/env bash
# SGLang on a GPU machine: real kernels (sgl-kernel), float32 and bfloat16, the tiny Llama case and the tiny
# DeepSeek-V3 cases (MLA + MoE target; Llama and MLA drafts) against the reference.
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
      --report-dir "$out/reports-$dtype") > "$out/pytest-$dtype.log" 2>&1
  rc=$?
  echo "gpu_check_sglang: $dtype rc=$rc in $(( $(date +%s) - start ))s: $(tail -1 "$out/pytest-$dtype.log")"
  [ $rc -eq 0 ] || status=1
done
exit $status
