# Session 22: per-sequence sinks in left-padded batches (the body/residual mask starts at
# starts[b] + sink_len, the sink sits at positions starts[b] + j). GPU tests that cross a sink
# with left padding: Triton grid and random cases, the Gluon bodies (register and TMA ring,
# KVQuant full) on their sink > 0 cases, device lengths and graphs, tiny models end to end.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 520 python3 - > "$OUT/gpu_tests_s22_row_sinks.log" 2>&1 <<'PY'
import sys, pytest
ids = open("benchmarks/probes/gpu_ids_s22.txt").read().split("\n")
ids = [i for i in ids if i.strip()]
ids += ["tests/kernels/test_decode_attention.py::test_grid",
        "tests/kernels/test_decode_attention.py::test_random_cases",
        "tests/kernels/test_decode_attention.py::test_rows_that_see_nothing_are_zero",
        "tests/kernels/test_decode_attention.py::test_store_built_layer",
        "tests/kernels/test_decode_attention.py::test_starts_and_lengths_any_form",
        "tests/integrations/test_hf.py::test_cuda_kernels_in_model_match_reference",
        "tests/integrations/test_decode_loop.py::test_gpu_captured_runs_match_eager"]
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--durations=5", *ids]))
PY
tail -n 25 "$OUT/gpu_tests_s22_row_sinks.log"
