#!/usr/bin/env bash
# Session 38, one call:  OUT=... bash benchmarks/probes/run_s38.sh 1
# 1: the step-graph tests on the GPU (each layer's one-token steps replayed from CUDA graphs
#    inside transformers' generate), the decode-loop / generate / hf GPU tests beside them; then
#    eager generate() at batch 1 (and SmolLM2 at batch 16): FP16 flash SDPA against kivi-2 /
#    kivi-4 with step graphs (the default) and without (+eager-steps), in the same run.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
case "${1:?usage: run_s38.sh 1}" in
  1) timeout -s KILL 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
       tests/integrations/test_step_graphs.py tests/integrations/test_decode_loop.py \
       tests/integrations/test_graph_generate.py tests/integrations/test_hf.py \
       > "$OUT/gpu_tests_s38.log" 2>&1
     echo "tests rc=$?"; tail -15 "$OUT/gpu_tests_s38.log"
     for m in llama-3-8b llama-2-7b; do
       timeout -s KILL 150 python3 benchmarks/e2e.py --out "$OUT" --model $m --contexts 4k,32k \
         --presets fp16-flash,kivi-2,kivi-2+eager-steps,kivi-4,kivi-4+eager-steps \
         --name e2e_step_graphs_${m//[-.]/_} >> "$OUT/e2e_step_graphs_s38.log" 2>&1
       echo "$m rc=$?"
     done
     timeout -s KILL 120 python3 benchmarks/e2e.py --out "$OUT" --model smollm2 --contexts 1k,8k \
       --batches 1,16 --presets fp16-flash,kivi-2,kivi-2+eager-steps,kivi-4+eager-steps,kivi-4 \
       --name e2e_step_graphs_smollm2 >> "$OUT/e2e_step_graphs_s38.log" 2>&1
     echo "smollm2 rc=$?"; grep "tok/s" "$OUT/e2e_step_graphs_s38.log" ;;
esac
