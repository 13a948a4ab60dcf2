# Session 34, second device call: the whole GPU suite with the ring's one-wave split rule
# (decode_gluon_tma.one_wave_splits), then the batch-8 decode rows at the new default (FP16
# flash SDPA in the same run), then batch 4 / 16 rows the tables do not have.
export PYTHONPATH=src PYTHONUNBUFFERED=1
SHARDS=8 TEST_S=${TEST_S:-300} DETAILS=gpu_suite_s34b_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > "$OUT/gpu_suite_s34b.log" 2>&1
cat "$OUT/gpu_suite_s34b.log"
timeout -s INT ${BENCH_S:-230} python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --no-baselines --presets kivi-2,kivi-4,uniform-int4,kivi-3,kvquant-3 \
  --models llama-3-8b,llama-2-7b --batches 8 --contexts 32768,131072 \
  --name decode_attention_b8_s34 > "$OUT/decode_attention_b8_s34.log" 2>&1
tail -n 24 "$OUT/decode_attention_b8_s34.log"
timeout -s INT ${BENCH2_S:-120} python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --no-baselines --presets kivi-2,kivi-4,uniform-int4 \
  --models llama-3-8b --batches 4,16 --contexts 32768,65536 \
  --name decode_attention_b4_b16_s34 > "$OUT/decode_attention_b4_b16_s34.log" 2>&1
tail -n 16 "$OUT/decode_attention_b4_b16_s34.log"
