#!/usr/bin/env bash
# Session 50's GPU job:  OUT=... bash benchmarks/probes/run_s50.sh
# 1. The whole GPU suite at this code (a cache loaded for a config alone now takes the packed
#    path; track_flushes' copies saved mid-verification; the QA fixes of this session), 14
#    shards, plus the quantize kernels' GPU cases.
# 2. The rows where issue 3 / 5 targets are missed, re-measured at this code (float16, FP16
#    flash SDPA in the same run): Llama-3-8B batch 8 32k / 128k, and Llama-2-7B batch 8 32k.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
SHARDS=${SHARDS:-14} TEST_S=${TEST_S:-330} EXTRA_S=${EXTRA_S:-90} DETAILS=gpu_suite_s50.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh
for args in "--models llama-3-8b --contexts 32768,131072" "--models llama-2-7b --contexts 32768"; do
  timeout -s INT ${BENCH_S:-110} python3 benchmarks/decode_attention.py --out "$OUT" \
    --skip-quantize-pack --no-baselines --name "decode_attention_check_s50_${args:9:10}" \
    $args --batches 8 --presets kivi-2,kivi-4,uniform-int4 \
    >> "$OUT/decode_attention_check_s50.log" 2>&1
  echo "bench rc=$?"
done
grep -v "^skip" "$OUT/decode_attention_check_s50.log" | tail -20
ls "$OUT"
