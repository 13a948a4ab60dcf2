# Session 21: the GPU tests of the KVQuant head_dim-256 path and the TMA rule, then the main
# decode table's Llama-3-8B shapes (every preset, baselines), merged with the committed rows.
export PYTHONPATH=src
SEL="gluon_kvquant_full or gluon_tma or kvquant_dispatch or gluon_kvquant_codebooks"
python3 -m pytest -q -p no:cacheprovider --co tests/kernels/test_decode_attention.py -k "$SEL" 2>&1 | tail -1
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_decode_attention.py \
  -k "$SEL" 2>&1 | tail -6 | tee $OUT/kvquant_wide_tests.log
timeout 360 python3 benchmarks/decode_attention.py --out $OUT --skip-quantize-pack \
  --shapes 'llama-3-8b:*:*' --merge benchmarks/results/decode_attention.json 2>&1 | grep -v Warning | tail -5
