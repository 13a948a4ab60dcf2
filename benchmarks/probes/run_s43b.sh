#!/usr/bin/env bash
# Session 43, second script:  OUT=... bash benchmarks/probes/run_s43b.sh
# run_s43.sh's tests again (its test logs did not come back: too many files) after the dispatch
# rule for plain KIVI layers past two blocks of columns (decode_gluon.MAX_PLAIN_BLOCKS) and the
# tests' shared gluon_calls fixture: the Gluon variants (rows, windows, more than 16 columns),
# the TMA cases, device lengths, the architectures (GPT-BigCode 20:1, Llama 24:2), the
# integration tests that lift the Gluon size limits (speculative verification rows, Gemma's
# windows, a loaded prefix), in four shards; two files come back.
export PYTHONPATH=src PYTHONUNBUFFERED=1
T=tests/kernels/test_decode_attention.py
SHARDS=4 FILES="$T::test_gluon_variants_match_reference $T::test_gluon_tma_body_matches_reference
  $T::test_device_lengths_inside_bounds $T::test_gluon_tma_inside_cuda_graph
  $T::test_gluon_kvquant_full_device_lengths tests/integrations/test_architectures.py
  tests/integrations/test_hf.py tests/integrations/test_persist.py" EXTRA= \
  TEST_S=${TEST_S:-300} DETAILS=gpu_tests_s43b_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > $OUT/gpu_tests_s43b.log 2>&1
cat $OUT/gpu_tests_s43b.log
