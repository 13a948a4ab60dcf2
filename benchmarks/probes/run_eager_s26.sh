# Session 26: what FastLaunch buys an eager user. (1) HF generate per output token, FastLaunch
# off / on against FP16, alternated in one process; (2) the decode table's host-bound shapes
# (batch 1, and batch 8 at 4k) with the current kernels, eager and CUDA-graph time.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL ${AB_S:-150} python3 benchmarks/probes/eager_step_ab.py llama-3-8b 4096 8 3 \
  > "$OUT/eager_step_ab_s26.log" 2>&1
cat "$OUT/eager_step_ab_s26.log"
timeout -s KILL ${BENCH_S:-330} python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --no-baselines --name decode_attention_eager_s26 \
  --shapes "${SHAPES:-llama-3-8b:1:4096,llama-3-8b:1:32768,llama-2-7b:1:4096,llama-2-7b:1:32768,llama-2-7b:8:4096}" \
  --presets "${PRESETS:-kivi-2,kivi-4,k4v2,uniform-int4,fp8-dynamic,kivi-3,kvquant-3}" 2>&1 \
  | grep -v "^skip" | tail -4
