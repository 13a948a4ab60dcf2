# Session 27, second device call: the FastLaunch GPU tests (Keywords launches), Nsight Compute on
# the TMA ring body (stall reasons per issued instruction, shared-memory bank conflicts) at
# Llama-3-8B batch 8 128k, then the decode table for SHAPES merged into the committed one.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 100 python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  tests/kernels/test_launch.py > "$OUT/gpu_tests_s27_launch.log" 2>&1
tail -n 3 "$OUT/gpu_tests_s27_launch.log"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for p in kivi-2 kivi-4; do
  KVBITS_GLUON_TMA=1 timeout 150 $NCU --clock-control none -k regex:_body_tma -c 1 -s 2 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed.sum,smsp__inst_executed_op_shared_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,smsp__sass_inst_executed_op_shared_ld.sum" \
    python3 benchmarks/probes/ncu_body.py $p 8 131072 2>&1 | grep -v "^nanobind\|^ - \|UserWarning\|warn_once\|^    OPT\|^          "
done > "$OUT/ncu_body_s27.log"
grep -E "stalled|bank|wavefronts|Issued Warp|Duration|inst_executed" "$OUT/ncu_body_s27.log" | awk '$NF+0 > 0.05 || /bank|wave|inst/' | head -70
cp benchmarks/results/decode_attention.json /tmp/prev.json
timeout -s INT ${BENCH_S:-240} python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --shapes "${SHAPES:-llama-2-7b:*:*}" --merge /tmp/prev.json 2>&1 \
  | grep -v "^skip" | tail -3
ls "$OUT"
