# One device call for the head_dim-256 Gluon body (decode_gluon.HEAD_DIM_256, off until this
# passes): its GPU tests against the reference (under a hard timeout, log in $OUT), then the
# unseen-shapes table for Gemma-2-9B with it on (decode_attention_other_models_d256.*), against
# the Triton kernel's rows in the same run.
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 200 python3 -m pytest -v -x tests/kernels/test_decode_attention.py \
  -k "gluon_body_matches_reference and D=256" -p no:cacheprovider > "$OUT/d256_tests.log" 2>&1
tail -8 "$OUT/d256_tests.log"
KVBITS_GLUON_D256=1 timeout -s KILL 200 python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --no-baselines --name decode_attention_other_models_d256 \
  --models gemma-2-9b --shapes '*:8:32768,*:1:32768,*:32:32768' \
  --presets kivi-2,kivi-4,k4v2 2>&1 | grep -v "^skip" | cut -c1-150
