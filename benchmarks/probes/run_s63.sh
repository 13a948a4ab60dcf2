#!/usr/bin/env bash
# Session 63, first device call: the whole GPU suite at this code (session 62's kernel-entry
# checks and review mends have not run on a GPU) and, beside it, random layers through the
# library's dispatch. Correctness only, so both share the GPU; the shard count follows the
# card's memory (13 shards ran out of memory on an 80 GB H100 in session 62).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu_s63.txt"
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
if [ "${MEM:-0}" -gt 100000 ]; then SHARDS=${SHARDS:-11}; else SHARDS=${SHARDS:-7}; fi
(timeout 500 python3 benchmarks/probes/random_layers_gpu.py --layers 120 --seed 63 --gluon-all \
   --seconds 380 > "$OUT/random_layers_s63.log" 2>&1
 echo "random layers exit $?" >> "$OUT/random_layers_s63.log") &
SHARDS=$SHARDS TEST_S=460 DETAILS=gpu_suite_s63.txt bash benchmarks/probes/run_gpu_suite_sharded.sh
wait
tail -n 4 "$OUT/random_layers_s63.log"
