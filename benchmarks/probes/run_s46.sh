#!/usr/bin/env bash
# Session 46's GPU jobs:  OUT=... PART=a|b|c bash benchmarks/probes/run_s46.sh
# The decode_attention table re-run at this code (the committed one was session 27's): PART a the
# Llama-3-8B shapes, PART b the Llama-2-7B shapes (each merged into the committed JSON, which
# holds part a's rows when part b runs), with the chooser's KVQuant presets added; PART c the
# whole GPU suite in 12 shards (tests/conftest.py, KVBITS_TEST_SHARD).
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
PRESETS=kivi-2,kivi-4,k4v2,uniform-int4,uniform-int2,fp8-dynamic,kvquant-3,kivi-3,kvquant-3-dense-post,kvquant-2,kvquant-4,kvquant-3-offline
case ${PART:-a} in
  a|b)
    MODEL=$([ "${PART:-a}" = a ] && echo llama-3-8b || echo llama-2-7b)
    cp benchmarks/results/decode_attention.json /tmp/prev.json
    timeout -s INT ${BENCH_S:-540} python3 benchmarks/decode_attention.py --out "$OUT" \
      --skip-quantize-pack --presets $PRESETS --shapes "$MODEL:*:*" --merge /tmp/prev.json \
      > "$OUT/decode_attention_s46${PART:-a}.log" 2>&1
    echo "bench rc=$?"; grep -v "^skip" "$OUT/decode_attention_s46${PART:-a}.log" | tail -5 ;;
  c)
    SHARDS=${SHARDS:-12} TEST_S=${TEST_S:-520} DETAILS=gpu_suite_s46.log \
      bash benchmarks/probes/run_gpu_suite_sharded.sh ;;
esac
ls "$OUT"
