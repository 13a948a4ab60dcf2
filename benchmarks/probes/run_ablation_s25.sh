#!/bin/bash
# Session 25: the Gluon body's dequant arithmetic removed (timing only), one variant per process.
#   bash benchmarks/probes/run_ablation_s25.sh OUT
OUT=${1:-/tmp}
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for v in ${VARIANTS:-base one-fma no-fma values-no-fma keys-no-fma}; do
  timeout 150 python3 benchmarks/probes/dequant_ablation.py $v 2>&1 | grep -v "^nanobind\|^ - \|UserWarning\|warn_once"
done | tee -a $OUT/dequant_ablation_s25.log
