# Session 34, first device call: the Gluon body's split count as whole waves of resident
# programs (probes/wave_splits.py), then the whole GPU suite at this session's starting code
# (8 shards; session 33's last suite run was cut by the budget).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT ${WAVE_S:-240} python3 benchmarks/probes/wave_splits.py ${ROWS:-} 2>&1 \
  | grep -v -i warn > "$OUT/wave_splits_s34.log"
cat "$OUT/wave_splits_s34.log"
SHARDS=8 TEST_S=${TEST_S:-300} DETAILS=gpu_suite_s34_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > "$OUT/gpu_suite_s34.log" 2>&1
cat "$OUT/gpu_suite_s34.log"
