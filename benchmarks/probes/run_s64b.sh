#!/usr/bin/env bash
# Session 64's second device call, not run there (no device was lent after the first): the
# one-wave PDL finish (ONE_WAVE_PDL) under its GPU tests and re-timed from 4k to 32k, the decode
# table's ceiling per preset (a plain read of each preset's bytes against flash SDPA, both by
# do_bench in graphs), the Llama-3-8B batch-8 rows of the table with its ceiling columns, and
# the do_bench overhead on this GPU. Within one call's 600 s (timeouts sum to 570).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu_s64b.txt"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py -m gpu \
  -k "one_wave or programmatic or finish or side" 2>&1 | tail -n 5 | tee "$OUT/gpu_tests_s64b.txt"
timeout 200 python3 benchmarks/probes/read_ceiling.py --out "$OUT" 2>&1 | grep -v -i warn \
  | tee "$OUT/read_ceiling_s64.log"
timeout 100 python3 benchmarks/probes/tail_ab.py 8:32:8:32768:uniform-int4,8:32:8:4096:kivi-2,8:32:8:4096:uniform-int4,16:32:8:4096:kivi-4,8:32:8:16384:kivi-2,16:32:8:32768:kivi-2 \
  2>&1 | tee "$OUT/tail_ab_s64b.log"
timeout 120 python3 benchmarks/decode_attention.py --out "$OUT" --name decode_attention_b8_s64b \
  --skip-quantize-pack --no-baselines --presets kivi-2,kivi-4,uniform-int4 \
  --models llama-3-8b --batches 8 --contexts 32768,131072 2>&1 | grep -E "graph|bandwidth" | tail -n 12
timeout 60 python3 benchmarks/probes/bench_overhead.py 8:32:8:32768:uniform-int4 \
  2>&1 | grep -v -i warn | tee "$OUT/bench_overhead_s64_h200.log"
