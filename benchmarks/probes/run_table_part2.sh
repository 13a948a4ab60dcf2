# Session 21: the main decode table's Llama-2-7B shapes merged with part 1's rows, then the GPU
# tests of KVQuant's head_dim-256 cases and the TMA rule, one line per test.
export PYTHONPATH=src
timeout 220 python3 benchmarks/decode_attention.py --out $OUT --skip-quantize-pack \
  --shapes 'llama-2-7b:*:*' --merge benchmarks/results/decode_attention.json 2>&1 | grep -v Warning | tail -3
timeout 270 python3 -m pytest -v -p no:cacheprovider tests/kernels/test_decode_attention.py \
  -k "(gluon_kvquant_full and 256) or gluon_tma or gluon_kvquant_full_device" 2>&1 \
  | grep -E "PASSED|FAILED|ERROR|passed|failed" | cut -c1-220 | tee $OUT/gpu_tests_s21.log
