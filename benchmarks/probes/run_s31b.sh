# Session 31, second device call: the whole GPU suite at the new defaults (eager calls attend
# the FP16 part in the finish kernel; captured calls run the FP16 splits on a side stream beside
# the Gluon body), then the graph-time A/B of split / split+stream / inline / the body alone.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
SHARDS=8 TEST_S=${TEST_S:-300} DETAILS=gpu_suite_s31b_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > "$OUT/gpu_suite_s31b.log" 2>&1
cat "$OUT/gpu_suite_s31b.log"
VARIANTS=split,split+stream,inline timeout -s INT ${PROBE_S:-200} python3 benchmarks/probes/finish_pdl_ab.py ${ROWS:-} \
  > "$OUT/finish_stream_ab_s31.log" 2>&1
cat "$OUT/finish_stream_ab_s31.log"
