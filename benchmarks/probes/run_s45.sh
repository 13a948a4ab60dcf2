#!/usr/bin/env bash
# Session 45's first GPU job (prepared in session 44):  OUT=... bash benchmarks/probes/run_s45.sh
# KVQuant with offline key scales (key_scales="calibrated", kvquant-N-offline) on the GPU: the
# Triton kernel's FIXED key-scale row against the reference (written and tested under the
# interpreter only), the store / generate path's GPU tests with it, then its speed beside the
# per-group kvquant presets (the Gluon bodies refuse these layers for now) at Llama-3-8B /
# Llama-2-7B batch 8 32k.
export PYTHONPATH=src PYTHONUNBUFFERED=1
T=tests/kernels/test_decode_attention.py
timeout -s INT 300 python3 -m pytest -q -p no:cacheprovider --tb=short \
  "$T::test_kvquant_offline_key_scales_match_reference" "$T::test_kvquant_layers_match_reference" \
  tests/methods/test_kvquant.py tests/cache/test_store.py -k "offline or kvquant" \
  > $OUT/gpu_tests_s45.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/gpu_tests_s45.log
timeout -s INT ${BENCH_S:-240} python3 benchmarks/decode_attention.py \
  --models llama-2-7b,llama-3-8b --batches 8 --contexts 32768 \
  --presets kvquant-3,kvquant-3-offline,kvquant-2,kvquant-2-offline --skip-quantize-pack \
  --no-baselines --out $OUT --name decode_attention_offline_keys_s45 \
  > $OUT/decode_attention_offline_keys_s45.log 2>&1
echo "bench rc=$?"; grep -E "kvbits|sdpa" $OUT/decode_attention_offline_keys_s45.log | head -30
