# Session 26: the TMA ring with key scale rows once each: its GPU tests, then the kernel against
# the previous ring (OLD, a copy of the session-25 module) alternated in one process.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  tests/kernels/test_decode_attention.py -k tma > "$OUT/gpu_tests_s26_tma.log" 2>&1
tail -n 4 "$OUT/gpu_tests_s26_tma.log"
timeout -s KILL ${AB_S:-150} python3 benchmarks/probes/tma_ring_ab.py "${OLD:?the session-25 module: git show 963e35e:src/kvbits/kernels/decode_gluon_tma.py > tma_old_s26.py}" \
  2>&1 | grep -v Warning | tee "$OUT/tma_keyscale_ab_s26.log"
