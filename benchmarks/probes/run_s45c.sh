#!/usr/bin/env bash
# Session 45's third GPU job:  OUT=... bash benchmarks/probes/run_s45c.sh
# KVQuant at 2 bits through the Gluon body (decode_gluon.KVQUANT2, switched on by the tests and
# here): codebooks alone, the full layer (outliers, pre-RoPE keys), offline key rows, and a
# tiny Llama through KVBitsCache (with 4 bits beside it, and 3-bit full layers as a check of the
# shared code); then kvquant-2 / kvquant-2-offline on it beside the Triton kernel.
export PYTHONPATH=src PYTHONUNBUFFERED=1
T=tests/kernels/test_decode_attention.py
timeout -s INT ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider --tb=short \
  "$T::test_gluon_kvquant_codebooks_match_reference" "$T::test_gluon_kvquant_full_matches_reference" \
  "$T::test_gluon_kvquant_offline_keys_match_reference" \
  tests/integrations/test_architectures.py::test_gpu_kvquant_codebooks_through_the_gluon_body \
  -k "K2V2 or through_the_gluon_body or (K3V3 and out2 and rope1)" \
  > $OUT/gpu_tests_s45c.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests_s45c.log | tail -12
KVBITS_GLUON_KVQUANT2=1 timeout -s INT ${BENCH_S:-150} python3 benchmarks/decode_attention.py \
  --models llama-3-8b,llama-2-7b --batches 8 --contexts 32768 \
  --presets kvquant-2,kvquant-2-offline,kvquant-2-dense-post \
  --skip-quantize-pack --no-baselines --out $OUT --name decode_attention_kvquant2_gluon_s45 \
  > $OUT/decode_attention_kvquant2_gluon_s45.log 2>&1
echo "bench rc=$?"; grep -E "kvbits|sdpa" $OUT/decode_attention_kvquant2_gluon_s45.log | head -20
