#!/usr/bin/env bash
# Session 51's GPU job, in two device calls:
#   OUT=... bash benchmarks/probes/run_s51.sh suite   # the whole GPU suite at this code, 14 shards
#   OUT=... bash benchmarks/probes/run_s51.sh cold    # per-call cost after session 50's MERGE fix
# suite: session 50's last two kernel-entry changes (the reference's stored_order_mask, the
#   refusal of per-token scale groups that are not a power of two) were tested on the CPU only;
#   plus this session's fixes.
# cold: cold_start_calls_s50.md was measured before the decode kernel's MERGE constexpr became a
#   bool (eager layer steps compiled 32 variants); this re-times the same rows after it.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
case "${1:-suite}" in
  suite)
    SHARDS=${SHARDS:-14} TEST_S=${TEST_S:-330} EXTRA_S=${EXTRA_S:-90} DETAILS=gpu_suite_s51.log \
      bash benchmarks/probes/run_gpu_suite_sharded.sh ;;
  cold)
    timeout -s INT ${BENCH_S:-540} python3 benchmarks/cold_start.py --model llama-3-8b \
      --presets fp16,kivi-2,kivi-2+eager-steps,kivi-4 --calls 16,64,256 --out "$OUT" \
      --name cold_start_calls_s51 2>&1 | tail -n 30 ;;
esac
ls "$OUT"
