#!/usr/bin/env bash
# Session 39, second call:  OUT=... bash benchmarks/probes/run_s39b.sh
# Pre-RoPE keys turned in 16-row blocks (decode_gluon.ROPE_BLOCKS): the Gluon KVQuant GPU tests
# in blocks (1) and at mode 2, then the three modes alternated in captured calls. (As run in
# session 39; mode 2, one shared table with the query turned per block, was removed after it.)
export PYTHONPATH=src PYTHONUNBUFFERED=1
K="gluon_kvquant or realistic_sizes_other_layouts or gluon_variants or gluon_body_matches_reference"
KVBITS_GLUON_ROPE_BLOCKS=1 timeout -s KILL 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore \
  tests/kernels/test_decode_attention.py -k "$K" > $OUT/gpu_tests_s39b.log 2>&1
echo "tests rc=$?"; grep -E "^(E |FAILED)|passed|failed" $OUT/gpu_tests_s39b.log | head -30
KVBITS_GLUON_ROPE_BLOCKS=2 timeout -s KILL 100 python3 -m pytest -q -p no:cacheprovider -m gpu \
  --tb=short -W ignore tests/kernels/test_decode_attention.py -k "gluon_kvquant_full" \
  >> $OUT/gpu_tests_s39b.log 2>&1
echo "mode-2 tests rc=$?"; tail -3 $OUT/gpu_tests_s39b.log
ROPE_AB=1 timeout -s KILL 150 python3 benchmarks/probes/kvquant_ab.py \
  8:32:8:32768:kvquant-3,8:32:8:131072:kvquant-3,8:32:32:32768:kvquant-3,1:32:8:131072:kvquant-3,32:32:8:32768:kvquant-3 \
  > $OUT/kvquant_rope_ab_s39.log 2>&1
echo "rope ab rc=$?"; cat $OUT/kvquant_rope_ab_s39.log
KVBITS_GLUON_ROPE_BLOCKS=1 timeout -s KILL 150 python3 benchmarks/decode_attention.py --out $OUT \
  --skip-quantize-pack --no-baselines --presets kvquant-3,kivi-3 --models llama-3-8b,llama-2-7b \
  --batches 8 --contexts 32768,131072 --name decode_attention_kvquant_blocks_s39 \
  > $OUT/decode_attention_kvquant_blocks_s39.log 2>&1
echo "table rc=$?"; grep -E "kvquant-3|kivi-3|flash" $OUT/decode_attention_kvquant_blocks_s39.md | cut -c1-200
