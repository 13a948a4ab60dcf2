# Session 27, one device call: the launch GPU tests and a decode sample (Keywords launches), the
# host time per call, then the decode table for SHAPES merged into the committed one.
# OUT: the device tool's output folder. TEST_S / BENCH_S: time limits (s).
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout -s KILL ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  tests/kernels/test_launch.py tests/kernels/test_decode_attention.py \
  -k "${TEST_K:-launch or realistic or do_not_recompile or gluon_variants}" \
  > "$OUT/gpu_tests_s27${TAG}.log" 2>&1
tail -n 4 "$OUT/gpu_tests_s27${TAG}.log"
timeout -s KILL 90 python3 benchmarks/probes/decode_host_breakdown.py \
  1:32:8:4096:kivi-2,8:32:32:4096:kivi-2 2>&1 | grep -v Warning > "$OUT/host_breakdown_s27${TAG}.log"
cat "$OUT/host_breakdown_s27${TAG}.log"
cp benchmarks/results/decode_attention.json /tmp/prev.json
timeout -s INT ${BENCH_S:-330} python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --shapes "${SHAPES:-llama-3-8b:*:*}" --merge /tmp/prev.json 2>&1 \
  | grep -v "^skip" | tail -4
ls "$OUT"
