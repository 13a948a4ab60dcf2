# For the next device session, one call: the GPU tests of this session's work that never ran
# on a GPU (graph_generate's rules inside captured steps), then generate() through
# graph_generate timed from 40- and 200-token calls (session 32's 24 / 120 biased the quantized
# rows by the flushing step's capture), then the kernels of replayed batch-1 steps (Llama-3-8B x
# 8 layers, 4k and 32k).
export PYTHONPATH=src PYTHONUNBUFFERED=1
SHARDS=1 TEST_S=${TEST_S:-200} DETAILS=gpu_tests_s33.log \
  FILES="tests/integrations/test_graph_generate.py tests/integrations/test_decode_loop.py" \
  bash benchmarks/probes/run_gpu_suite_sharded.sh
timeout -s INT ${PROBE_S:-200} python3 benchmarks/probes/generate_graphs.py llama-3-8b 4096,32768 40 \
  2,3,4 2>&1 | grep -v -i warn | grep -v "^ " > "$OUT/generate_graphs_s33.log"
cat "$OUT/generate_graphs_s33.log"
for ctx in 4096 32768; do
  timeout -s INT ${PROF_S:-120} python3 benchmarks/probes/step_kernels.py --model llama-3-8b \
    --layers 8 --context $ctx --graphs --no-fuse 2>&1 | grep -v -i warn >> "$OUT/step_kernels_graphs_s33.log"
done
cat "$OUT/step_kernels_graphs_s33.log"
