# Device calls for decode_gluon.Q_RELOAD (session 19): the head_dim-256 Gluon cases against the
# reference with it on, then the Gemma-2-9B rows with it off and on, twice in turn (run-to-run
# spread). Tables: decode_attention_q_reload{0,1}[_r2].*
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
[ "${AUTO:-0}" = 1 ] || KVBITS_GLUON_Q_RELOAD=1 timeout -s KILL 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/kernels/test_decode_attention.py -k "gluon_body and 256" > "$OUT/q_reload_tests.log" 2>&1
tail -3 "$OUT/q_reload_tests.log"
[ "${AUTO:-0}" = 1 ] || for rep in "" _r2; do
  for qr in 0 1; do
    KVBITS_GLUON_Q_RELOAD=$qr timeout -s KILL 100 python3 benchmarks/decode_attention.py \
      --out "$OUT" --skip-quantize-pack --no-baselines --name decode_attention_q_reload$qr$rep \
      --models gemma-2-9b --shapes '*:8:32768,*:1:32768' \
      --presets kivi-3,kivi-4,kvquant-3-dense-post 2>&1 | grep -v "^skip" | grep "gluon" | cut -c1-150
  done
done
# final: the default rule (auto), tests and rows (decode_attention_q_reload_auto.*)
if [ "${AUTO:-0}" = 1 ]; then
  timeout -s KILL 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_decode_attention.py -k "gluon_body and 256" 2>&1 | tail -1
  timeout -s KILL 100 python3 benchmarks/decode_attention.py --out "$OUT" --skip-quantize-pack \
    --no-baselines --name decode_attention_q_reload_auto --models gemma-2-9b \
    --shapes '*:8:32768,*:1:32768' --presets kivi-3,kivi-4,kvquant-3-dense-post 2>&1 \
    | grep -v "^skip" | grep "gluon" | cut -c1-150
fi
