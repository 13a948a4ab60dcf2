#!/usr/bin/env bash
# KIVI and KVQuant with 64-token key groups (and 64-channel value groups at head_dim 64) beside
# the G = 32 presets of the frontier tables: same models, texts, token counts and calibration
# (SOTU 1900-1999) as ppl_lee_news*.md and ppl_methods.md. CPU, ~25 min on 2 cores.
#   bash benchmarks/ppl_group64.sh
set -euo pipefail
cd "$(dirname "$0")/.."
P="fp16,kivi-2:G=64,kivi-2:G=64,S=1,kivi-3:G=64,kivi-3:G=64,S=1,kivi-4:G=64,kvquant-2:G=64,kvquant-3:G=64,kvquant-4:G=64"
run() {  # model text tokens name
  kvbits ppl --model "$1" --text "$2" --tokens "$3" --chunk 256 --calib-tokens 2048 --presets "$P" \
    --json "benchmarks/results/$4.json" --md "benchmarks/results/$4.md" --no-progress
}
run smollm2 lee-news 4096 ppl_group64_lee_news
run smollm2 sotu-2010-2016 1024 ppl_group64_methods
run qwen2.5-0.5b lee-news 2048 ppl_group64_lee_news_qwen
run gemma3-270m lee-news 2048 ppl_group64_lee_news_gemma3
