#!/usr/bin/env bash
# Session 50's GPU job:  OUT=... bash benchmarks/probes/run_s50.sh
# The whole GPU suite at this code (a cache loaded for a config alone now takes the packed path;
# the QA fixes of this session), 14 shards, plus the quantize kernels' GPU cases.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
SHARDS=${SHARDS:-14} TEST_S=${TEST_S:-470} DETAILS=gpu_suite_s50.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh
ls "$OUT"
