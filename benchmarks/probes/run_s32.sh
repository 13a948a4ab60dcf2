# For the next device session, one call: the whole GPU suite at session 31's final code (8
# shards; session 31 ran it before its last two fixes, then only their tests), then the Llama-3-8B
# and Llama-2-7B batch-8 rows of the decode table at the new defaults (eager calls: the FP16 part
# in the finish kernel; captured calls: the FP16 splits on a side stream beside the Gluon body),
# FP16 flash SDPA in the same run, as a table of their own.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
SHARDS=8 TEST_S=${TEST_S:-300} DETAILS=gpu_suite_s32_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > "$OUT/gpu_suite_s32.log" 2>&1
cat "$OUT/gpu_suite_s32.log"
timeout -s INT ${BENCH_S:-250} python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --no-baselines --presets kivi-2,kivi-4,uniform-int4,kivi-3,kvquant-3 \
  --models llama-3-8b,llama-2-7b --batches 8 --contexts 32768,131072 \
  --name decode_attention_b8_s32 > "$OUT/decode_attention_b8_s32.log" 2>&1
tail -n 24 "$OUT/decode_attention_b8_s32.log"
