# Session 23: sliding windows and Gemma2's softcapping in the Gluon bodies (register body and
# TMA ring). Part 1: the GPU tests of the change (new window/softcap cases, tiny Gemma2/Gemma3
# models through the Gluon body) and the Gluon regression tests; part 2: the decode table at
# Gemma-2 shapes with --softcap 50 (Gluon rows against the Triton kernel that served them before);
# part 3: the rest of the GPU suite and sliding-window layers (window 4096, 1.25 windows held).
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
elif [ "$PART" = 3 ]; then
# the rest of the GPU suite (pytest -m gpu) not run by part 1, then sliding-window layers
timeout -s KILL 400 python3 -m pytest -q -p no:cacheprovider --durations=5 -m gpu tests \
  -k "not window_and_softcap and not gluon_body_matches and not tma_body_matches \
      and not kvquant_full_matches and not test_softcap_matches and not tma_inside_cuda_graph \
      and not test_device_lengths_inside_bounds and not test_cuda_kernels_in_model" \
  > "$OUT/gpu_suite_s23_rest.log" 2>&1
tail -n 12 "$OUT/gpu_suite_s23_rest.log"
timeout -s KILL 150 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
  --no-baselines --name decode_attention_sliding_window --window 4096 \
  --models gemma-2-9b,mistral-7b-v0.1=32/8/128 --batches 8 --contexts 5120 \
  --presets kivi-2,kivi-4,uniform-int4 2>&1 | tail -n 12
else
timeout -s KILL 560 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
  --no-baselines --name decode_attention_gemma2_softcap --models gemma-2-9b,gemma-2-27b \
  --batches 8,1 --contexts 32768 --softcap 50 \
  --presets kivi-2,kivi-4,kivi-3,kvquant-3-dense-post,uniform-int4 2>&1 | tail -n 40
fi
