#!/usr/bin/env bash
# Session 42, third script:  OUT=... bash benchmarks/probes/run_s42c.sh
# KVQuant's pre-RoPE keys at head dims other than 64 / 128 / 256 in the Gluon body
# (decode_gluon.KVQUANT_HALVES: each rotate-half half in 32-channel chunks of its own, padded):
# every GPU test of the decode kernels (the key loads and query operands changed for every
# layout) in eight shards with the Llama at head dims 100 / 80 / 40 through the cache; then
# kvquant-3 at Phi-3-mini's (96), Phi-2's (80) and OpenLLaMA-3B's (100) shapes, Gluon beside the
# Triton kernel and FP16 SDPA in the same run.
export PYTHONPATH=src PYTHONUNBUFFERED=1
# (the sharded runner: eight pytest processes on the one GPU, each every eighth test)
FILES="tests/kernels/test_decode_attention.py tests/integrations/test_architectures.py" EXTRA= \
  TEST_S=${TEST_S:-240} DETAILS=gpu_tests_s42c_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > $OUT/gpu_tests_s42c.log 2>&1
cat $OUT/gpu_tests_s42c.log
timeout -s INT ${BENCH_S:-240} python3 benchmarks/decode_attention.py \
  --models phi-3-mini,phi-2=32/32/80,openllama-3b=32/32/100 --batches 8,1 --contexts 32768 \
  --presets kvquant-3 --skip-quantize-pack --no-baselines \
  --out $OUT --name decode_attention_kvquant_halves_s42 > $OUT/decode_attention_kvquant_halves_s42.log 2>&1
echo "bench rc=$?"; grep -E "FAILED|Error" -A3 $OUT/decode_attention_kvquant_halves_s42.log | head -20
grep -E "kvbits|sdpa" $OUT/decode_attention_kvquant_halves_s42.log | head -40
