# Session 31, one device call: the whole GPU suite (8 shards side by side; session 30's finish
# kernel had run only a subset on the H200), then the finish kernel's variants in eager calls,
# alternated (finish_pdl_ab.py had timed its eager columns once each, not alternated).
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
SHARDS=8 TEST_S=${TEST_S:-330} bash benchmarks/probes/run_gpu_suite_sharded.sh
timeout -s INT ${PROBE_S:-170} python3 benchmarks/probes/finish_eager_ab.py ${ROWS:-} \
  > "$OUT/finish_eager_ab_s31.log" 2> "$OUT/finish_eager_ab_s31_profile.log"
cat "$OUT/finish_eager_ab_s31.log"
