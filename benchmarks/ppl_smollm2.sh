#!/usr/bin/env bash
# Perplexity through the cache on SmolLM2-135M, 4096 tokens of SOTU 2010-2016, chunks of 256:
# kivi presets and transformers' QuantizedCache (quanto, HQQ: pip install -e ".[incumbents]")
# in one run. Writes benchmarks/results/ppl_smollm2.{md,json}. CPU only; slow (HF QuantizedCache
# re-quantizes the whole history at every chunk, and HQQ runs an optimizer each time).
set -euo pipefail
cd "$(dirname "$0")/.."
kvbits ppl --model smollm2 --text sotu-2010-2016 --tokens 4096 --chunk 256 \
  --presets fp16,kivi-4,kivi-2:G=32,R=128,kivi-2:G=32,R=0 \
  --hf-quantized quanto:int4,quanto:int2,quanto:int2:axis_key=-1,hqq:int2,hqq:int2:axis_key=1,axis_value=1 \
  --json benchmarks/results/ppl_smollm2.json --md benchmarks/results/ppl_smollm2.md "$@"
