#!/usr/bin/env bash
# Session 41, third script:  OUT=... bash benchmarks/probes/run_s41c.sh
# At the final code (per-token scale groups with a shorter last group; the Gluon quantize
# kernels' x - zero clamped so an infinite element codes as the reference's): the quantize
# tests on the GPU (they are not marked gpu, so the sharded suite skips them; s41b found the
# Gluon kernels coding inf as 0 where the reference clamps to the top code), then the whole GPU
# suite in eight shards.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT ${QUANT_S:-150} python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore \
  tests/kernels/test_quantize_pack.py tests/kernels/test_quantize_pack_gluon.py \
  > $OUT/gpu_tests_s41c_quantize.log 2>&1
echo "quantize: $(tail -n 1 $OUT/gpu_tests_s41c_quantize.log)"
grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_s41c_quantize.log | head
DETAILS=gpu_suite_s41_details.log TEST_S=${TEST_S:-290} \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > $OUT/gpu_suite_s41.log 2>&1
cat $OUT/gpu_suite_s41.log
