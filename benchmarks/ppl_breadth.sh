#!/usr/bin/env bash
# Perplexity through the cache for the method-breadth presets on SmolLM2-135M (held-out SOTU
# 2010-2016, the settings of ppl_methods.sh, whose fp16 / kivi-2 / kivi-3 rows are the baselines):
#   hadamard: kivi-{2,3}-had (every channel rotated) and kivi-{2,3}-hadc (channel subsets chosen
#             per layer and KV head on 2048 tokens of SOTU 1900-1999) vs kivi-{2,3}, equal bits
#   uniform:  the uniform method vs transformers' own QuantizedCache (quanto, HQQ per-token) at
#             the same knobs (nbits, axis_key=axis_value=0 i.e. per-token, G=64, R=128)
#   fp8:      e4m3 with dynamic (prompt amax) and calibrated (SOTU 1900-1999 amax) scales
#   tune:     kvbits tune --avg-bits 3 (per-layer K/V bits) vs kivi-3, and k4v2 (also 3 bits)
#   qwen, gemma3: Hadamard vs plain KIVI on Qwen2.5-0.5B and Gemma3-270M
# Each part writes benchmarks/results/ppl_breadth_PART.{md,json}; then
# `python benchmarks/ppl_breadth_table.py` merges them into ppl_breadth.{md,json}.
# PARTS="hadamard uniform" benchmarks/ppl_breadth.sh runs some. CPU only, slow (reference path).
set -euo pipefail
cd "$(dirname "$0")/.."
TOKENS=${TOKENS:-1024}
PARTS=${PARTS:-"hadamard uniform fp8 tune qwen gemma3"}
OUT=benchmarks/results
SPEC=$OUT/specs/smollm2-avg3.json
run() {  # part, presets, hf variants, calibrating presets among them (1 / 0)
  local hf=() calib=()
  [ -n "$3" ] && hf=(--hf-quantized "$3")
  # (kvbits refuses --calib-tokens where no preset calibrates, since session 53)
  [ "$4" = 1 ] && calib=(--calib-tokens 2048)
  kvbits ppl --model smollm2 --text sotu-2010-2016 --tokens "$TOKENS" --chunk 256 \
    "${calib[@]}" --presets "$2" "${hf[@]}" \
    --json "$OUT/ppl_breadth_$1.json" --md "$OUT/ppl_breadth_$1.md" --no-progress
}
for part in $PARTS; do
  case $part in
    hadamard) run hadamard kivi-3-had,kivi-2-had,kivi-3-hadc,kivi-2-hadc "" 1 ;;
    uniform) run uniform uniform-int2,uniform-int4 \
      "quanto:int2,quanto:int4,hqq:int2:axis_key=1,axis_value=1,hqq:int4:axis_key=1,axis_value=1" 0 ;;
    fp8) run fp8 fp8-dynamic,fp8 "" 1 ;;
    tune)
      [ -f "$SPEC" ] || kvbits tune --model smollm2 --avg-bits 3 --base kivi-3 -o "$SPEC"
      run tune "$SPEC,k4v2" "" 0 ;;
    qwen|gemma3)  # Hadamard on the other models (own fp16 / kivi baselines)
      model=$([ "$part" = qwen ] && echo qwen2.5-0.5b || echo gemma3-270m)
      kvbits ppl --model "$model" --text sotu-2010-2016 --tokens "$TOKENS" --chunk 256 \
        --calib-tokens 2048 \
        --presets fp16,kivi-2,kivi-2-had,kivi-2-hadc,kivi-3,kivi-3-had,kivi-3-hadc \
        --json "$OUT/ppl_breadth_$part.json" --md "$OUT/ppl_breadth_$part.md" --no-progress ;;
  esac
done
