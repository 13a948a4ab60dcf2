#!/usr/bin/env bash
# Session 65, fourth device call: the tail A/B on rows the Gluon body does not serve (short or
# few-pair calls read by the Triton stage-1 kernel), where session 65's run_s65b.sh found the
# inline FP16 part with PDL 5.3% faster at Llama-3-8B batch 8 4k kivi-2 than the library's
# default; with the finish kernel as a dependent of the FP16 splits too ("pdl").
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 300 python3 benchmarks/probes/tail_ab.py \
  1:32:8:4096:kivi-2,1:32:8:4096:kivi-4,1:32:8:32768:kivi-2,1:32:8:32768:uniform-int4,8:32:8:4096:kivi-2,8:32:8:4096:uniform-int4,8:32:8:4096:kivi-4,1:32:32:4096:kivi-2,1:32:32:32768:kivi-4,32:32:8:4096:kivi-2,1:32:8:131072:kivi-2,8:32:8:131072:kivi-2 \
  2>&1 | tee "$OUT/tail_ab_s65c.log"
