# Session 24: several query rows per sequence (speculative verification) in the Gluon bodies.
# Part 1: the GPU tests of the change (new multi-row cases, drafts verified through the Gluon
# body in a tiny model) and the Gluon regression tests; part 2: the decode table with 4 and 8
# query rows (Gluon rows against the Triton kernel that served them before, FP16 flash SDPA).
export PYTHONPATH=src PYTHONUNBUFFERED=1
PART=${1:-1}
if [ "$PART" = 1 ]; then
timeout -s KILL ${TEST_S:-300} python3 - > "$OUT/gpu_tests_s24_query_rows.log" 2>&1 <<'PY'
import os, sys, pytest
t = "tests/kernels/test_decode_attention.py::"
names = os.environ.get("TESTS", "test_gluon_query_rows_match_reference").split(",")
ids = [n if "::" in n else t + n for n in names]
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--tb=short", "--durations=5", *ids]))
PY
tail -n 60 "$OUT/gpu_tests_s24_query_rows.log"
else
timeout -s KILL 190 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
  --no-baselines --name decode_attention_q_rows4 --q-rows 4 --models llama-2-7b,llama-3-8b \
  --batches 8,1 --contexts 32768,131072 --presets kivi-2,kivi-4 2>&1 | tail -n 40
timeout -s KILL 80 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
  --no-baselines --name decode_attention_q_rows8 --q-rows 8 --models llama-2-7b \
  --batches 8,1 --contexts 32768 --presets kivi-2,kivi-4 2>&1 | tail -n 12
fi
