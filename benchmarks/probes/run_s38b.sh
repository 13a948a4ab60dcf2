#!/usr/bin/env bash
# Session 38, second call:  OUT=... bash benchmarks/probes/run_s38b.sh
# The step-graph GPU tests (fixed expectations) and the decode-loop / generate / hf GPU tests,
# then eager generate() at batch 1 with and without step graphs, alternated in one process.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 220 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore \
  tests/integrations/test_step_graphs.py tests/integrations/test_decode_loop.py \
  tests/integrations/test_graph_generate.py tests/integrations/test_hf.py > $OUT/gpu_tests_s38.log 2>&1
echo "tests rc=$?"; grep -E "^(E |FAILED)|passed|failed" $OUT/gpu_tests_s38.log | head -40
for m in llama-3-8b llama-2-7b; do
  timeout -s KILL 170 python3 benchmarks/probes/step_graphs_ab.py $m 4096,32768 3 >> $OUT/step_graphs_ab_s38.log 2>&1
  echo "$m rc=$?"
done
cat $OUT/step_graphs_ab_s38.log
