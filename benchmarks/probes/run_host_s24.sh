# Session 24: the host time of eager decode per layer (benchmarks/probes/layer_host_profile.py),
# and GPU tests of the multi-row change not in run_rows_s24.sh's second run.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL ${PROFILE_S:-150} python3 benchmarks/probes/layer_host_profile.py 4096 8 \
  > "$OUT/layer_host_profile${TAG}.log" 2>&1
head -n 12 "$OUT/layer_host_profile${TAG}.log"
if [ -n "$TESTS" ]; then
timeout -s KILL ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider --tb=short --durations=3 \
  $TESTS > "$OUT/gpu_tests_s24${TAG}.log" 2>&1
tail -n 8 "$OUT/gpu_tests_s24${TAG}.log"
fi
