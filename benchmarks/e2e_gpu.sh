#!/usr/bin/env bash
# End-to-end evidence on one GPU, one part per device call (each well under 5 minutes on an H200):
#   bash benchmarks/e2e_gpu.sh OUT_DIR PART
# PART: llama2 | llama3 | smollm2 | graphs | graphs-llama2 | fused | fused-llama3 | budget | budget32k |
#       budget-presize | million
# Random weights everywhere (configs only, no network). Copy OUT_DIR/* into benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: e2e_gpu.sh OUT_DIR PART}"
part="${2:?usage: e2e_gpu.sh OUT_DIR PART}"
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
bench() { python3 benchmarks/e2e.py --out "$out" "$@" 2>&1 | tee -a "$out/e2e_$part.log"; }
case "$part" in
  llama2) bench --model llama-2-7b --contexts 1k,4k,16k,32k --presets fp16,fp16-flash,hf-int2,kivi-4,kivi-2 \
            --name e2e_llama2_7b ;;
  llama3) bench --model llama-3-8b --contexts 1k,4k,16k,32k --presets fp16,fp16-flash,hf-int2,kivi-4,kivi-2 \
            --name e2e_llama3_8b ;;
  smollm2) bench --model smollm2 --contexts 1k,2k,4k,8k --batches 1,16 \
            --presets fp16,fp16-flash,hf-int2,kivi-4,kivi-2 --name e2e_smollm2 ;;
  graphs) bench --model llama-3-8b --contexts 4k,32k \
            --presets fp16-flash,fp16+graphs,kvbits-fp16+graphs,kivi-2,kivi-2+graphs,kivi-4+graphs \
            --name e2e_graphs_llama3_8b ;;
  graphs-llama2) bench --model llama-2-7b --contexts 4k,32k \
            --presets fp16-flash,fp16+graphs,kvbits-fp16+graphs,kivi-2,kivi-2+graphs,kivi-4+graphs \
            --name e2e_graphs_llama2_7b ;;
  fused) bench --model llama-2-7b --contexts 4k,32k \
            --presets fp16-flash,kvbits-fp16+graphs,kivi-2+graphs,kvbits-fp16+graphs+fused,kivi-2+graphs+fused,kivi-4+graphs+fused,kivi-3+graphs+fused \
            --name e2e_fused_llama2_7b ;;
  fused-llama3) bench --model llama-3-8b --contexts 4k,32k \
            --presets fp16-flash,kvbits-fp16+graphs,kivi-2+graphs,kvbits-fp16+graphs+fused,kivi-2+graphs+fused,kivi-4+graphs+fused \
            --name e2e_fused_llama3_8b ;;
  budget) bench --model llama-2-7b --contexts 4k --presets fp16,hf-int2,kivi-4,kivi-2 --steps 16 \
            --memory-budget 80GB --budget-contexts 4k --name e2e_budget_llama2_7b ;;
  budget32k) bench --model llama-2-7b --contexts 32k --presets fp16,hf-int2,kivi-4,kivi-2 --steps 16 \
            --memory-budget 80GB --budget-contexts 32k --name e2e_budget32k_llama2_7b ;;
  budget-presize) bench --model llama-2-7b --contexts 4k --presets fp16,kivi-4,kivi-2 --steps 16 \
            --memory-budget 80GB --budget-contexts 4k --presize --name e2e_budget_llama2_7b_presize ;;
  million) python3 benchmarks/million_tokens.py --out "$out" 2>&1 | tee -a "$out/million_tokens.log" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
