# One device call for what session 16 built without a GPU: (1) Gemma2's attention-logit
# softcapping in the Triton decode kernel (kernel cases against the reference, and a tiny Gemma2
# model through the CUDA kernels; tiny Gemma3 too, whose sliding layers now evict), (2) keys per
# token at head dims 96 / 256 in the Gluon body
# (decode_gluon.TOKEN_KEYS_WIDE, off until this passes), then the uniform-int4 rows of
# Gemma-2-9B and Phi-3-mini with it on (decode_attention_token_keys_wide.*). GPU pytest under a
# hard timeout, logs in $OUT.
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 240 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_decode_attention.py tests/integrations/test_hf.py \
  -k "softcap or cuda_kernels_in_model or gluon_body_token_keys" \
  > "$OUT/unverified_tests.log" 2>&1
tail -12 "$OUT/unverified_tests.log"
KVBITS_GLUON_TOKEN_KEYS_WIDE=1 timeout -s KILL 200 python3 benchmarks/decode_attention.py \
  --out "$OUT" --skip-quantize-pack --no-baselines --name decode_attention_token_keys_wide \
  --models gemma-2-9b,phi-3-mini --shapes '*:8:32768,*:1:32768' --presets uniform-int4 \
  2>&1 | grep -v "^skip" | cut -c1-150
