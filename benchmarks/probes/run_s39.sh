#!/usr/bin/env bash
# Session 39, first call:  OUT=... bash benchmarks/probes/run_s39.sh
# 1. The GPU tests of session 38's step graphs after its unverified fixes (weak reference to the
#    cache, paused collector, review fixes, current-device rule) with the persist / decode-loop /
#    graph-generate / hf GPU tests beside them.
# 2. Eager generate() with and without step graphs, alternated in one process: SmolLM2 (batch 1
#    and 8) and Llama-3-8B batch 8 (rows session 38 had not run).
# 3. KVQuant's full layer with its parts taken away (kvquant_ab.py ABLATE=1): what the pre-RoPE
#    turn and the outliers each cost in the Gluon body.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 240 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -W ignore \
  tests/integrations/test_step_graphs.py tests/integrations/test_persist.py \
  tests/integrations/test_decode_loop.py tests/integrations/test_graph_generate.py \
  tests/integrations/test_hf.py > $OUT/gpu_tests_s39.log 2>&1
echo "tests rc=$?"; grep -E "^(E |FAILED)|passed|failed" $OUT/gpu_tests_s39.log | head -40
ABLATE=1 timeout -s KILL 60 python3 benchmarks/probes/kvquant_ab.py \
  8:32:8:32768:kvquant-3,8:32:32:32768:kvquant-3 > $OUT/kvquant_ablate_s39.log 2>&1
echo "ablate rc=$?"; cat $OUT/kvquant_ablate_s39.log
timeout -s KILL 100 python3 benchmarks/probes/step_graphs_ab.py smollm2 1024,8192 3 1 >> $OUT/step_graphs_ab_s39.log 2>&1
echo "smollm2 b1 rc=$?"
timeout -s KILL 80 python3 benchmarks/probes/step_graphs_ab.py smollm2 8192 3 8 >> $OUT/step_graphs_ab_s39.log 2>&1
echo "smollm2 b8 rc=$?"
timeout -s KILL 110 python3 benchmarks/probes/step_graphs_ab.py llama-3-8b 4096,32768 3 8 >> $OUT/step_graphs_ab_s39.log 2>&1
echo "llama-3-8b b8 rc=$?"
cat $OUT/step_graphs_ab_s39.log
