#!/usr/bin/env bash
# Session 20: models and shapes no earlier table measured, on one H200, one part per device call.
#   OUT=... bash benchmarks/probes/run_unseen.sh 1|2
# 1: kvbits bench (generate loop, random weights) on the Mistral-7B and Qwen2.5-7B configs,
#    batch 1, 4k and 32k: FP16 flash generate, the FP16 control in the same captured+fused loop,
#    kivi-2 / kivi-4 in it. 2: decode_attention on shapes of other models (Yi-34B 56/8/128,
#    Qwen2.5-7B 28/4/128, Command-R 64/8/128, Gemma-2-9B 16/8/256), batch 1 and 8, 32k and 128k.
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
case "${1:?usage: run_unseen.sh 1|2}" in
  1) for m in mistral-7b qwen2.5-7b; do
       timeout -s KILL 270 python3 -m kvbits.cli bench --model $m --contexts 4k,32k \
         --presets fp16-flash,kvbits-fp16+graphs+fused,kivi-2+graphs+fused,kivi-4+graphs+fused \
         --out "$OUT" --name "e2e_unseen_${m//./_}" 2>&1 | grep -v "^\s*$" | tail -12
     done ;;
  2) timeout -s KILL 480 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
       --name decode_attention_unseen --batches 8,1 --contexts 32768,131072 \
       --models yi-34b=56/8/128,qwen2.5-7b,command-r=64/8/128,gemma-2-9b \
       --presets kivi-2,kivi-4,kvquant-3 2>&1 | grep -v "^\s*$" | tail -40 ;;
esac
# 3: after the pre-RoPE tile rule at head_dim > 128: the KVQuant kernel tests on the GPU, then the
#    Gemma-2-9B-shaped rows again (kvquant-3 and its dense-post form).
case "$1" in
  3) timeout -s KILL 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
       -k "kvquant" > "$OUT/kvquant_tests_session20.log" 2>&1; tail -3 "$OUT/kvquant_tests_session20.log"
     timeout -s KILL 300 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
       --no-baselines --name decode_attention_unseen_wide --batches 8,1 --contexts 32768,131072 \
       --models gemma-2-9b --presets kvquant-3,kvquant-3-dense-post 2>&1 | grep -v "^\s*$" | tail -20 ;;
esac
# 4: the memory-budget search on an unseen model: Qwen2.5-7B config (4 KV heads), 32k, 80 GB.
case "$1" in
  4) timeout -s KILL 570 python3 -m kvbits.cli bench --model qwen2.5-7b --contexts 32k \
       --presets fp16,kivi-4,kivi-2 --steps 16 --memory-budget 80GB --budget-contexts 32k \
       --batch-cap 256 --out "$OUT" --name e2e_budget32k_qwen2_5_7b 2>&1 | grep -v "^\s*$" | tail -20 ;;
esac
