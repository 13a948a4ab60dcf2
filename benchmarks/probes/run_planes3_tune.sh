# One device call (session 15's last): 1. the decode table on model shapes the kernels were not
# tuned on (Qwen2.5-7B GQA 7:1, Gemma-2-9B head_dim 256, Phi-3-mini 96, SmolLM2-1.7B 64) at
# batch 8 and 1, 32k, written as decode_attention_other_models.*; 2. the 3-bit Gluon body's
# programs per SM for kivi-3 and kvquant-3-dense-post (gluon_sweep.py, prints only); 3. the
# decode table's Llama-3-8B batch-1 4k shape under the library's 2^16-token rule for 3-bit
# layers, merged into the committed table. Each part under a hard timeout.
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL "${OTHERS_S:-220}" python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --no-baselines --name decode_attention_other_models \
  --models qwen2.5-7b,gemma-2-9b,phi-3-mini,smollm2-1.7b --shapes '*:8:32768,*:1:32768' \
  --presets kivi-2,kivi-3,kivi-4,uniform-int4,fp8-dynamic 2>&1 | grep -v "^skip" | cut -c1-150
SWEEP_SHAPES=${SWEEP_SHAPES:-32x32x8x32768,8x32x8x32768,8x32x32x32768,1x32x8x131072} \
SWEEP_SPLITS=${SWEEP_SPLITS:-0,16,64} SWEEP_PF=${SWEEP_PF:-1A} \
  timeout -s KILL "${SWEEP_S:-100}" python3 benchmarks/gluon_sweep.py kivi-3 kvquant-3-dense-post \
  > "$OUT/planes3_tune.log" 2>&1
cat "$OUT/planes3_tune.log"
cp benchmarks/results/decode_attention.json /tmp/prev.json
timeout -s KILL "${TABLE_S:-60}" python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --shapes 'llama-3-8b:1:4096' --merge /tmp/prev.json 2>&1 \
  | grep -E "kivi-3|dense-post|fp16" | cut -c1-150
