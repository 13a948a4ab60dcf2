# Session 34, last device call: the whole GPU suite at the session's final code (the HF cache's
# deepcopy and layer check, and a GPU test of a copied prefix cache's captured steps).
export PYTHONPATH=src PYTHONUNBUFFERED=1
SHARDS=8 TEST_S=${TEST_S:-300} DETAILS=gpu_suite_s34d_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > "$OUT/gpu_suite_s34d.log" 2>&1
cat "$OUT/gpu_suite_s34d.log"
