#!/usr/bin/env bash
# Session 41:  OUT=... bash benchmarks/probes/run_s41.sh
# Head dims that are not multiples of 16 (OpenLLaMA-3B's 100; 40, 24) on the GPU: the decode
# kernel's grid and KVQuant cases at those dims, the quantize kernels at every head dim, the
# Llama at head dim 100 / 40 through the cache (kernel vs reference logits); then decode
# attention at OpenLLaMA-3B's shape (32/32/100) against FP16 SDPA and the baselines in the same
# run. (The first call of the session ran the decode cases only, 13 passed: `-k` deselected the
# others; its benchmark failed in the seed baseline at head_dim 100, whose V words span whole
# channel groups: skipped there now)
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore \
  tests/kernels/test_decode_attention.py -k "D100 or D40 or D24" > $OUT/gpu_tests_s41.log 2>&1
echo "decode head dims rc=$?"; tail -n 2 $OUT/gpu_tests_s41.log
timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider --tb=short -W ignore \
  tests/kernels/test_quantize_pack.py::test_bits_groups_head_dims \
  tests/integrations/test_architectures.py::test_gpu_head_dims_not_multiples_of_16 \
  >> $OUT/gpu_tests_s41.log 2>&1
echo "quantize / architectures rc=$?"; tail -n 2 $OUT/gpu_tests_s41.log
grep -E "^(FAILED|ERROR)|Error" $OUT/gpu_tests_s41.log | head -20
timeout -s INT ${BENCH_S:-220} python3 benchmarks/decode_attention.py --models openllama-3b=32/32/100 \
  --batches 8,1 --contexts 4096,32768 --presets kivi-2,kivi-4,kvquant-3,uniform-int4 --skip-quantize-pack \
  --out $OUT --name decode_attention_hd100_s41 > $OUT/decode_attention_hd100_s41.log 2>&1
echo "bench rc=$?"; grep -E "FAILED|failed|File" -A3 $OUT/decode_attention_hd100_s41.log | head -30
tail -n 25 $OUT/decode_attention_hd100_s41.md | cut -c1-300
