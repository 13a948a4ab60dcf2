#!/usr/bin/env bash
# Session 62, one device call (an H100, the H200s did not start): the decode-attention table's
# batch-8 rows and a small `kvbits bench` on another GPU than the committed tables' H200, at
# this code (the harness changed since its last GPU run, session 60). Same-run baselines as
# always; these rows add to the H200 tables, they do not replace them.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 380 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
  --presets kivi-2,kivi-4,uniform-int4,kvquant-3 --models llama-3-8b,llama-2-7b --batches 8 \
  --contexts 32768,131072 --name decode_attention_h100_s62 > "$OUT/decode_attention_h100_s62.log" 2>&1
echo "decode_attention exit $?"
timeout 150 python3 -c "import sys; from kvbits.cli import main; sys.exit(main(sys.argv[1:]))" \
  bench --model llama-3-8b --layers 4 --contexts 4k,32k --presets fp16,hf-int2,kivi-2,kivi-2+graphs \
  --steps 16 --out "$OUT" --name e2e_smoke_h100_s62 > "$OUT/e2e_smoke_h100_s62.log" 2>&1
echo "bench exit $?"
tail -n 3 "$OUT/decode_attention_h100_s62.log" "$OUT/e2e_smoke_h100_s62.log"
