# Session 35, second device call: cheap knobs for KVQuant layers in the Gluon register body
# (probes/kvquant_ab.py: the next step's outliers prefetched, L1 prefetch, whole-wave split
# counts), then the Gluon KVQuant GPU tests with the outlier prefetch on.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT ${AB_S:-300} python3 benchmarks/probes/kvquant_ab.py ${ROWS:-} 2>&1 \
  | grep -v -i warn > "$OUT/kvquant_ab_s35.log"
cat "$OUT/kvquant_ab_s35.log"
KVBITS_GLUON_PREFETCH_OUTLIERS=1 timeout -s INT ${TEST_S:-200} python3 -m pytest -q \
  -p no:cacheprovider --tb=short -m gpu -k "kvquant" tests/kernels/test_decode_attention.py \
  2>&1 | tail -n 15 > "$OUT/gpu_tests_s35b.log"
cat "$OUT/gpu_tests_s35b.log"
