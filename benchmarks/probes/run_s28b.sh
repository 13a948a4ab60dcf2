# Session 28, second device call: a captured generation through the TMA ring (GPU test), then
# where an eager call's host time goes now: the layer profile of HF generate's decode steps and
# the decode_attention call breakdown (Python, launches) at batch 1.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  tests/integrations/test_decode_loop.py -k "tma_ring or captured_runs" > "$OUT/gpu_tests_s28b.log" 2>&1
tail -n 4 "$OUT/gpu_tests_s28b.log"
timeout -s KILL 170 python3 benchmarks/probes/layer_host_profile.py 4096 8 \
  > "$OUT/layer_host_profile_s28.log" 2>&1
head -n 8 "$OUT/layer_host_profile_s28.log"
timeout -s KILL 120 python3 benchmarks/probes/decode_host_breakdown.py \
  1:32:32:4096:kivi-2,1:32:8:131072:kivi-2 2>&1 | grep -v Warning | tee "$OUT/host_breakdown_s28.log"
