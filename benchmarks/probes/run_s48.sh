#!/usr/bin/env bash
# Session 48's GPU jobs:  OUT=... PART=a|b bash benchmarks/probes/run_s48.sh
# PART a: the whole GPU suite at this code (session 47 changed the quantize kernels' scale at the
#   top of FP16's range; the Gluon quantize kernel had only compiled on the CPU), 14 shards, plus
#   the quantize kernels' unmarked GPU cases.
# PART b: the batch-4 rows of session 47's unseen shapes, which its call's time limit cut
#   (Yi-34B 56/8/128, Qwen2.5-7B, Gemma-2-9B, Phi-3-mini; contexts 10000 / 60001).
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
case ${PART:-a} in
  a)
    SHARDS=${SHARDS:-14} TEST_S=${TEST_S:-470} DETAILS=gpu_suite_s48.log \
      bash benchmarks/probes/run_gpu_suite_sharded.sh ;;
  b)
    timeout -s INT ${BENCH_S:-480} python3 benchmarks/decode_attention.py --out "$OUT" \
      --skip-quantize-pack --no-baselines --name decode_attention_unseen_b4_s48 \
      --models yi-34b=56/8/128,qwen2.5-7b,gemma-2-9b,phi-3-mini --batches 4 \
      --contexts 10000,60001 \
      --presets kivi-2,kivi-4,uniform-int4,fp8-dynamic,kvquant-3-dense-post,kvquant-3 \
      > "$OUT/decode_attention_unseen_b4_s48.log" 2>&1
    echo "bench rc=$?"; grep -v "^skip" "$OUT/decode_attention_unseen_b4_s48.log" | tail -5 ;;
esac
ls "$OUT"
