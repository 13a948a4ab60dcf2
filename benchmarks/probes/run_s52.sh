#!/usr/bin/env bash
# Session 52's GPU job, one device call:
#   OUT=... bash benchmarks/probes/run_s52.sh          # suite
#   OUT=... bash benchmarks/probes/run_s52.sh extras   # the unmarked files alone, 8 shards
# The whole GPU suite at this code (14 shards), and after the gpu-marked tests of each shard, as
# unmarked tests that must pass or skip cleanly on a CUDA machine: the quantize kernels against
# the reference, and the generate / step-graph / Cache-API files (session 51's QA run on the H200
# found test_the_mode_on_the_kernels handing CPU tensors to the compiled kernels; the
# interpreter-only tests now skip outside TRITON_INTERPRET).
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
FILES="tests/kernels/test_quantize_pack.py tests/integrations/test_step_graphs.py tests/integrations/test_decode_loop.py tests/integrations/test_cache_api.py"
if [ "${1:-suite}" = extras ]; then  # (in the suite their 150 s per shard cut several short)
  for i in $(seq 0 7); do
    KVBITS_TEST_SHARD=$i/8 timeout -s INT 400 python3 -m pytest -q -p no:cacheprovider \
      --tb=short -rfEs $FILES > "$OUT/extras_shard$i.log" 2>&1 &
  done
  wait
  grep -h -E "passed|failed|error|SKIPPED|FAILED|ERROR|Interrupt" "$OUT"/extras_shard*.log \
    > "$OUT/gpu_suite_s52_extras.log"
  rm -f "$OUT"/extras_shard*.log
  cat "$OUT/gpu_suite_s52_extras.log"
  exit 0
fi
SHARDS=${SHARDS:-14} TEST_S=${TEST_S:-330} EXTRA_S=${EXTRA_S:-150} DETAILS=gpu_suite_s52.log \
  EXTRA="$FILES" \
  bash benchmarks/probes/run_gpu_suite_sharded.sh
ls "$OUT"
