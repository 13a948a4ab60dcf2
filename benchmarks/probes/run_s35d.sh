# Session 35, fourth device call: where an eager ring call's host time goes (ring_host_s35.py),
# and the new GPU test of eager ring calls alone.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT 120 python3 benchmarks/probes/ring_host_s35.py 2>&1 | grep -v -i warn > "$OUT/ring_host_s35.log"
cat "$OUT/ring_host_s35.log"
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu -v \
  tests/kernels/test_decode_attention.py -k "eager_calls_reuse" 2>&1 | tail -n 8
