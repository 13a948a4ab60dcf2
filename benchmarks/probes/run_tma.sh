# One device call for the TMA ring (kernels/decode_gluon_tma.py; KVBITS_GLUON_TMA=auto by
# default): its GPU tests against the reference, then the sweep against the register body
# with the L2 prefetch (1A).
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 200 python3 -m pytest -v -x tests/kernels/test_decode_attention.py -k "gluon_tma" \
  -p no:cacheprovider > "$OUT/tma_tests.log" 2>&1; tail -5 "$OUT/tma_tests.log"
# next: the ring's stage count and programs per SM (its 21.5 KB per program caps residency at
# ~10 per SM, below the register body's 32-48), now with graph times beside the eager ones
SWEEP_SHAPES=${SWEEP_SHAPES:-8x32x8x32768,32x32x8x32768,8x32x32x32768} \
SWEEP_SPLITS=${SWEEP_SPLITS:-0,10,16} SWEEP_PF=${SWEEP_PF:-1A,0T,0T2} \
  timeout -s KILL 300 python3 benchmarks/gluon_sweep.py ${PRESETS:-kivi-2 kivi-4} 2>&1 \
  | tee "$OUT/tma_sweep.log"
