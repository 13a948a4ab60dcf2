#!/usr/bin/env bash
# Session 41, second script:  OUT=... bash benchmarks/probes/run_s41b.sh
# Per-token scale groups with a shorter last group (QuantSpec.value_group: 32 + 32 + 32 + 4
# channels at head_dim 100, 32 + 32 + 16 at 80, instead of gcd(G, D) = 4 / 16): on the GPU the
# decode cases at those head dims (grid, scale axes, KVQuant, random), the quantize kernels at
# every head dim, the Llama at head_dim 100 / 40 through the cache; then decode attention at
# OpenLLaMA-3B's shape again (decode_attention_hd100_s41 had 4-channel value groups).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT 130 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore \
  tests/kernels/test_decode_attention.py -k "D100 or D80 or D40 or D24 or axes" \
  > $OUT/gpu_tests_s41b.log 2>&1 &
timeout -s INT 130 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore \
  tests/kernels/test_quantize_pack.py tests/reference/test_quant.py \
  tests/integrations/test_architectures.py::test_gpu_head_dims_not_multiples_of_16 \
  > $OUT/gpu_tests_s41b_quantize.log 2>&1 &
wait
for f in $OUT/gpu_tests_s41b.log $OUT/gpu_tests_s41b_quantize.log; do
  echo "$f: $(tail -n 1 $f)"; grep -E "^(FAILED|ERROR)" $f | head -10
done
timeout -s INT ${BENCH_S:-150} python3 benchmarks/decode_attention.py --models openllama-3b=32/32/100 \
  --batches 8,1 --contexts 4096,32768 --presets kivi-2,kivi-4,kvquant-3,uniform-int4 --skip-quantize-pack \
  --out $OUT --name decode_attention_hd100_s41b > $OUT/decode_attention_hd100_s41b.log 2>&1
echo "bench rc=$?"; grep -E "FAILED" -A3 $OUT/decode_attention_hd100_s41b.log | head -20
grep -E "kvbits" $OUT/decode_attention_hd100_s41b.md | cut -d'|' -f3,4,8,9,10,11,13,16,17,18,19
