# Session 32, first device call: the whole GPU suite at this code (8 shards; session 31 ran it
# before its last two fixes, then only their tests), beside it the decode kernel's own test file
# on the GPU (its unmarked cases run on CUDA there: float32 queries now dequantize in float32 and
# multiply without TF32, against a 2e-5 budget), then the Llama-3-8B and Llama-2-7B batch-8 rows
# of the decode table at the new defaults (FP16 flash SDPA in the same run), then the host-time
# breakdown of eager calls.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout -s INT ${KERNEL_TEST_S:-300} python3 -m pytest -q -p no:cacheprovider --tb=short \
  -m "not gpu" tests/kernels/test_decode_attention.py > "$OUT/kernel_tests_cuda.log" 2>&1 &
SHARDS=8 TEST_S=${TEST_S:-300} DETAILS=gpu_suite_s32_details.log \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > "$OUT/gpu_suite_s32.log" 2>&1
wait
grep -E "FAILED|ERROR|passed|failed" "$OUT/kernel_tests_cuda.log" | head -n 30 > "$OUT/kernel_tests_cuda_s32.log"
rm -f "$OUT/kernel_tests_cuda.log"
cat "$OUT/gpu_suite_s32.log" "$OUT/kernel_tests_cuda_s32.log"
timeout -s INT ${BENCH_S:-200} python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --no-baselines --presets kivi-2,kivi-4,uniform-int4,kivi-3,kvquant-3 \
  --models llama-3-8b,llama-2-7b --batches 8 --contexts 32768,131072 \
  --name decode_attention_b8_s32 > "$OUT/decode_attention_b8_s32.log" 2>&1
tail -n 24 "$OUT/decode_attention_b8_s32.log"
timeout -s INT ${HOST_S:-90} python3 benchmarks/probes/decode_host_breakdown.py \
  1:32:8:4096:kivi-2,8:32:8:32768:kivi-2,1:32:32:4096:kivi-2 > "$OUT/host_breakdown_s32.log" 2>&1
cat "$OUT/host_breakdown_s32.log"
