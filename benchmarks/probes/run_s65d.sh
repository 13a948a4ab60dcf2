#!/usr/bin/env bash
# Session 65, fifth device call: INLINE_PDL (the dependent finish with the inline FP16 part
# wherever a captured call's finish program merges at most INLINE_PDL_MAX_MERGE partial rows,
# one-wave ring bodies and short Triton-read bodies among them) under the whole GPU suite, then
# the tail A/B over the rows of run_s65b/c.sh ("lib" should match inline+pdl where the rule
# fits and the splits elsewhere).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TEST_S=330 EXTRA_S=60 BIG_S=60 DETAILS=gpu_suite_s65d.txt \
  bash benchmarks/probes/run_gpu_suite_sharded.sh
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/probes/tail_ab.py \
  1:32:8:4096:kivi-2,1:32:8:4096:kivi-4,1:32:8:32768:kivi-2,8:32:8:4096:kivi-2,8:32:8:4096:uniform-int4,1:32:32:4096:kivi-2,1:32:32:32768:kivi-4,32:32:8:4096:kivi-2,1:32:8:131072:kivi-2,8:32:8:131072:kivi-2,8:32:8:32768:uniform-int4,16:32:8:4096:kivi-4,32:32:8:32768:kivi-2 \
  2>&1 | tee "$OUT/tail_ab_s65d.log"
