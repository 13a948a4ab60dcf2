# Session 21: KVQuant's full layer at head_dim 256 in the Gluon body (decode_gluon.KVQUANT_WIDE).
# Part 1: the GPU tests of the KVQuant and TMA paths (the 4-bit ring rule changed too).
# Part 2: kvquant-3 at Gemma-2-9B's shape (16 q / 8 kv heads x 256) through the Gluon body and the
# Triton kernel, against flash SDPA in the same run.
export PYTHONPATH=src
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_decode_attention.py \
  -k "gluon_kvquant or tma" 2>&1 | tail -15 | tee $OUT/kvquant_wide_tests.log
timeout 230 python3 benchmarks/decode_attention.py --out $OUT --skip-quantize-pack --no-baselines \
  --name decode_attention_kvquant_wide --batches 8,1 --contexts 32768,131072 --models gemma-2-9b \
  --presets kvquant-3 2>&1 | grep -v Warning | tail -20
