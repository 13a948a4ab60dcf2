#!/usr/bin/env bash
# One device call that checks and times everything on a GPU machine (no network there):
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# 1. the GPU tests (kernels vs reference at full size, the 2^31-offset case, kernels inside
#    generate) plus the decode kernel's scale-axis and FP8 cases and the quantize kernels at GPU
#    speed (TESTS overrides the first pytest selection), 2. the decode-attention benchmark (BENCH_ARGS, e.g. --tune)
#    and its summary with the speed targets (benchmarks/decode_headline.py).
# Results land in OUT_DIR (default benchmarks/results); copy them into benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$out/gpu_check.log"
# shellcheck disable=SC2086
python3 -m pytest -q --durations=15 ${TESTS:--m gpu tests} 2>&1 | tee -a "$out/gpu_check.log" | tail -22
python3 -m pytest -q tests/kernels/test_decode_attention.py -k "axes or fp8 or reads" 2>&1 \
  | tee -a "$out/gpu_check.log" | tail -3
# the quantize kernels bit-exact against the reference (unmarked: they take the GPU when there
# is one; session 41 found a GPU-only difference there that no -m gpu run could see)
python3 -m pytest -q tests/kernels/test_quantize_pack.py 2>&1 | tee -a "$out/gpu_check.log" | tail -3
if [ -n "${SWEEP:-}" ]; then
  # shellcheck disable=SC2086
  python3 benchmarks/gluon_sweep.py $SWEEP 2>&1 | tee -a "$out/gpu_check.log"
fi
if [ "${BENCH:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  python3 benchmarks/decode_attention.py --out "$out" ${BENCH_ARGS:-} 2>&1 \
    | tee -a "$out/gpu_check.log" | grep -v "^skip"
  # the README's summaries and the issues' speed targets, from the table just written
  name=decode_attention
  case " ${BENCH_ARGS:-} " in *" --quick "*) name=decode_attention_quick ;; esac
  [[ " ${BENCH_ARGS:-} " =~ \ --name[=\ ]([^ ]+) ]] && name=${BASH_REMATCH[1]}
  python3 benchmarks/decode_headline.py "$out/$name.json" 2>&1 | tee -a "$out/gpu_check.log" \
    | tail -9
fi
