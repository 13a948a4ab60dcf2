# Session 24: the prefix-caching flow on the GPU (a loaded cache, a multi-row question through
# the Gluon body, graph-replayed decoding), and 4 query rows for the other presets the Gluon
# body serves (uniform-int4, kivi-3 planes, kvquant-3's full layer).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/integrations/test_persist.py -m gpu > "$OUT/gpu_tests_s24_persist.log" 2>&1
tail -n 4 "$OUT/gpu_tests_s24_persist.log"
timeout -s KILL 170 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
  --no-baselines --name decode_attention_q_rows4_presets --q-rows 4 \
  --models llama-2-7b,llama-3-8b --batches 8 --contexts 32768 \
  --presets uniform-int4,kivi-3,kvquant-3 2>&1 | tail -n 16
