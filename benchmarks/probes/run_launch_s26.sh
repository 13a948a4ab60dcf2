# Session 26: FastLaunch (kvbits.kernels.launch) on the H200: its GPU tests, a sample of the
# decode-attention GPU tests (every launch after a specialization's first goes through a plan),
# then the host time per call before (KVBITS_FAST_LAUNCH=0) and after.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL ${TEST_S:-420} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  tests/kernels/test_launch.py tests/kernels/test_decode_attention.py tests/integrations/test_decode_loop.py tests/integrations/test_sampling.py \
  -k "${TEST_K:-launch or realistic or million or do_not_recompile or decode_loop or graphs or gluon_variants}" \
  > "$OUT/gpu_tests_s26_launch${TAG}.log" 2>&1
tail -n 6 "$OUT/gpu_tests_s26_launch${TAG}.log"
for fl in 0 1; do
  echo "== KVBITS_FAST_LAUNCH=$fl"
  KVBITS_FAST_LAUNCH=$fl timeout -s KILL 150 python3 benchmarks/probes/decode_host_breakdown.py \
    ${SHAPES} 2>&1 | grep -v Warning
done > "$OUT/host_breakdown_s26${TAG}.log"
cat "$OUT/host_breakdown_s26${TAG}.log"
