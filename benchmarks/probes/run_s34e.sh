# Session 34, after the review mends: the decode kernel's and the integrations' GPU tests (the
# split choice moved into kernels.decode_attention.gluon_splits), and one row of the side-order
# probe through benchmarks' captured_ab.
export PYTHONPATH=src PYTHONUNBUFFERED=1
SHARDS=6 TEST_S=${TEST_S:-240} FILES="tests/kernels/test_decode_attention.py tests/integrations" \
  DETAILS=gpu_tests_s34e_details.log bash benchmarks/probes/run_gpu_suite_sharded.sh \
  > "$OUT/gpu_tests_s34e.log" 2>&1
timeout -s INT 60 python3 benchmarks/probes/side_order_ab.py 8:32:8:32768:kivi-2 2>&1 \
  | grep -v -i warn >> "$OUT/gpu_tests_s34e.log"
cat "$OUT/gpu_tests_s34e.log"
