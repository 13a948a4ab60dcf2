# Second device call of session 18 for the Gluon body's KVQuant layers, after trimming its step
# (sm_90 SASS per 64-token step 4835 -> 4570 instructions at GQA 4, 4853 -> 4559 at MHA, spills
# 424 -> 248 bytes): outliers read as one 16-bit word of indices and one 32-bit word of values
# per token, indices made float16 by an OR instead of I2F, pre-RoPE key outliers combined with
# per-row coefficients. Its GPU tests, then the kvquant-3 rows of the long shapes.
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
  -k "gluon_kvquant" > "$OUT/kvquant_gluon2_tests.log" 2>&1
tail -6 "$OUT/kvquant_gluon2_tests.log"
timeout -s KILL 220 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
  --no-baselines --name decode_attention_kvquant2 --presets kvquant-3 \
  --shapes '*:32:32768,*:32:131072,*:8:32768,*:8:131072,*:1:131072' \
  2>&1 | grep -v "^skip" | cut -c1-150
