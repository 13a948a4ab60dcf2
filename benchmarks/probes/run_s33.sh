# Session 33, first device call: the GPU tests of session 32's work that never ran on a GPU
# (graph_generate's rules inside captured steps), then where a captured decode_attention call
# spends its time at Llama-3-8B batch 8 (body, FP16 splits, merge, gaps), then generate()
# through graph_generate timed from 40- and 200-token calls (session 32's 24 / 120 biased the
# quantized rows by the flushing step's capture).
export PYTHONPATH=src PYTHONUNBUFFERED=1
SHARDS=1 TEST_S=${TEST_S:-200} DETAILS=gpu_tests_s33.log \
  FILES="tests/integrations/test_graph_generate.py tests/integrations/test_decode_loop.py" \
  bash benchmarks/probes/run_gpu_suite_sharded.sh
cat "$OUT/gpu_tests_s33.log"
timeout -s INT ${TIMELINE_S:-120} python3 benchmarks/probes/graph_call_timeline.py 2>&1 \
  | grep -v -i warn > "$OUT/graph_call_timeline_s33.log"
cat "$OUT/graph_call_timeline_s33.log"
timeout -s INT ${PROBE_S:-200} python3 benchmarks/probes/generate_graphs.py llama-3-8b 4096,32768 40 \
  2,3,4 2>&1 | grep -v -i warn | grep -v "^ " > "$OUT/generate_graphs_s33.log"
cat "$OUT/generate_graphs_s33.log"
