#!/usr/bin/env bash
# Session 55's GPU jobs:  OUT=... bash benchmarks/probes/run_s55.sh [a|b]
# Per-token key scales (the uniform method) folded out of the key operands (decode_gluon.KEY_FOLD).
# a: the TMA ring (head_dim 128): its GPU tests against the reference, fold on and off; body
#    kernel alone, fold vs dequantized operands (probes/tma_uniform_ab.py --key-fold); the uniform
#    rows of the decode table where issue 5's 3x target is missed, FP16 SDPA in the run.
# b: the register body too (head dims 64 and 128, at most 8 score columns): its token-key GPU
#    tests fold on and off, the ring's again, uniform-int4 decode loops through the cache; body
#    alone fold vs not (--key-fold --register); head_dim-64 rows of the decode table.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
case "${1:-a}" in
a)
  timeout ${TEST_S:-240} python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_decode_attention.py \
    -k "tma_token_scales or tma_body_matches or gluon_body_offsets_past_int32" 2>&1 | tail -4
  timeout ${AB_S:-150} python3 benchmarks/probes/tma_uniform_ab.py --key-fold 2>&1 | tee "$OUT/tma_key_fold_ab_s55.log"
  timeout -s INT ${BENCH_S:-150} python3 benchmarks/decode_attention.py --out "$OUT" \
    --skip-quantize-pack --no-baselines --name decode_attention_key_fold_s55 \
    --models llama-3-8b,llama-2-7b --contexts 32768,131072 --batches 8 \
    --presets uniform-int4,uniform-int2 2>&1 | grep -v "^skip" | tail -12 ;;
b)
  timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
    -k "token_keys or tma_token_scales or tma_body_matches" 2>&1 | tail -4
  timeout ${TEST2_S:-150} python3 -m pytest -q -p no:cacheprovider tests/integrations/test_decode_loop.py \
    -k "uniform" 2>&1 | tail -3
  timeout ${AB_S:-150} python3 benchmarks/probes/tma_uniform_ab.py --key-fold --register 2>&1 \
    | tee "$OUT/register_key_fold_ab_s55.log"
  timeout -s INT ${BENCH_S:-150} python3 benchmarks/decode_attention.py --out "$OUT" \
    --skip-quantize-pack --no-baselines --name decode_attention_key_fold_d64_s55 \
    --models llama-3.2-1b=32/8/64,smollm2-1.7b --contexts 32768 --batches 8,1 \
    --presets uniform-int4,uniform-int2 2>&1 | grep -v "^skip" | tail -12 ;;
esac
ls "$OUT"
