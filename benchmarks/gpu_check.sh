#!/usr/bin/env bash
# One device call that checks and times everything on a GPU machine (no network there):
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# 1. the GPU tests (kernels vs reference at full size, the 2^31-offset case, kernels inside
#    generate), 2. the decode-attention benchmark with its launch-knob sweep. Results land in
#    OUT_DIR (default benchmarks/results); copy them into benchmarks/results/ and commit.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$out/gpu_check.log"
python3 -m pytest -q -m gpu tests 2>&1 | tee -a "$out/gpu_check.log" | tail -5
python3 benchmarks/decode_attention.py --tune --out "$out" 2>&1 | tee -a "$out/gpu_check.log" \
  | grep -v "^skip"
