#!/usr/bin/env bash
# Session 66, second device call (after run_s65e.sh): the instructions per KV element and the
# issue rate of each preset's decode body at Llama-3-8B batch 8 32k (ncu_insts.sh), then, on an
# H200 only, the measured ceilings of the table's timing there (read_ceiling.py; session 65
# measured them on an H100 only, and the H200's were estimates). Timeouts sum to < 600 s.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
NCU_S=60 bash benchmarks/probes/ncu_insts.sh
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  timeout 200 python3 benchmarks/probes/read_ceiling.py --out "$OUT" 2>&1 | grep -v -i warn \
    | tee "$OUT/read_ceiling_s66.log"
fi
