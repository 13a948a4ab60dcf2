#!/usr/bin/env bash
# Session 64, first device call: the tail of a one-wave Gluon call (what runs after the body)
# re-timed under launch orders and the inline FP16 part with PDL (tail_ab.py), the captured
# call's kernel timeline at the missed uniform-int4 row and its 128k twin, and the decode
# table's Llama-3-8B batch-8 rows for the KIVI and uniform presets with FP16 SDPA in the same run.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu_s64.txt"
timeout 200 python3 benchmarks/probes/tail_ab.py 2>&1 | tee "$OUT/tail_ab_s64.log"
timeout 120 python3 benchmarks/probes/graph_call_timeline.py \
  8:32:8:32768:uniform-int4,8:32:8:131072:uniform-int4,8:32:8:32768:kivi-2 2>&1 \
  | tee "$OUT/graph_call_timeline_s64.log"
KVBITS_FINISH_FP_TOKENS=256 KVBITS_PDL=1 timeout 60 python3 benchmarks/probes/graph_call_timeline.py \
  8:32:8:32768:uniform-int4 2>&1 | tee "$OUT/graph_call_timeline_pdl_s64.log"
timeout 200 python3 benchmarks/decode_attention.py --out "$OUT" --name decode_attention_b8_s64 \
  --skip-quantize-pack --no-baselines --presets kivi-2,kivi-4,uniform-int4,uniform-int2 \
  --models llama-3-8b --batches 8 --contexts 32768,131072 2>&1 | tail -n 30
