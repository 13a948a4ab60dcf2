#!/usr/bin/env bash
# Session 40, second call:  OUT=... bash benchmarks/probes/run_s40b.sh
# At the final code (KVBITS_MERGE "auto": the stage-1 merge only in eager Triton-only calls;
# pre-RoPE keys at head_dim 80 / 96 in the Triton kernel): the whole GPU suite, then decode
# attention at Phi-3-mini's shape (32/32/96), where kvquant-3 used to attend through the
# reference (decode_attention_odd_s37.log), against FP16 SDPA and the baselines in the same run.
export PYTHONPATH=src PYTHONUNBUFFERED=1
DETAILS=gpu_suite_s40c_details.log TEST_S=${TEST_S:-300} \
  bash benchmarks/probes/run_gpu_suite_sharded.sh > $OUT/gpu_suite_s40c.log 2>&1
cat $OUT/gpu_suite_s40c.log
timeout -s INT ${BENCH_S:-240} python3 benchmarks/decode_attention.py --models phi-3-mini=32/32/96 \
  --batches 8,1 --contexts 4096,32768 --presets kivi-2,kivi-4,kvquant-3 --skip-quantize-pack \
  --out $OUT --name decode_attention_phi3_s40 > $OUT/decode_attention_phi3_s40.log 2>&1
echo "bench rc=$?"; tail -n 25 $OUT/decode_attention_phi3_s40.md | cut -c1-260
