# Session 28, one device call: the TMA ring with scale rows interleaved by 16-byte chunks
# (decode_gluon_tma.key_scale_tile / value_scale_tile). Its GPU tests (the ring's kernel cases,
# the store's whole-step capacities, a captured generation through the ring), the body kernel
# against session 27's ring (probes/tma_ring_s27.py) alternated in one process, and Nsight
# Compute's bank conflicts and stalls at Llama-3-8B batch 8 128k.
# OUT: the device tool's output folder. TEST_S / AB_S: time limits (s).
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout -s KILL ${TEST_S:-260} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  tests/kernels/test_decode_attention.py tests/integrations/test_decode_loop.py \
  -k "${TEST_K:-tma or offsets_past_int32 or whole_steps}" > "$OUT/gpu_tests_s28.log" 2>&1
tail -n 6 "$OUT/gpu_tests_s28.log"
timeout -s KILL ${AB_S:-170} python3 benchmarks/probes/tma_ring_ab.py benchmarks/probes/tma_ring_s27.py \
  2>&1 | grep -v Warning | tee "$OUT/tma_ring_ab_s28.log"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for p in kivi-2 kivi-4; do
  KVBITS_GLUON_TMA=1 timeout 100 $NCU --clock-control none -k regex:_body_tma -c 1 -s 2 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed.sum,smsp__inst_executed_op_shared_ld.sum" \
    python3 benchmarks/probes/ncu_body.py $p 8 131072 2>&1 | grep -v "^nanobind\|^ - \|UserWarning\|warn_once\|^    OPT\|^          "
done > "$OUT/ncu_body_s28.log"
grep -E "bank|wavefronts|Issued Warp|Duration|short_scoreboard|inst_executed.sum" "$OUT/ncu_body_s28.log" | head -30
