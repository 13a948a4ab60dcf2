#!/usr/bin/env bash
# Session 67, first device call: the body's share of the missed rows' calls, timed the decode
# table's way (tail_bound.py: flash SDPA, the call, the body alone, a plain read of the bytes),
# then one captured call's kernel timeline at Llama-3-8B batch 8 32k uniform-int4, then the ring
# one stage deeper. Ran on an H100 in session 67 (the first tail_bound run timed the body at the
# eager rule's 64 splits and was rerun at the captured call's 16): results/tail_bound_s67_h100.*,
# graph_call_timeline_s67_h100.log, ring_stages_ab_s67_h100.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/gpu_s67.txt"
timeout 290 python3 benchmarks/probes/tail_bound.py --out "$OUT" 2>&1 | tee "$OUT/tail_bound_s67.log"
timeout 80 python3 benchmarks/probes/graph_call_timeline.py 8:32:8:32768:uniform-int4 \
  2>&1 | tee "$OUT/graph_call_timeline_s67.log"
timeout 190 python3 benchmarks/probes/ring_stages_ab.py 2>&1 | tee "$OUT/ring_stages_ab_s67.log"
