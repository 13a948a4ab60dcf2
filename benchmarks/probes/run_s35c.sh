# Session 35, third device call: the TMA ring with its descriptors cached per layer and its
# launch through FastLaunch: the GPU tests of the ring, the launcher and the captured decode
# loop, then eager ring against the register body (probes/eager_ring_ab.py) to place
# decode_gluon_tma.EAGER_MIN_WORK.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  tests/kernels/test_launch.py tests/kernels/test_decode_attention.py -k "tma or launch or plans or repeated or programmatic" \
  2>&1 | tail -n 25 > "$OUT/gpu_tests_s35c.log"
cat "$OUT/gpu_tests_s35c.log"
timeout -s INT ${AB_S:-240} python3 benchmarks/probes/eager_ring_ab.py ${ROWS:-} 2>&1 \
  | grep -v -i warn > "$OUT/eager_ring_ab_s35.log"
cat "$OUT/eager_ring_ab_s35.log"
