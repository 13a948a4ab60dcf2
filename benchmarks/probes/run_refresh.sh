# One device call that refreshes the measurements the session-15 kernel changes touch, each part
# under a hard timeout with its log in $OUT: the decode table's small shapes (3-bit layers now
# take the Gluon body at every size), the million-token run (the TMA ring now serves its eager
# steps) and the batch-1 CUDA-graph e2e rows of both 7-8B shapes.
set -x
export PYTHONPATH=src PYTHONUNBUFFERED=1
cp benchmarks/results/decode_attention.json /tmp/prev.json
timeout -s KILL "${TABLE_S:-110}" python3 benchmarks/decode_attention.py --out "$OUT" \
  --skip-quantize-pack --shapes "${SHAPES:-*:1:*,*:8:4096}" --merge /tmp/prev.json \
  > "$OUT/table.log" 2>&1
grep -E "kivi-3|dense-post" "$OUT/table.log" | tail -12
timeout -s KILL "${MILLION_S:-120}" python3 benchmarks/million_tokens.py --out "$OUT" \
  > "$OUT/million.log" 2>&1
tail -4 "$OUT/million.log"
for m in llama-2-7b llama-3-8b; do
  n=$(echo "$m" | tr -d '-' | sed 's/llama2/llama2_/; s/llama3/llama3_/')
  timeout -s KILL "${E2E_S:-150}" python3 -m kvbits.cli bench --out "$OUT" --model "$m" \
    --contexts 4k,32k --presets fp16-flash,fp16+graphs,kvbits-fp16+graphs,kivi-2,kivi-2+graphs,kivi-4+graphs,kivi-3+graphs \
    --name "e2e_graphs_$n" > "$OUT/e2e_$n.log" 2>&1
  tail -12 "$OUT/e2e_$n.log"
done
