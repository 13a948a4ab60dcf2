# Session 32, second device call: the GPU tests of the decode loop (stop tokens are new) and of
# graph_generate (generate's loop replaced by the CUDA-graph loop), then generate() as users
# call it, eager against custom_generate=graph_generate, on Llama-3-8B and Llama-2-7B shapes.
export PYTHONPATH=src PYTHONUNBUFFERED=1
SHARDS=1 TEST_S=${TEST_S:-200} DETAILS=gpu_tests_s32b.log \
  FILES="tests/integrations/test_graph_generate.py tests/integrations/test_decode_loop.py" \
  bash benchmarks/probes/run_gpu_suite_sharded.sh
timeout -s INT ${PROBE_S:-220} python3 benchmarks/probes/generate_graphs.py llama-3-8b 4096,32768 64 \
  > "$OUT/generate_graphs_s32.log" 2>&1
timeout -s INT ${PROBE2_S:-150} python3 benchmarks/probes/generate_graphs.py llama-2-7b 4096,32768 64 \
  >> "$OUT/generate_graphs_s32.log" 2>&1
grep -v Warning "$OUT/generate_graphs_s32.log" | tail -n 30
