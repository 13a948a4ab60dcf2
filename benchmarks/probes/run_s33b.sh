# Session 33, last device call: the side-stream order on the rows the first A/B left out
# (kvquant-3 and kivi-3, whose FP16 splits session 31 measured to matter most; batch 1 128k),
# then the whole GPU suite at this session's code (8 shards), then the batch-8 decode rows at
# the new default (FP16 flash SDPA in the same run).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT ${AB_S:-150} python3 benchmarks/probes/side_order_ab.py \
  8:32:8:32768:kvquant-3,8:32:8:32768:kivi-3,1:32:8:131072:kivi-2,1:32:32:131072:kivi-4,32:32:8:32768:uniform-int4,8:32:32:32768:kvquant-3 \
  2>&1 | grep -v -i warn > "$OUT/side_order_ab_s33b.log"
cat "$OUT/side_order_ab_s33b.log"
SHARDS=8 TEST_S=${TEST_S:-300} DETAILS=gpu_suite_s33_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > "$OUT/gpu_suite_s33.log" 2>&1
cat "$OUT/gpu_suite_s33.log"
timeout -s INT ${BENCH_S:-200} python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --no-baselines --presets kivi-2,kivi-4,uniform-int4,kivi-3,kvquant-3 \
  --models llama-3-8b,llama-2-7b --batches 8 --contexts 32768,131072 \
  --name decode_attention_b8_s33 > "$OUT/decode_attention_b8_s33.log" 2>&1
tail -n 24 "$OUT/decode_attention_b8_s33.log"
