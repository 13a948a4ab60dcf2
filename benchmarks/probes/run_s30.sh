# Session 30: the finish kernel (FP16 part + merge in one launch, programmatic dependent of the
# body), A/B on the long rows, then the GPU tests that run through it (one device call).
# Timeouts (230 + 220 + 120 s) keep the whole call inside one 600 s device command.
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout -s INT ${PROBE_S:-230} python3 benchmarks/probes/finish_pdl_ab.py ${ROWS:-} \
  > "$OUT/finish_pdl_ab_s30.log" 2>&1
tail -n 20 "$OUT/finish_pdl_ab_s30.log"
if [ "${TESTS:-1}" = 1 ]; then
  timeout -s INT ${TEST_S:-220} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
    --durations=5 tests/kernels/test_decode_attention.py tests/kernels/test_launch.py \
    tests/integrations/test_decode_loop.py \
    -k "${TESTS_K:-programmatic or finish or lens or tma or realistic or million or steps_do_not or launch or captured}" \
    > "$OUT/gpu_tests_s30.log" 2>&1
  tail -n 25 "$OUT/gpu_tests_s30.log"
fi
if [ "${KVQ:-1}" = 1 ]; then  # kvquant-3 with 64-token key groups beside the preset (G = 32)
  timeout -s INT ${KVQ_S:-120} python3 benchmarks/decode_attention.py --out "$OUT" \
    --skip-quantize-pack --no-baselines --presets kvquant-3,kvquant-3:G=64,kivi-3,kivi-3:G=64 \
    --models llama-3-8b,llama-2-7b --batches 8 --contexts 32768 \
    --name decode_attention_kvquant_g64_s30 > "$OUT/decode_attention_kvquant_g64_s30.log" 2>&1
  tail -n 12 "$OUT/decode_attention_kvquant_g64_s30.log"
fi
