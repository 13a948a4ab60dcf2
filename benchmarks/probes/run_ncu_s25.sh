#!/bin/bash
# Session 25: Nsight Compute on the Gluon TMA body (stall reasons, bank conflicts, occupancy).
OUT=${1:-/tmp}
export PYTHONPATH=src PYTHONUNBUFFERED=1 KVBITS_GLUON_TMA=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
for p in kivi-2 kivi-4; do
  timeout 240 $NCU --clock-control none -k regex:_body_tma -c 1 -s 2 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section InstructionStats --section MemoryWorkloadAnalysis_Tables --section LaunchStats \
    --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed.sum,smsp__inst_executed_op_ldsm.sum,smsp__inst_executed_op_shared_ld.sum \
    python3 benchmarks/probes/ncu_body.py $p 8 131072 2>&1 | grep -v "^nanobind\|^ - \|UserWarning\|warn_once"
done | tee $OUT/ncu_body_s25.log
