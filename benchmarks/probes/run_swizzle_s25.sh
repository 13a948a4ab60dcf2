#!/bin/bash
# Session 25: the TMA ring with 128-byte-swizzled word tiles: GPU tests, time, bank conflicts.
OUT=${1:-/tmp}
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 150 python3 benchmarks/probes/dequant_ablation.py base 2>&1 | grep variant | tee $OUT/swizzle_time.log
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
KVBITS_GLUON_TMA=1 timeout 100 $NCU --clock-control none -k regex:_body_tma -c 1 -s 2 \
  --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__inst_executed.sum,gpu__time_duration.sum,launch__registers_per_thread \
  python3 benchmarks/probes/ncu_body.py kivi-2 8 131072 2>&1 | grep -E "l1tex|smsp|gpu__|launch__|done" | tee -a $OUT/swizzle_time.log
timeout 330 python3 -m pytest -q -m gpu tests/kernels/test_decode_attention.py -k "tma" 2>&1 | tail -15 > $OUT/swizzle_tests.log
tail -3 $OUT/swizzle_tests.log
