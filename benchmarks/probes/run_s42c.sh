#!/usr/bin/env bash
# Session 42, third script:  OUT=... bash benchmarks/probes/run_s42c.sh
# KVQuant's pre-RoPE keys at head dims other than 64 / 128 / 256 in the Gluon body
# (decode_gluon.KVQUANT_HALVES: each rotate-half half in 32-channel chunks of its own, padded):
# every GPU test of the decode kernels (the key loads and query operands changed for every
# layout) in eight shards with the Llama at head dims 100 / 80 / 40 through the cache; then
# kvquant-3 at Phi-3-mini's (96), Phi-2's (80) and OpenLLaMA-3B's (100) shapes, Gluon beside the
# Triton kernel and FP16 SDPA in the same run.
export PYTHONPATH=src PYTHONUNBUFFERED=1
N=8
for i in $(seq 0 $((N - 1))); do
  KVBITS_TEST_SHARD=$i/$N timeout -s INT ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider \
    --tb=short -W ignore -m gpu tests/kernels/test_decode_attention.py \
    tests/integrations/test_architectures.py > "$OUT/shard$i.log" 2>&1 &
done
wait
for i in $(seq 0 $((N - 1))); do
  echo "shard $i: $(tail -n 1 $OUT/shard$i.log)"
done > $OUT/gpu_tests_s42c.log
grep -h -E "^(FAILED|ERROR)|Error|assert" $OUT/shard*.log | head -n 60 >> $OUT/gpu_tests_s42c.log
rm -f $OUT/shard*.log
cat $OUT/gpu_tests_s42c.log
timeout -s INT ${BENCH_S:-240} python3 benchmarks/decode_attention.py \
  --models phi-3-mini,phi-2=32/32/80,openllama-3b=32/32/100 --batches 8,1 --contexts 32768 \
  --presets kvquant-3 --skip-quantize-pack --no-baselines \
  --out $OUT --name decode_attention_kvquant_halves_s42 > $OUT/decode_attention_kvquant_halves_s42.log 2>&1
echo "bench rc=$?"; grep -E "FAILED|Error" -A3 $OUT/decode_attention_kvquant_halves_s42.log | head -20
grep -E "kvbits|sdpa" $OUT/decode_attention_kvquant_halves_s42.log | head -40
