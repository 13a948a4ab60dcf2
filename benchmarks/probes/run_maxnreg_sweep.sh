set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
export PYTHONPATH=src
SWEEP_SHAPES=8x32x8x32768,8x32x8x131072,32x32x32x32768 SWEEP_MAXNREG=0,128,152,168 SWEEP_SPLITS=0,16,64 SWEEP_PF=1A timeout 420 python3 benchmarks/gluon_sweep.py kivi-2 kivi-4 uniform-int4 2>&1 | grep -v Warning | tee $OUT/maxnreg_sweep.log
SWEEP_SHAPES=8x32x8x32768,8x32x8x131072,32x32x32x32768 SWEEP_PF=0T timeout 100 python3 benchmarks/gluon_sweep.py kivi-2 kivi-4 2>&1 | grep -v Warning | tee -a $OUT/maxnreg_sweep.log
