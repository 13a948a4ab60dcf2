# Session 28: the GPU test suite at the session's final kernel code, in two device calls
# (PART=1: tests/kernels/test_decode_attention.py; PART=2: every other GPU test).
export PYTHONPATH=src PYTHONUNBUFFERED=1
if [ "${PART:-1}" = 1 ]; then
  FILES="tests/kernels/test_decode_attention.py"; DESEL=""
else
  FILES="tests"; DESEL="--ignore=tests/kernels/test_decode_attention.py"
fi
timeout -s INT ${TEST_S:-540} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  --durations=5 $FILES $DESEL > "$OUT/gpu_suite_s28_part${PART:-1}.log" 2>&1
tail -n 14 "$OUT/gpu_suite_s28_part${PART:-1}.log"
