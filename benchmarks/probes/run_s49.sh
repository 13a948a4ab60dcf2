#!/usr/bin/env bash
# Session 49's GPU jobs:  OUT=... PART=a|b bash benchmarks/probes/run_s49.sh
# PART a: the whole GPU suite at this code (the Hadamard rotation now sums in float64, on the
#   GPU too; QA fixes of this session), 14 shards, plus the quantize kernels' GPU cases.
# PART b: decode attention with bfloat16 queries and residuals (how Llama-3-style checkpoints
#   run; every committed table is float16), against bfloat16 flash SDPA in the same run.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
case ${PART:-a} in
  a)
    SHARDS=${SHARDS:-14} TEST_S=${TEST_S:-470} DETAILS=gpu_suite_s49.log \
      bash benchmarks/probes/run_gpu_suite_sharded.sh ;;
  b)
    timeout -s INT ${BENCH_S:-500} python3 benchmarks/decode_attention.py --out "$OUT" \
      --skip-quantize-pack --no-baselines --name decode_attention_bf16_s49 --dtype bfloat16 \
      --models llama-3-8b,llama-2-7b --batches 8,1 --contexts 32768,131072 \
      --presets kivi-2,kivi-4,uniform-int4,fp8-dynamic,kvquant-3 \
      > "$OUT/decode_attention_bf16_s49.log" 2>&1
    echo "bench rc=$?"; grep -v "^skip" "$OUT/decode_attention_bf16_s49.log" | tail -5 ;;
esac
ls "$OUT"
