#!/usr/bin/env bash
# Session 44's first GPU job:  OUT=... bash benchmarks/probes/run_s44.sh
# KVQuant at 4 bits in the Gluon body (decode_gluon.KVQUANT4: 16-entry tables, written in
# session 43 and off until these pass): the Gluon KVQuant cases (codebooks; full layers at every
# head dim, 3 and 4 bits), the variants (windows, rows, column blocks), the dispatch tests, in
# four shards; then kvquant-4 / kvquant-4-dense-post at Llama-2-7B / Llama-3-8B batch 8 / 1 32k
# with the switch on, Gluon beside the Triton kernel and FP16 SDPA. If the tests pass, turn
# KVQUANT4 on by default (README "Which kernel attends a layer", the chooser's kvquant-4 row).
export PYTHONPATH=src PYTHONUNBUFFERED=1
T=tests/kernels/test_decode_attention.py
SHARDS=4 FILES="$T::test_gluon_kvquant_codebooks_match_reference
  $T::test_gluon_kvquant_full_matches_reference $T::test_gluon_variants_match_reference
  $T::test_gluon_kvquant_dispatch $T::test_gluon_kvquant_full_device_lengths
  tests/integrations/test_architectures.py::test_gpu_kvquant4_through_the_gluon_body" EXTRA= \
  TEST_S=${TEST_S:-240} DETAILS=gpu_tests_s44_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > $OUT/gpu_tests_s44.log 2>&1
cat $OUT/gpu_tests_s44.log
KVBITS_GLUON_KVQUANT4=1 timeout -s INT ${BENCH_S:-240} python3 benchmarks/decode_attention.py \
  --models llama-2-7b,llama-3-8b --batches 8,1 --contexts 32768 \
  --presets kvquant-4,kvquant-4-dense-post,kvquant-3 --skip-quantize-pack --no-baselines \
  --out $OUT --name decode_attention_kvquant4_s44 > $OUT/decode_attention_kvquant4_s44.log 2>&1
echo "bench rc=$?"; grep -E "kvbits|sdpa" $OUT/decode_attention_kvquant4_s44.log | head -40
