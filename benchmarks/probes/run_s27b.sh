# Session 27, second device call: the FastLaunch GPU tests (Keywords launches), Nsight Compute on
# the TMA ring body (stall reasons per issued instruction, shared-memory bank conflicts) at
# Llama-3-8B batch 8 128k, then the decode table for SHAPES merged into the committed one.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 100 python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  tests/kernels/test_launch.py > "$OUT/gpu_tests_s27_launch.log" 2>&1
tail -n 3 "$OUT/gpu_tests_s27_launch.log"
bash benchmarks/probes/ncu_ring.sh ncu_body_s27.log
grep -E "stalled|bank|wavefronts|Issued Warp|Duration|inst_executed" "$OUT/ncu_body_s27.log" | awk '$NF+0 > 0.05 || /bank|wave|inst/' | head -70
cp benchmarks/results/decode_attention.json /tmp/prev.json
timeout -s INT ${BENCH_S:-240} python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --shapes "${SHAPES:-llama-2-7b:*:*}" --merge /tmp/prev.json 2>&1 \
  | grep -v "^skip" | tail -3
ls "$OUT"
