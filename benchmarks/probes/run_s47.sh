#!/usr/bin/env bash
# Session 47's GPU jobs:  OUT=... PART=a|b bash benchmarks/probes/run_s47.sh
# PART a: what each part of KVQuant costs at this code, as presets a user can pick (pre-RoPE
#   keys, outliers at 2 per vector = 1% of head_dim 128 rounded up, or 1 = O=0.0078, no
#   outliers, post-RoPE), on four shapes, FP16 SDPA in the same run.
# PART b: shapes no table has used (Yi-34B's 56/8 heads, Qwen2.5-7B's 28/4, Gemma-2-9B's head_dim
#   256, Phi-3-mini's head_dim 96 MHA) at batches 4 and 16 and contexts that are not multiples
#   of 64, for the claim that no KIVI / uniform / FP8 row at >= 4k is slower than FP16.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
case ${PART:-a} in
  a)
    timeout -s INT ${BENCH_S:-540} python3 benchmarks/decode_attention.py --out "$OUT" \
      --skip-quantize-pack --no-baselines --name decode_attention_kvquant_parts_s47 \
      --presets kvquant-3,kvquant-3:O=0.0078,kvquant-3-post,kvquant-3-post:O=0.0078,kvquant-3-dense,kvquant-3-dense-post,kivi-3 \
      --shapes "llama-3-8b:8:32768,llama-3-8b:1:131072,llama-2-7b:8:32768,llama-3-8b:32:32768" \
      > "$OUT/decode_attention_kvquant_parts_s47.log" 2>&1
    echo "bench rc=$?"; grep -v "^skip" "$OUT/decode_attention_kvquant_parts_s47.log" | tail -5 ;;
  b)
    timeout -s INT ${BENCH_S:-540} python3 benchmarks/decode_attention.py --out "$OUT" \
      --skip-quantize-pack --no-baselines --name decode_attention_unseen_s47 \
      --models yi-34b=56/8/128,qwen2.5-7b,gemma-2-9b,phi-3-mini --batches 16,4 \
      --contexts 10000,60001 \
      --presets kivi-2,kivi-4,uniform-int4,fp8-dynamic,kvquant-3-dense-post,kvquant-3 \
      > "$OUT/decode_attention_unseen_s47.log" 2>&1
    echo "bench rc=$?"; grep -v "^skip" "$OUT/decode_attention_unseen_s47.log" | tail -5 ;;
esac
ls "$OUT"
