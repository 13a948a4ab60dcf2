#!/usr/bin/env bash
# Session 42, fourth script:  OUT=... bash benchmarks/probes/run_s42d.sh
# KVQuant's outliers without pre-RoPE keys at head dims other than 64 / 128 / 256 in the Gluon
# body (the kvquant-*-post presets; decode_gluon.KVQUANT_HALVES, straight chunks): the Gluon
# KVQuant GPU tests (codebooks; full layers at every head dim, pre-RoPE or not) in four shards.
# Not run in session 42 (no device time left): the path is off by default
# (KVBITS_GLUON_KVQUANT_ODD_OUTLIERS); the tests turn it on. If they pass, make it the default.
export PYTHONPATH=src PYTHONUNBUFFERED=1
SHARDS=4 FILES="tests/kernels/test_decode_attention.py -k gluon_kvquant" EXTRA= \
  TEST_S=${TEST_S:-150} DETAILS=gpu_tests_s42d_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > $OUT/gpu_tests_s42d.log 2>&1
cat $OUT/gpu_tests_s42d.log
