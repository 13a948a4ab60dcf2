# Session 31, fourth device call: the captures at the default FP16 routes (the pre-RoPE table
# fix), then kvquant-3 and kivi-2 at Llama-3-8B batch 8 32k in the decode table's code path.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT ${TEST_S:-100} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  tests/integrations/test_decode_loop.py -k "default_fp16_routes" > "$OUT/gpu_tests_s31d.log" 2>&1
tail -n 4 "$OUT/gpu_tests_s31d.log"
timeout -s INT ${BENCH_S:-80} python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --no-baselines --presets kivi-2,kvquant-3 \
  --models llama-3-8b --batches 8 --contexts 32768 \
  --name decode_attention_llama3_b8_s31 > "$OUT/decode_attention_llama3_b8_s31.log" 2>&1
tail -n 8 "$OUT/decode_attention_llama3_b8_s31.log"
