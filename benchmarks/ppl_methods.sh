#!/usr/bin/env bash
# Perplexity through the cache for the KV methods on SmolLM2-135M: FP16, KIVI, KVQuant (and its
# ablations: -dense = no outliers, -post = keys quantized after RoPE) and per-token uniform
# quantization (transformers' QuantizedCache with quanto, axis_key=-1: keys per token).
# kvquant presets are calibrated once on SOTU 1900-1999 (cached), evaluated on SOTU 2010-2016.
# Writes benchmarks/results/ppl_methods.{md,json}; then `python benchmarks/ppl_methods_bits.py`
# adds the effective bits per element. CPU only, slow (reference path).
set -euo pipefail
cd "$(dirname "$0")/.."
TOKENS=${TOKENS:-1024}
kvbits ppl --model smollm2 --text sotu-2010-2016 --tokens "$TOKENS" --chunk 256 --calib-tokens 2048 \
  --presets fp16,kivi-4,kvquant-4,kivi-3,kvquant-3,kivi-2,kvquant-2,kvquant-3-dense,kvquant-3-post,kvquant-2-dense,kvquant-2-post,kvquant-4-dense \
  --hf-quantized quanto:int4:axis_key=-1,quanto:int2:axis_key=-1 \
  --json benchmarks/results/ppl_methods.json --md benchmarks/results/ppl_methods.md --no-progress "$@"
