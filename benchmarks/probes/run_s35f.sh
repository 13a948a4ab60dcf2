# Session 35: Nsight Compute on KVQuant's full layer in the Gluon register body (Llama-3-8B
# batch 8 32k) against its codebook-only layer: stall reasons, issue rate, occupancy, local
# memory (spills), for the next KVQuant kernel work.
export PYTHONPATH=src PYTHONUNBUFFERED=1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
for p in kvquant-3 kvquant-3-dense-post; do
  timeout 200 $NCU --clock-control none -k regex:_body_kernel -c 1 -s 2 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section LaunchStats --section MemoryWorkloadAnalysis_Tables \
    --metrics smsp__inst_executed.sum,smsp__inst_executed_op_local_ld.sum,smsp__inst_executed_op_local_st.sum,smsp__inst_executed_op_global_ld.sum \
    python3 benchmarks/probes/ncu_body.py $p 8 32768 2>&1 | grep -v "^nanobind\|^ - \|UserWarning\|warn_once"
done > "$OUT/ncu_kvquant_s35.log"
grep -E "Duration|Registers|Achieved Occupancy|Issued Ipc|Warp Cycles Per Issued|Stall|inst_executed|done|ncu:" "$OUT/ncu_kvquant_s35.log" | head -80
