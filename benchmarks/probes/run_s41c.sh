#!/usr/bin/env bash
# Session 41, third script:  OUT=... bash benchmarks/probes/run_s41c.sh
# At the final code (per-token scale groups with a shorter last group; the Gluon quantize
# kernels' x - zero clamped so an infinite element codes as the reference's): the whole GPU
# suite in eight shards, each also running its share of the quantize tests, which are not
# marked gpu (s41b found the Gluon kernels coding inf as 0 there; no sharded run had taken them).
export PYTHONPATH=src PYTHONUNBUFFERED=1
DETAILS=gpu_suite_s41_details.log TEST_S=${TEST_S:-280} EXTRA_S=${EXTRA_S:-100} \
  EXTRA="tests/kernels/test_quantize_pack.py tests/kernels/test_quantize_pack_gluon.py" \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > $OUT/gpu_suite_s41.log 2>&1
cat $OUT/gpu_suite_s41.log
