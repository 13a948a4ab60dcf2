#!/usr/bin/env bash
# Session 42, fourth script:  OUT=... bash benchmarks/probes/run_s42d.sh
# KVQuant's outliers without pre-RoPE keys at head dims other than 64 / 128 / 256 in the Gluon
# body (the kvquant-*-post presets; decode_gluon.KVQUANT_HALVES, straight chunks): the Gluon
# KVQuant GPU tests (codebooks; full layers at every head dim, pre-RoPE or not) and the mixed-width
# cases (k4v2 at 80, k2v4 at 100 added after the last run), and Phi-2's partial rotary head with
# pre-RoPE keys through the kernels (reordered keys and queries), in four shards.
# Not run in session 42 (no device time left): the path is off by default
# (KVBITS_GLUON_KVQUANT_ODD_OUTLIERS); the tests turn it on. If they pass, make it the default.
export PYTHONPATH=src PYTHONUNBUFFERED=1
T=tests/kernels/test_decode_attention.py
SHARDS=4 FILES="$T::test_gluon_kvquant_full_matches_reference $T::test_gluon_body_mixed_bits
  $T::test_gluon_kvquant_codebooks_match_reference
  tests/integrations/test_architectures.py::test_gpu_partial_rotary_pre_rope_keys" EXTRA= \
  TEST_S=${TEST_S:-150} DETAILS=gpu_tests_s42d_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > $OUT/gpu_tests_s42d.log 2>&1
cat $OUT/gpu_tests_s42d.log
# then kvquant-3-post (outliers, post-RoPE keys) at Phi-3-mini's and Phi-2's shapes with the
# straight-chunk outliers on: the Gluon rows beside the Triton kernel's and FP16 SDPA
KVBITS_GLUON_KVQUANT_ODD_OUTLIERS=1 timeout -s INT ${BENCH_S:-200} python3 \
  benchmarks/decode_attention.py --models phi-3-mini,phi-2 --batches 8,1 --contexts 32768 \
  --presets kvquant-3-post --skip-quantize-pack --no-baselines --out $OUT \
  --name decode_attention_kvquant_post_odd > $OUT/decode_attention_kvquant_post_odd.log 2>&1
echo "bench rc=$?"; grep -E "kvbits|sdpa" $OUT/decode_attention_kvquant_post_odd.log | head -20
