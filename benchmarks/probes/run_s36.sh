# Session 36, second device call: the captured-loop tests (with the new fp8 grown-prefix case)
# and the fp8 / store tests on the GPU, then the random-layer sweep with another seed after the
# LayerStore.view_dev fix.
set -u
export PYTHONPATH=src
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/integrations/test_graph_generate.py \
  tests/methods/test_fp8.py tests/cache/test_store.py -k "gpu or fp8 or device" \
  > "$OUT/gpu_tests_s36.log" 2>&1
echo "pytest rc=$?" >> "$OUT/gpu_tests_s36.log"
tail -5 "$OUT/gpu_tests_s36.log"
timeout 330 python3 benchmarks/probes/random_layers_gpu.py --layers 500 --seconds 300 --seed 37 \
  > "$OUT/random_layers_s36b.log" 2>&1
tail -8 "$OUT/random_layers_s36b.log"
