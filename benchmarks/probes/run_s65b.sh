#!/usr/bin/env bash
# Session 65, third device call: with ONE_WAVE_PDL on, the tail A/B again ("lib" now takes the
# dependent finish behind a one-wave body; the rows that are not one wave must not move), the
# do_bench overhead probe with its read ceiling fixed, and the decode table's Llama-3-8B rows
# (batch 1 / 8 / 32, 4k / 32k / 128k) for the KIVI and uniform-int4 presets with the ceiling
# columns. Timeouts sum to 560 s.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu_s65b.txt"
timeout 200 python3 benchmarks/probes/tail_ab.py \
  8:32:8:32768:uniform-int4,8:32:8:32768:kivi-2,8:32:8:32768:kivi-4,8:32:8:131072:uniform-int4,1:32:8:131072:kivi-2,32:32:8:32768:kivi-2,8:32:8:4096:kivi-2,16:32:8:4096:kivi-4,8:32:8:16384:uniform-int4 \
  2>&1 | tee "$OUT/tail_ab_s65b.log"
timeout 60 python3 benchmarks/probes/bench_overhead.py 8:32:8:32768:uniform-int4 \
  2>&1 | grep -v -i warn | tee "$OUT/bench_overhead_s65b.log"
timeout 300 python3 benchmarks/decode_attention.py --out "$OUT" --name decode_attention_l3_s65 \
  --skip-quantize-pack --no-baselines --presets kivi-2,kivi-4,uniform-int4 \
  --models llama-3-8b --batches 1,8,32 --contexts 4096,32768,131072 2>&1 | grep -E "gluon|flash" | tail -n 40
