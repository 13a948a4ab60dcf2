# Session 21: the Gluon body's other GPU tests (KIVI, 3-bit planes, codebook-only KVQuant), whose
# generated code the KVQuant head_dim-256 change should leave as it was.
export PYTHONPATH=src
timeout 300 python3 -m pytest -v -p no:cacheprovider tests/kernels/test_decode_attention.py \
  -k "gluon_body_matches or gluon_kvquant_codebooks or gluon_plane" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|passed|failed" | cut -c1-200 | tee $OUT/gpu_tests_s21_body.log
