# One device call for KVQuant's full layers through the Gluon body (decode_gluon.KVQUANT_FULL,
# written in session 18 without a GPU): its GPU tests against the reference (with the rest of the
# Gluon body's and the CUDA-kernels-in-a-model tests, which the same change touches), then the
# kvquant-3 rows of the decode benchmark with it on (decode_attention_kvquant.*). GPU pytest
# under a hard timeout, logs in $OUT.
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 300 python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_decode_attention.py tests/integrations/test_hf.py \
  -k "gluon_kvquant or cuda_kernels_in_model or kvquant_layers or gluon_body_matches" \
  > "$OUT/kvquant_gluon_tests.log" 2>&1
tail -15 "$OUT/kvquant_gluon_tests.log"
KVBITS_GLUON_KVQUANT=1 timeout -s KILL 260 python3 benchmarks/decode_attention.py \
  --out "$OUT" --skip-quantize-pack --no-baselines --name decode_attention_kvquant \
  --presets kvquant-3,kvquant-3-dense-post ${SHAPES:+--shapes "$SHAPES"} \
  2>&1 | grep -v "^skip" | cut -c1-150
