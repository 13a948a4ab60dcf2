# Session 28, one device call: the TMA ring with scale rows interleaved by 16-byte chunks
# (decode_gluon_tma.key_scale_tile / value_scale_tile). Its GPU tests (the ring's kernel cases,
# the store's whole-step capacities, a captured generation through the ring), the body kernel
# against session 27's ring (probes/tma_ring_s27.py) alternated in one process, and Nsight
# Compute's bank conflicts and stalls at Llama-3-8B batch 8 128k.
# Needs the measured variant applied (git apply benchmarks/probes/tma_interleaved_scales_s28.patch;
# its tests include -k whole_steps) and session 27's module beside it (git show
# af207da:src/kvbits/kernels/decode_gluon_tma.py > benchmarks/probes/tma_ring_s27.py).
# OUT: the device tool's output folder. TEST_S / AB_S: time limits (s).
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout -s KILL ${TEST_S:-260} python3 -m pytest -q -p no:cacheprovider --tb=short -m gpu \
  tests/kernels/test_decode_attention.py tests/integrations/test_decode_loop.py \
  -k "${TEST_K:-tma or offsets_past_int32 or whole_steps}" > "$OUT/gpu_tests_s28.log" 2>&1
tail -n 6 "$OUT/gpu_tests_s28.log"
timeout -s KILL ${AB_S:-170} python3 benchmarks/probes/tma_ring_ab.py benchmarks/probes/tma_ring_s27.py \
  2>&1 | grep -v Warning | tee "$OUT/tma_ring_ab_s28.log"
NCU_S=100 bash benchmarks/probes/ncu_ring.sh ncu_body_s28.log
grep -E "bank|wavefronts|Issued Warp|Duration|short_scoreboard|inst_executed.sum" "$OUT/ncu_body_s28.log" | head -30
