# Session 23: sliding windows and Gemma2's softcapping in the Gluon bodies (register body and
# TMA ring). Part 1: the GPU tests of the change (new window/softcap cases, tiny Gemma2/Gemma3
# models through the Gluon body) and the Gluon regression tests; part 2: the decode table at
# Gemma-2 shapes with --softcap 50 (Gluon rows against the Triton kernel that served them before).
export PYTHONPATH=src PYTHONUNBUFFERED=1
PART=${1:-1}
if [ "$PART" = 1 ]; then
timeout -s KILL 450 python3 - > "$OUT/gpu_tests_s23_window_softcap.log" 2>&1 <<'PY'
import sys, pytest
t = "tests/kernels/test_decode_attention.py::"
ids = [t + n for n in ("test_gluon_body_window_and_softcap", "test_gluon_kvquant_full_window_and_softcap",
                       "test_gluon_tma_window_and_softcap", "test_softcap_matches_reference",
                       "test_gluon_tma_body_matches_reference", "test_gluon_tma_inside_cuda_graph",
                       "test_gluon_kvquant_full_matches_reference", "test_device_lengths_inside_bounds",
                       "test_gluon_body_matches_reference")]
ids.append("tests/integrations/test_hf.py::test_cuda_kernels_in_model_match_reference")
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--durations=5", "-x", *ids]))
PY
tail -n 30 "$OUT/gpu_tests_s23_window_softcap.log"
else
timeout -s KILL 560 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
  --no-baselines --name decode_attention_gemma2_softcap --models gemma-2-9b,gemma-2-27b \
  --batches 8,1 --contexts 32768 --softcap 50 \
  --presets kivi-2,kivi-4,kivi-3,kvquant-3-dense-post,uniform-int4 2>&1 | tail -n 40
fi
