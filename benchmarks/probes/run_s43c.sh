#!/usr/bin/env bash
# Session 43, third script:  OUT=... bash benchmarks/probes/run_s43c.sh
# The 8-bit presets in decode attention (issue 3 scope: bits 2, 4, 8), never in the tables:
# kivi-8, k8v4, uniform-int8 and kvquant-4 (Triton kernel) beside FP16 SDPA in the same run,
# Llama-2-7B and Llama-3-8B at batch 1 / 8 / 32 and 4k / 32k contexts.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT ${BENCH_S:-330} python3 benchmarks/decode_attention.py --skip-quantize-pack \
  --no-baselines --models llama-2-7b,llama-3-8b --batches 32,8,1 --contexts 4096,32768 \
  --presets kivi-8,k8v4,uniform-int8,kvquant-4 --out $OUT --name decode_attention_8bit_s43 \
  > $OUT/decode_attention_8bit_s43.log 2>&1
echo "bench rc=$?"; grep -E "kvbits|sdpa" $OUT/decode_attention_8bit_s43.log
