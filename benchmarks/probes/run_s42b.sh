#!/usr/bin/env bash
# Session 42, second script:  OUT=... bash benchmarks/probes/run_s42b.sh
# The padded-chunk Gluon body's cases the first run did not reach (uniform-int4's per-token keys
# at head_dim 80 / 100, whose test had built 16-channel value groups) and the Llama at head
# dims 100 / 80 / 40 through KVBitsCache with the Gluon body made to serve its small steps; then
# decode attention at Llama-3-8B batch 8 32k (no change expected: the masks are compile-time) and
# at Phi-2's shape with KVQuant (kvquant-3: pre-RoPE keys, the Triton kernel; its codebook-only
# variant through the padded Gluon body), FP16 SDPA in the same run.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore \
  tests/kernels/test_decode_attention.py -k "token_keys or padded" \
  tests/integrations/test_architectures.py::test_gpu_head_dims_not_multiples_of_16 \
  > $OUT/gpu_tests_s42b.log 2>&1
tail -n 1 $OUT/gpu_tests_s42b.log; grep -E "^(FAILED|ERROR)|Error|assert" $OUT/gpu_tests_s42b.log | head -30
timeout -s INT ${BENCH_S:-300} python3 benchmarks/decode_attention.py \
  --models llama-3-8b,phi-2=32/32/80 --batches 8,1 --contexts 32768 \
  --presets kivi-2,kivi-4,uniform-int4,kvquant-3,kvquant-3-dense-post --skip-quantize-pack \
  --out $OUT --name decode_attention_s42b > $OUT/decode_attention_s42b.log 2>&1
echo "bench rc=$?"; grep -E "FAILED|Error" -A3 $OUT/decode_attention_s42b.log | head -20
grep -E "kvbits|sdpa" $OUT/decode_attention_s42b.log | head -60
