# Session 31, second device call: the whole GPU suite at the new defaults (eager calls attend
# the FP16 part in the finish kernel; captured calls run the FP16 splits on a side stream beside
# the Gluon body), then the graph-time A/B of split / split+stream / inline / the body alone.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
SHARDS=8 TEST_S=${TEST_S:-300} bash benchmarks/probes/run_gpu_suite_sharded.sh > "$OUT/gpu_suite_s31b.log" 2>&1
cat "$OUT/gpu_suite_s31b.log"
# keep only the summary and failures of the shard logs (the file count that comes back is limited)
for f in "$OUT"/gpu_suite_shard*.log; do grep -E "FAILED|ERROR|Error|assert|passed|failed" "$f" | head -n 30; done > "$OUT/gpu_suite_s31b_details.log"
rm -f "$OUT"/gpu_suite_shard*.log
VARIANTS=split,split+stream,inline timeout -s INT ${PROBE_S:-200} python3 benchmarks/probes/finish_pdl_ab.py ${ROWS:-} \
  > "$OUT/finish_stream_ab_s31.log" 2>&1
cat "$OUT/finish_stream_ab_s31.log"
