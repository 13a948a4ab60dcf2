# Nsight Compute on the TMA ring body (decode_gluon_tma), kivi-2 and kivi-4 at Llama-3-8B batch 8
# 128k (probes/ncu_body.py): speed of light, occupancy, scheduler statistics, stall reasons per
# issued instruction and shared-memory bank conflicts / wavefronts. Writes $OUT/$1.
# Used by run_s27b.sh (session 27) and run_s28.sh (session 28, whose run left out the last two
# metrics). NCU_S: time limit per preset (s).
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for p in kivi-2 kivi-4; do
  KVBITS_GLUON_TMA=1 timeout ${NCU_S:-150} $NCU --clock-control none -k regex:_body_tma -c 1 -s 2 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed.sum,smsp__inst_executed_op_shared_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,smsp__sass_inst_executed_op_shared_ld.sum" \
    python3 benchmarks/probes/ncu_body.py $p 8 131072 2>&1 | grep -v "^nanobind\|^ - \|UserWarning\|warn_once\|^    OPT\|^          "
done > "$OUT/$1"
