#!/usr/bin/env bash
# Session 39, third call:  OUT=... bash benchmarks/probes/run_s39c.sh
# At the final default (ROPE_BLOCKS on): the Gluon KVQuant and variant (window / softcap / rows)
# GPU tests, then the hf integration's GPU tests (the first call's time limit cut its last one).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore -rA \
  tests/kernels/test_decode_attention.py -k "gluon_kvquant or gluon_variants" \
  > $OUT/gpu_tests_s39c.log 2>&1
echo "kernel tests rc=$?"; grep -E "^(E |FAILED)|passed|failed" $OUT/gpu_tests_s39c.log | tail -5
timeout -s KILL 130 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore -rA \
  tests/integrations/test_hf.py >> $OUT/gpu_tests_s39c.log 2>&1
echo "hf tests rc=$?"; grep -E "^(E |FAILED)|passed|failed" $OUT/gpu_tests_s39c.log | tail -5
