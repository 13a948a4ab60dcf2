#!/usr/bin/env bash
# Session 43:  OUT=... bash benchmarks/probes/run_s43.sh
# Query groups of more than 16 columns per KV head in the Gluon bodies (decode_gluon.column_blocks:
# blocks of 16 columns, one program each; multi-query Falcon / StarCoder shapes, speculative
# verification rows at GQA 4): their GPU cases (register body, KVQuant's full layer, TMA ring),
# the TMA and device-length cases (host-side launch changes), the architectures' GPU tests
# (GPT-BigCode 20:1 and Llama 24:2 through KVBitsCache), in four shards; then decode attention
# at falcon-7b (71/1/64) and starcoder (48/1/128), Gluon beside the Triton kernel and FP16 SDPA,
# and Llama-3-8B with 5 query rows (20 columns) and 4 (16 columns, one block) per sequence.
export PYTHONPATH=src PYTHONUNBUFFERED=1
T=tests/kernels/test_decode_attention.py
SHARDS=4 FILES="$T::test_gluon_variants_match_reference $T::test_gluon_tma_body_matches_reference
  $T::test_device_lengths_inside_bounds $T::test_gluon_tma_inside_cuda_graph
  $T::test_gluon_kvquant_full_device_lengths tests/integrations/test_architectures.py" EXTRA= \
  TEST_S=${TEST_S:-200} DETAILS=gpu_tests_s43_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > $OUT/gpu_tests_s43.log 2>&1
cat $OUT/gpu_tests_s43.log
B="python3 benchmarks/decode_attention.py --skip-quantize-pack --no-baselines --out $OUT"
timeout -s INT ${BENCH_S:-200} $B --models falcon-7b,starcoder --batches 8,1 \
  --contexts 32768,131072 --presets kivi-2,kivi-3,kivi-4,uniform-int4,kvquant-3 \
  --name decode_attention_mqa_s43 > $OUT/decode_attention_mqa_s43.log 2>&1
echo "mqa bench rc=$?"; grep -E "kvbits|sdpa" $OUT/decode_attention_mqa_s43.log | head -80
for R in 5 4; do
  timeout -s INT ${ROWS_S:-70} $B --models llama-3-8b --batches 8 --contexts 32768 \
    --presets kivi-2,kivi-4 --q-rows $R --name decode_attention_rows${R}_s43 \
    > $OUT/decode_attention_rows${R}_s43.log 2>&1
  echo "rows $R bench rc=$?"; grep -E "kvbits|sdpa" $OUT/decode_attention_rows${R}_s43.log
done
