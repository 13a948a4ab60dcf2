# Session 32, third device call: the GPU tests of graph_generate and the decode loop after the
# cache's back-reference became weak, then generate() eager against graph_generate with the
# steady time per token and the per-call overhead (captures) apart.
export PYTHONPATH=src PYTHONUNBUFFERED=1
SHARDS=1 TEST_S=${TEST_S:-150} DETAILS=gpu_tests_s32c.log \
  FILES="tests/integrations/test_graph_generate.py tests/integrations/test_decode_loop.py" \
  bash benchmarks/probes/run_gpu_suite_sharded.sh
for m in llama-3-8b llama-2-7b; do
  timeout -s INT ${PROBE_S:-190} python3 benchmarks/probes/generate_graphs.py $m 4096,32768 24 \
    2>&1 | grep -v -i warn >> "$OUT/generate_graphs_s32.log"
done
tail -n 30 "$OUT/generate_graphs_s32.log"
