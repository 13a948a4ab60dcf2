#!/usr/bin/env bash
# Session 40, first call:  OUT=... bash benchmarks/probes/run_s40.sh
# The merge in the stage-1 kernel (KVBITS_MERGE, default "auto"): the whole GPU suite at this
# code (eight shards), then the finish-or-merge A/B (probes/merge_ab.py).
export PYTHONPATH=src PYTHONUNBUFFERED=1
DETAILS=gpu_suite_s40b_details.log TEST_S=${TEST_S:-300} \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > $OUT/gpu_suite_s40b.log 2>&1
cat $OUT/gpu_suite_s40b.log
timeout -s INT ${AB_S:-270} python3 benchmarks/probes/merge_ab.py > $OUT/merge_ab_s40.log 2>&1
echo "merge_ab rc=$?"; cat $OUT/merge_ab_s40.log | cut -c1-400
