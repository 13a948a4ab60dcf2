#!/usr/bin/env bash
# Session 40, fourth call:  OUT=... bash benchmarks/probes/run_s40c.sh
# Head dims that are not multiples of 16 (OpenLLaMA-3B's 100; 40, 24) on the GPU: the decode
# kernel's grid / random / KVQuant cases and the quantize kernels (these tests take the GPU when
# there is one), and the GPU test of a Llama at head_dim 100 / 40 through the cache.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT 240 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore \
  tests/kernels/test_decode_attention.py -k "D100 or D40 or D24 or random_cases or kvquant_layers or padded_halves" \
  > $OUT/gpu_tests_s40d.log 2>&1
echo "decode rc=$?"; tail -n 3 $OUT/gpu_tests_s40d.log
timeout -s INT 120 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore \
  tests/kernels/test_quantize_pack.py tests/integrations/test_architectures.py -k "head_dims or random_cases" \
  >> $OUT/gpu_tests_s40d.log 2>&1
echo "quantize / architectures rc=$?"; tail -n 3 $OUT/gpu_tests_s40d.log
grep -E "^(FAILED|ERROR)|Error" $OUT/gpu_tests_s40d.log | head -20
