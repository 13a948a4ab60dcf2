# One device call: the Gluon GPU tests (TESTS=0 skips), then the decode table for SHAPES merged
# into the committed one (rows of other shapes kept), stopped after BENCH_S seconds (the JSON and
# Markdown are rewritten after every shape).
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm --format=csv
if [ "${TESTS:-1}" != 0 ]; then
  python3 -m pytest -q -x tests/kernels/test_decode_attention.py -k "gluon" 2>&1 | tail -3
fi
cp benchmarks/results/decode_attention.json /tmp/prev.json
timeout "${BENCH_S:-400}" python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
  --shapes "${SHAPES:-*:32:*,*:8:*}" --merge /tmp/prev.json 2>&1 | grep -v "^skip" | tail -5
