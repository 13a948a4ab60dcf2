#!/usr/bin/env bash
# Session 42:  OUT=... bash benchmarks/probes/run_s42.sh
# Head dims that 32 does not divide in the Gluon body (decode_gluon.PADDED_HEAD_DIMS: 32-channel
# chunks, the last one padded): every GPU test of the decode kernels (the query and store masks
# changed for every head dim) in eight shards, the Llama at head_dim 100 / 40 through the cache;
# then decode attention at Phi-2's (32/32/80) and OpenLLaMA-3B's (32/32/100) shapes, the Gluon
# rows beside the Triton kernel's (triton v4) and FP16 SDPA in the same run.
export PYTHONPATH=src PYTHONUNBUFFERED=1
N=8
for i in $(seq 0 $((N - 1))); do
  KVBITS_TEST_SHARD=$i/$N timeout -s INT ${TEST_S:-230} python3 -m pytest -q -p no:cacheprovider \
    --tb=short -W ignore -m gpu tests/kernels/test_decode_attention.py \
    tests/integrations/test_architectures.py > "$OUT/shard$i.log" 2>&1 &
done
wait
for i in $(seq 0 $((N - 1))); do
  echo "shard $i: $(tail -n 1 $OUT/shard$i.log)"
done > $OUT/gpu_tests_s42.log
grep -h -E "^(FAILED|ERROR)|Error|assert" $OUT/shard*.log | head -n 60 >> $OUT/gpu_tests_s42.log
rm -f $OUT/shard*.log
cat $OUT/gpu_tests_s42.log
timeout -s INT ${BENCH_S:-320} python3 benchmarks/decode_attention.py \
  --models phi-2=32/32/80,openllama-3b=32/32/100 --batches 8,1 --contexts 32768,4096 \
  --presets kivi-2,kivi-4,kivi-3,uniform-int4 --skip-quantize-pack \
  --out $OUT --name decode_attention_padded_s42 > $OUT/decode_attention_padded_s42.log 2>&1
echo "bench rc=$?"; grep -E "FAILED|Error" -A3 $OUT/decode_attention_padded_s42.log | head -20
grep -E "kvbits|sdpa" $OUT/decode_attention_padded_s42.log | head -80
