# Programs per SM for the TMA ring (pf=0T): the split rule (decode_gluon.body_splits) was tuned on
# the register body; the ring holds 21.5-22.5 KB of shared memory per program (~10 resident per
# SM). H200, graph time. splits=lib: the library's rule; N: N programs per SM.
export PYTHONPATH=src
SWEEP_SHAPES=1x32x8x131072,1x32x32x32768,8x32x8x32768,8x32x8x131072,8x32x32x32768,32x32x8x32768 \
SWEEP_PF=0T SWEEP_SPLITS=0,8,10,16,20,32,48 timeout 500 python3 benchmarks/gluon_sweep.py kivi-2 kivi-4 2>&1 | grep -v Warning | tee $OUT/tma_splits.log
