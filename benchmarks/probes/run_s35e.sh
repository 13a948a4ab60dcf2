# Session 35, last device call: the whole GPU suite at the session's final code (8 shards),
# after the ring's descriptor cache and FastLaunch launch, the outlier-prefetch switch and
# PackedKV.owner.
SHARDS=8 TEST_S=${TEST_S:-330} DETAILS=gpu_suite_s35_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > "$OUT/gpu_suite_s35.log" 2>&1
cat "$OUT/gpu_suite_s35.log"
