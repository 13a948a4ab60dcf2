# Session 36, last device call: the whole GPU suite (8 shards) at the session's final code
# (LayerStore.view_dev's whole-group bound, the spec/CLI/persist checks).
SHARDS=8 TEST_S=${TEST_S:-330} DETAILS=gpu_suite_s36_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > "$OUT/gpu_suite_s36.log" 2>&1
cat "$OUT/gpu_suite_s36.log"
