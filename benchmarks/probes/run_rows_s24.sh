# Session 24: several query rows per sequence (speculative verification) in the Gluon bodies.
# The GPU tests of the change (new multi-row cases, drafts verified through the Gluon body in a
# tiny model) and the Gluon regression tests, then the decode table with 4 and 8 query rows
# (Gluon rows against the Triton kernel that served them before, FP16 flash SDPA).
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 300 python3 - > "$OUT/gpu_tests_s24_query_rows.log" 2>&1 <<'PY'
import sys, pytest
t = "tests/kernels/test_decode_attention.py::"
ids = [t + n for n in ("test_gluon_query_rows_match_reference", "test_gluon_tma_window_and_softcap",
                       "test_gluon_kvquant_full_window_and_softcap",
                       "test_device_lengths_inside_bounds", "test_gluon_tma_body_matches_reference",
                       "test_gluon_body_matches_reference")]
ids.insert(1, "tests/integrations/test_hf.py::test_rejected_drafts_leave_no_trace")
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--durations=5", *ids]))
PY
tail -n 30 "$OUT/gpu_tests_s24_query_rows.log"
timeout -s KILL 190 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
  --no-baselines --name decode_attention_q_rows4 --q-rows 4 --models llama-2-7b,llama-3-8b \
  --batches 8,1 --contexts 32768,131072 --presets kivi-2,kivi-4 2>&1 | tail -n 40
timeout -s KILL 80 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
  --no-baselines --name decode_attention_q_rows8 --q-rows 8 --models llama-2-7b \
  --batches 8,1 --contexts 32768 --presets kivi-2,kivi-4 2>&1 | tail -n 12
