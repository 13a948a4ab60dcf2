#!/usr/bin/env bash
# Session 37, one part per device call:  OUT=... bash benchmarks/probes/run_s37.sh 1|2
# 1: decode attention on shapes no table used (odd batches 3 / 12, contexts 6000 / 50000, head
#    dims 128 and 96, GQA 7 / 4 / 1) for kivi-2, kivi-4, uniform-int4 and kvquant-3 against
#    FP16 SDPA in the same run; then the random-layer sweep with a fresh seed (38).
# 2: the whole GPU suite (8 shards) at the session's final code.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
case "${1:?usage: run_s37.sh 1|2}" in
  1) timeout -s KILL 330 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
       --no-baselines --name decode_attention_odd_s37 --batches 3,12 --contexts 6000,50000 \
       --models qwen2.5-7b,llama-3.2-3b=24/8/128,phi-3-mini \
       --presets kivi-2,kivi-4,uniform-int4,kvquant-3 > "$OUT/decode_attention_odd_s37.log" 2>&1
     echo "decode rc=$?"; tail -4 "$OUT/decode_attention_odd_s37.log"
     timeout 200 python3 benchmarks/probes/random_layers_gpu.py --layers 500 --seconds 170 \
       --seed 38 > "$OUT/random_layers_s37.log" 2>&1
     echo "sweep rc=$?"; tail -8 "$OUT/random_layers_s37.log" ;;
  2) SHARDS=8 TEST_S=${TEST_S:-330} DETAILS=gpu_suite_s37_details.log \
       bash benchmarks/probes/run_gpu_suite_sharded.sh > "$OUT/gpu_suite_s37.log" 2>&1
     cat "$OUT/gpu_suite_s37.log" ;;
esac
