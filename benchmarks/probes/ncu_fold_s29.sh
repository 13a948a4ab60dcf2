# Nsight Compute on the TMA ring with and without the key-scale fold (session 29), kivi-2 at
# Llama-3-8B batch 8 128k: speed of light, occupancy, scheduler statistics, stall reasons and
# pipe utilisation. Needs benchmarks/probes/tma_key_scale_fold_s29.patch applied to commit 5c61ffb
# (the fold was not kept); writes to stdout (benchmarks/results/ncu_fold_s29.log).
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for f in 0 1; do
  echo "== KVBITS_GLUON_FOLD=$f kivi-2 llama-3-8b B=8 T=131072"
  KVBITS_GLUON_FOLD=$f KVBITS_GLUON_TMA=1 PYTHONPATH=src timeout 130 $NCU --clock-control none -k regex:_body_tma -c 1 -s 2 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_fp16.sum,smsp__inst_executed_pipe_tensor.sum,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_lsu.sum,smsp__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,smsp__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,smsp__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,smsp__pipe_fp16_cycles_active.avg.pct_of_peak_sustained_active" \
    python3 benchmarks/probes/ncu_body.py kivi-2 8 131072 2>&1 | grep -v "^nanobind\|^ - \|UserWarning\|warn_once\|^    OPT\|^          "
done
