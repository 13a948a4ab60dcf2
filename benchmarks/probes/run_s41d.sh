#!/usr/bin/env bash
# Session 41, fourth script (what the device time left allowed, after refused starts had spent
# the rest):  OUT=... bash benchmarks/probes/run_s41d.sh
# The quantize tests on the GPU at the final code: the Gluon quantize kernels' x - zero clamp
# (an infinite element codes as the reference's; failed in s41b before it) and the short last
# value groups through the Triton quantize kernel, bit-exact against the reference.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT ${QUANT_S:-150} python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore \
  tests/kernels/test_quantize_pack.py tests/kernels/test_quantize_pack_gluon.py \
  > $OUT/gpu_tests_s41d.log 2>&1
echo "quantize rc=$?: $(tail -n 1 $OUT/gpu_tests_s41d.log)"
grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_s41d.log | head
