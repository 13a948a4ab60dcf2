#!/usr/bin/env bash
# Session 44's second GPU job:  OUT=... bash benchmarks/probes/run_s44b.sh
# The whole GPU suite (8 shards) with kvquant-4 on the Gluon body by default; then the random-layer
# sweep with a fresh seed (44), every layer a Gluon body is eligible for sent there
# (--gluon-all) and 12-32 query heads per KV head among the draws (--wide-groups: column blocks).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
# (run with TEST_S=330, which cut shard 4 off after its 31 tests' compiles: they passed alone in
# 378 s, gpu_shard4_s44.log; 480 leaves room)
SHARDS=8 TEST_S=${TEST_S:-480} DETAILS=gpu_suite_s44_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > "$OUT/gpu_suite_s44.log" 2>&1
cat "$OUT/gpu_suite_s44.log"
timeout 200 python3 benchmarks/probes/random_layers_gpu.py --layers 500 --seconds ${SWEEP_S:-170} \
  --seed 44 --gluon-all --wide-groups > "$OUT/random_layers_s44.log" 2>&1
echo "sweep rc=$?"; grep -c "body=gluon" "$OUT/random_layers_s44.log"; tail -8 "$OUT/random_layers_s44.log"
