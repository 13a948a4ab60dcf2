# Session 24, last GPU call: the rest of the GPU suite at the session's final kernel code (the
# tests this session already ran on it are left out: see gpu_tests_s24_*.log), with the new
# save/load GPU cases; then the quick decode table (two shapes) as a no-regression check of the
# one-row path against decode_attention.md.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL ${TEST_S:-470} python3 -m pytest -q -p no:cacheprovider --tb=short --durations=5 \
  -m gpu tests -k "not gluon_body_matches_reference and not query_rows and not tma_body_matches \
  and not tma_window_and_softcap and not kvquant_full_window and not test_device_lengths_inside_bounds \
  and not rejected_drafts" > "$OUT/gpu_suite_s24_rest.log" 2>&1
tail -n 12 "$OUT/gpu_suite_s24_rest.log"
timeout -s KILL 100 python3 benchmarks/decode_attention.py --out "$OUT" --quick --skip-quantize-pack \
  --no-baselines --presets kivi-2,kivi-4 --name decode_attention_quick_s24 2>&1 | tail -n 10
