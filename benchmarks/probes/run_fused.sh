# Device calls for GreedyDecoder(fuse="inductor") (session 19): PART 1 = its GPU tests (captured
# steps with inductor's kernels against the unfused captured run, plus the existing capture
# tests) and the Llama-2-7B e2e rows; PART 2 = the per-step kernel census
# (benchmarks/probes/step_kernels.py) and the Llama-3-8B rows. Logs and tables in $OUT.
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
case "${1:?usage: run_fused.sh 1|2|3|4}" in
  1) timeout -s KILL 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
       tests/integrations/test_decode_loop.py > "$OUT/fused_tests.log" 2>&1
     tail -8 "$OUT/fused_tests.log"
     timeout -s KILL 330 bash benchmarks/e2e_gpu.sh "$OUT" fused 2>&1 | grep -v "^\s*$" | tail -25 ;;
  2) timeout -s KILL 100 python3 -m pytest -q -p no:cacheprovider -m gpu \
       tests/integrations/test_decode_loop.py -k fused > "$OUT/fused_tests2.log" 2>&1
     tail -3 "$OUT/fused_tests2.log"
     timeout -s KILL 200 python3 benchmarks/probes/step_kernels.py --context 4096 \
       2>&1 | tee "$OUT/step_kernels.log" | tail -60
     timeout -s KILL 330 bash benchmarks/e2e_gpu.sh "$OUT" fused-llama3 2>&1 | grep -v "^\s*$" | tail -25 ;;
esac
# PART 3 / 4: the whole GPU suite at this commit, in two calls (decode-attention kernels; the
# rest), and PART 4 also the kernel census at 32k (the FP16 control's attention against kivi-2's)
case "$1" in
  3) timeout -s KILL 560 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 \
       tests/kernels/test_decode_attention.py > "$OUT/gpu_suite_kernels.log" 2>&1
     tail -14 "$OUT/gpu_suite_kernels.log" ;;
  4) timeout -s KILL 330 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 tests \
       --ignore=tests/kernels/test_decode_attention.py > "$OUT/gpu_suite_rest.log" 2>&1
     tail -14 "$OUT/gpu_suite_rest.log"
     timeout -s KILL 200 python3 benchmarks/probes/step_kernels.py --context 32768 \
       2>&1 | tee "$OUT/step_kernels_32k.log" | grep -v Warn | tail -40 ;;
esac
