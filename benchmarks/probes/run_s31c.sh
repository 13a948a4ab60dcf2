# Session 31, third device call: the GPU tests of the decode loop (eager and captured runs now
# pinned to one FP16 route) and of the finish kernel's routes, then the Llama-3-8B batch-8 rows
# of the decode table at the session's defaults (FP16 flash SDPA in the same run).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT ${TEST_S:-170} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  tests/integrations/test_decode_loop.py tests/kernels/test_decode_attention.py \
  -k "decode_loop or finish or side or gpu_captured or fused_pointwise" > "$OUT/gpu_tests_s31c.log" 2>&1
tail -n 6 "$OUT/gpu_tests_s31c.log"
timeout -s INT ${BENCH_S:-200} python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --no-baselines --presets kivi-2,kivi-4,uniform-int4,kvquant-3 \
  --models llama-3-8b --batches 8 --contexts 32768,131072 \
  --name decode_attention_llama3_b8_s31 > "$OUT/decode_attention_llama3_b8_s31.log" 2>&1
tail -n 14 "$OUT/decode_attention_llama3_b8_s31.log"
