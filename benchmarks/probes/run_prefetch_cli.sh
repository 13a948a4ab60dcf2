# One device call: the Gluon body's latency knobs swept (SWEEP_PF), then `kvbits generate` on the
# GPU with and without CUDA graphs (probes/cli_graphs_gpu.py; carry .devcarry/ with SmolLM2's
# config, tokenizer and kvbits' cached texts).
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm --format=csv
SWEEP_SHAPES=${SWEEP_SHAPES:-32x32x8x32768,8x32x8x32768,8x32x32x32768,32x32x32x4096} \
SWEEP_PF=${SWEEP_PF:-0,1,1A,1E,1AE,2A} timeout 330 python3 benchmarks/gluon_sweep.py \
  ${PRESETS:-kivi-2 kivi-4 uniform-int4 k4v2} 2>&1 | tee $OUT/sweep.log
timeout 200 python3 benchmarks/probes/cli_graphs_gpu.py .devcarry/smollm2 2>&1 | tee $OUT/cli.log | grep -v Warning
