#!/usr/bin/env bash
# Session 62, second H100 call: the decode-attention rows run_s62.sh left out (batch 1 and 32 at
# 4k-128k, batch 8 at 4k) for the KIVI, uniform and FP8 presets, FP16 SDPA in the same run,
# so that the "no row at >= 4k slower than FP16" target is checked on a second GPU too.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 330 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack --no-baselines \
  --presets kivi-2,kivi-4,uniform-int4,fp8-dynamic --models llama-3-8b,llama-2-7b --batches 1,32 \
  --contexts 4096,32768,131072 --name decode_attention_h100_s62b > "$OUT/decode_attention_h100_s62b.log" 2>&1
echo "decode_attention b1/b32 exit $?"
timeout 100 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack --no-baselines \
  --presets kivi-2,kivi-4,uniform-int4,fp8-dynamic --models llama-3-8b,llama-2-7b --batches 8 \
  --contexts 4096 --name decode_attention_h100_s62c > "$OUT/decode_attention_h100_s62c.log" 2>&1
echo "decode_attention b8 4k exit $?"
tail -n 4 "$OUT"/decode_attention_h100_s62b.log "$OUT"/decode_attention_h100_s62c.log
