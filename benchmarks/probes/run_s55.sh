#!/usr/bin/env bash
# Session 55's GPU job:  OUT=... bash benchmarks/probes/run_s55.sh
# Per-token key scales (the uniform method) folded out of the TMA ring's key operands
# (decode_gluon_tma.KEY_FOLD): 1. the ring's GPU tests against the reference, fold on and off;
# 2. body kernel alone, fold vs dequantized operands (probes/tma_uniform_ab.py --key-fold); 3. the
# uniform rows of the decode table where issue 5's 3x target is missed, FP16 SDPA in the run.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout ${TEST_S:-240} python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_decode_attention.py \
  -k "tma_token_scales or tma_body_matches or gluon_body_offsets_past_int32" 2>&1 | tail -4
timeout ${AB_S:-150} python3 benchmarks/probes/tma_uniform_ab.py --key-fold 2>&1 | tee "$OUT/tma_key_fold_ab_s55.log"
timeout -s INT ${BENCH_S:-150} python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --no-baselines --name decode_attention_key_fold_s55 \
  --models llama-3-8b,llama-2-7b --contexts 32768,131072 --batches 8 \
  --presets uniform-int4,uniform-int2 2>&1 | grep -v "^skip" | tail -12
ls "$OUT"
