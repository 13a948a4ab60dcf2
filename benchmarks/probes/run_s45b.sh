#!/usr/bin/env bash
# Session 45's second GPU job:  OUT=... bash benchmarks/probes/run_s45b.sh
# The Gluon body reading offline key scales (KFIX: one fixed key scale row for every group):
# its tests against the reference beside the per-group KVQuant Gluon tests (the same loads,
# threaded with the flag), the store / generate paths with offline presets; then the speed of
# kvquant-N-offline beside kvquant-N at Llama-2-7B / Llama-3-8B batch 8 32k (and Llama-3-8B
# batch 1); then random layers through every body, offline presets included.
export PYTHONPATH=src PYTHONUNBUFFERED=1
T=tests/kernels/test_decode_attention.py
timeout -s INT ${TEST_S:-250} python3 -m pytest -q -p no:cacheprovider --tb=short \
  "$T::test_gluon_kvquant_offline_keys_match_reference" \
  "$T::test_kvquant_offline_key_scales_match_reference" \
  "$T::test_gluon_kvquant_full_matches_reference" "$T::test_gluon_kvquant_codebooks_match_reference" \
  tests/cache/test_store.py tests/methods/test_kvquant.py -k "offline or gluon_kvquant" \
  > $OUT/gpu_tests_s45b.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests_s45b.log | tail -8
timeout -s INT ${BENCH_S:-200} python3 benchmarks/decode_attention.py \
  --models llama-3-8b,llama-2-7b --batches 8 --contexts 32768 \
  --presets kvquant-3,kvquant-3-offline,kvquant-4,kvquant-4-offline,kvquant-2-offline \
  --skip-quantize-pack --no-baselines --out $OUT --name decode_attention_offline_gluon_s45 \
  > $OUT/decode_attention_offline_gluon_s45.log 2>&1
echo "bench rc=$?"; grep -E "kvbits|sdpa" $OUT/decode_attention_offline_gluon_s45.log | head -30
timeout -s INT ${SWEEP_S:-110} python3 benchmarks/probes/random_layers_gpu.py --seed 45 \
  --gluon-all --seconds ${SWEEP_DRAW_S:-80} > $OUT/random_layers_s45.log 2>&1
echo "sweep rc=$?"; tail -4 $OUT/random_layers_s45.log
