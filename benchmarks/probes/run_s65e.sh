#!/usr/bin/env bash
# Session 65, sixth device call: after run_s65d.sh, INLINE_PDL_MAX_MERGE 192 -> 128 (Llama-3-8B
# batch 1 32k, 43 Triton splits x 4 rows, lost 4.5% on the dependent finish) and two test mends
# (the ring's one-wave check inside the capture; the side-stream test pins the splits' route):
# the decode-attention file's GPU tests in 7 shards, then the tail A/B at the rows near the bound.
# Not run in session 65 (its device time ran out after two refused starts); run in session 66 on
# an H100 (results/gpu_decode_tests_s66_h100.txt, tail_ab_s66_h100.log).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SHARDS=7 TEST_S=240 EXTRA= BIG_S=60 FILES=tests/kernels/test_decode_attention.py \
  DETAILS=gpu_decode_tests_s65e.txt bash benchmarks/probes/run_gpu_suite_sharded.sh
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 120 python3 benchmarks/probes/tail_ab.py \
  1:32:8:32768:kivi-2,1:32:8:4096:kivi-2,8:32:8:131072:kivi-2,32:32:8:32768:kivi-2 \
  2>&1 | tee "$OUT/tail_ab_s65e.log"
