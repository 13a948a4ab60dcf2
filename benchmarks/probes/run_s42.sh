#!/usr/bin/env bash
# Session 42:  OUT=... bash benchmarks/probes/run_s42.sh
# Head dims that 32 does not divide in the Gluon body (decode_gluon.PADDED_HEAD_DIMS: 32-channel
# chunks, the last one padded): every GPU test of the decode kernels (the query and store masks
# changed for every head dim) in eight shards, the Llama at head_dim 100 / 40 through the cache;
# then decode attention at Phi-2's (32/32/80) and OpenLLaMA-3B's (32/32/100) shapes, the Gluon
# rows beside the Triton kernel's (triton v4) and FP16 SDPA in the same run.
export PYTHONPATH=src PYTHONUNBUFFERED=1
# (the sharded runner: eight pytest processes on the one GPU, each every eighth test)
FILES="tests/kernels/test_decode_attention.py tests/integrations/test_architectures.py" EXTRA= \
  TEST_S=${TEST_S:-230} DETAILS=gpu_tests_s42_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > $OUT/gpu_tests_s42.log 2>&1
cat $OUT/gpu_tests_s42.log
timeout -s INT ${BENCH_S:-320} python3 benchmarks/decode_attention.py \
  --models phi-2=32/32/80,openllama-3b=32/32/100 --batches 8,1 --contexts 32768,4096 \
  --presets kivi-2,kivi-4,kivi-3,uniform-int4 --skip-quantize-pack \
  --out $OUT --name decode_attention_padded_s42 > $OUT/decode_attention_padded_s42.log 2>&1
echo "bench rc=$?"; grep -E "FAILED|Error" -A3 $OUT/decode_attention_padded_s42.log | head -20
grep -E "kvbits|sdpa" $OUT/decode_attention_padded_s42.log | head -80
