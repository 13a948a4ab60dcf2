#!/usr/bin/env bash
# Session 61 on the GPU machine, one call after `needle_gpu.sh`'s PART=1 call (the first half
# of SmolLM2's GGUF): the whole tests/kernels suite (the last GPU-verified subset was at
# 1780906) and, beside it, SmolLM2 passkeys through the fused kernels (fp16, kivi-4, kivi-2,
# kvquant-3; 1k-8k, 6 trials per cell). Both are correctness, not timing, so they share the GPU.
#   call 1: carry .devcarry/gguf_part_aa;  PART=1 bash benchmarks/probes/needle_gpu.sh
#   call 2: carry .devcarry/gguf_part_ab .devcarry/texts .whl;  bash benchmarks/probes/run_s61.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
(timeout 540 env PYTHONPATH=src python3 -m pytest -q tests/kernels -p no:cacheprovider -n 6 \
   --dist loadfile -rfE > "$OUT/gpu_tests_s61.log" 2>&1
 echo "pytest exit $?" >> "$OUT/gpu_tests_s61.log") &
timeout 540 env PART=2 bash benchmarks/probes/needle_gpu.sh --lengths 1k,2k,4k,8k --trials 6 \
  --seed 61 --presets fp16,kivi-4,kivi-2,kvquant-3 --name needle_gpu_s61 \
  > "$OUT/needle_gpu_s61.log" 2>&1
echo "needle exit $?" >> "$OUT/needle_gpu_s61.log"
wait
tail -25 "$OUT/gpu_tests_s61.log"
grep -v "trial" "$OUT/needle_gpu_s61.log" | tail -30
