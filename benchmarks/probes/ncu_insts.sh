#!/usr/bin/env bash
# Session 66: the instructions a decode body executes per KV element, and its issue rate, under
# Nsight Compute, one preset after another at Llama-3-8B batch 8 32k (probes/ncu_body.py). With
# the SM clock and the scheduler count these bound the body's time from below at a perfect
# issue rate (one warp instruction per scheduler per cycle): the arithmetic of issue 4's
# kvquant-3 target. Writes $OUT/ncu_insts_s66.log. PRESETS / B / T override; NCU_S: limit each.
cd "$(dirname "$0")/../.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for p in ${PRESETS:-kvquant-3 kvquant-3-dense-post kivi-3 kivi-4 uniform-int4 kivi-2}; do
  echo "=== $p B=${B:-8} T=${T:-32768}"
  timeout ${NCU_S:-90} $NCU --clock-control none -k regex:_body -c 1 -s 3 \
    --metrics "smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread,smsp__inst_executed_op_local_ld.sum" \
    python3 benchmarks/probes/ncu_body.py $p ${B:-8} ${T:-32768} 2>&1 \
    | grep -E "^===|_body|inst_executed|issue_active|cycles_elapsed|time_duration|warps_active|bytes_read|grid_size|registers|done|Error|error" 
done 2>&1 | tee "$OUT/ncu_insts_s66.log"
