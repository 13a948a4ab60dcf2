# Session 32, third device call: the GPU tests of graph_generate and the decode loop after the
# cache's back-reference became weak, then generate() eager against graph_generate with the
# steady time per token and the per-call overhead (captures) apart.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  tests/integrations/test_graph_generate.py tests/integrations/test_decode_loop.py \
  > "$OUT/gpu_tests_s32c_full.log" 2>&1
grep -E "FAILED|ERROR|Error|assert|passed|failed" "$OUT/gpu_tests_s32c_full.log" | head -n 40 \
  > "$OUT/gpu_tests_s32c.log"
rm -f "$OUT/gpu_tests_s32c_full.log"
cat "$OUT/gpu_tests_s32c.log"
for m in llama-3-8b llama-2-7b; do
  timeout -s INT ${PROBE_S:-190} python3 benchmarks/probes/generate_graphs.py $m 4096,32768 24 \
    2>&1 | grep -v -i warn >> "$OUT/generate_graphs_s32.log"
done
tail -n 30 "$OUT/generate_graphs_s32.log"
