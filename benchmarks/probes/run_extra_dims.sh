# One device call for the Gluon body at head dims 96 / 192 / 256 (decode_gluon.EXTRA_HEAD_DIMS,
# off until this passes): its GPU tests against the reference (under a hard timeout, log in
# $OUT), then the unseen-shapes rows of Gemma-2-9B (256) and Phi-3-mini (96) with it on
# (decode_attention_extra_dims.*), the Triton kernel's rows of the same layers beside them.
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 200 python3 -m pytest -v -x tests/kernels/test_decode_attention.py \
  -k "gluon_body_matches_reference and (256 or 96 or 192)" -p no:cacheprovider \
  > "$OUT/extra_dims_tests.log" 2>&1
tail -10 "$OUT/extra_dims_tests.log"
KVBITS_GLUON_EXTRA_DIMS=1 timeout -s KILL 240 python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --no-baselines --name decode_attention_extra_dims \
  --models gemma-2-9b,phi-3-mini --shapes '*:8:32768,*:1:32768' \
  --presets kivi-2,kivi-4,k4v2 2>&1 | grep -v "^skip" | cut -c1-150
