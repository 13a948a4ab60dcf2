# One device call for decode_gluon.Q_RELOAD (session 19): the head_dim-256 Gluon cases against
# the reference with it on (the default), then the Gemma-2-9B rows with it off and on.
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/kernels/test_decode_attention.py -k "D=256" > "$OUT/q_reload_tests.log" 2>&1
tail -3 "$OUT/q_reload_tests.log"
for qr in 0 1; do
  KVBITS_GLUON_Q_RELOAD=$qr timeout -s KILL 170 python3 benchmarks/decode_attention.py \
    --out "$OUT" --skip-quantize-pack --no-baselines --name decode_attention_q_reload$qr \
    --models gemma-2-9b --shapes '*:8:32768,*:1:32768' \
    --presets kivi-3,kivi-4,kvquant-3-dense-post 2>&1 | grep -v "^skip" | grep "gluon" | cut -c1-150
done
