#!/usr/bin/env bash
# Session 53's GPU job:
#   OUT=... bash benchmarks/probes/run_s53.sh extras   # the unmarked GPU-capable files, 8 shards
#   OUT=... bash benchmarks/probes/run_s53.sh suite    # the gpu-marked suite, 14 shards
# Session 52's extras pass cut 8 of its 206 tests at 400 s per shard (cold Triton cache); this
# one gives each shard 540 s.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
FILES="tests/kernels/test_quantize_pack.py tests/integrations/test_step_graphs.py tests/integrations/test_decode_loop.py tests/integrations/test_cache_api.py"
case "${1:-suite}" in
  extras) MARK= EXTRA= FILES="$FILES" SHARDS=8 TEST_S=${TEST_S:-540} DETAILS=gpu_suite_s53_extras.log \
            bash benchmarks/probes/run_gpu_suite_sharded.sh ;;
  suite) SHARDS=14 TEST_S=${TEST_S:-330} EXTRA= DETAILS=gpu_suite_s53.log \
            bash benchmarks/probes/run_gpu_suite_sharded.sh ;;
  *) echo "usage: run_s53.sh extras|suite" >&2; exit 2 ;;
esac
cat "$OUT"/gpu_suite_s53*.log
