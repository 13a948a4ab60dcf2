# The TMA ring against the register body for 4-bit (and 2-bit) layers by (sequence, KV head) pair
# count, graph time (H200). Session 21: maxnreg sweep showed the ring 9-10% faster for kivi-4 at
# Llama-3-8B batch 8 (64 pairs), where decode_gluon_tma.serves() keeps 4-bit layers off it.
export PYTHONPATH=src
SWEEP_SHAPES=1x32x8x131072,1x32x32x131072,4x32x8x131072,2x32x32x32768,8x32x8x32768,8x32x8x131072,16x32x8x32768,4x32x32x32768,32x32x8x32768 \
SWEEP_PF=1A,0T,0T3 timeout 500 python3 benchmarks/gluon_sweep.py kivi-4 kivi-2 2>&1 | grep -v Warning | tee $OUT/tma4_pairs.log
