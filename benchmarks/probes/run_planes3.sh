# One device call for the 3-bit Gluon body (decode_gluon.PLANES3; its tests passed in session
# 15 and it is on) and its KVQuant codebook variant: the GPU tests against the reference (under a hard
# timeout, log in $OUT), then kivi-3 and kvquant-3-dense-post through it against the Triton
# kernel and FP16 SDPA, eager and in graph time (kivi-2 for scale).
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 240 python3 -m pytest -v -x tests/kernels/test_decode_attention.py \
  -k "(gluon_body_matches_reference and K3V3) or gluon_kvquant" -p no:cacheprovider \
  > "$OUT/planes3_tests.log" 2>&1
tail -5 "$OUT/planes3_tests.log"
SWEEP_SHAPES=${SWEEP_SHAPES:-32x32x8x32768,8x32x8x32768,8x32x32x32768,1x32x8x131072} \
SWEEP_PF=${SWEEP_PF:-1A} timeout -s KILL 300 python3 benchmarks/gluon_sweep.py kivi-3 \
  kvquant-3-dense-post kivi-2 2>&1 | tee "$OUT/planes3_sweep.log"
