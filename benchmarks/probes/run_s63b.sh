#!/usr/bin/env bash
# Session 63, second device call: the end-to-end batch-1 rows of issue 6 (graphs + fused
# elementwise work, Llama-2-7B and Llama-3-8B shapes, 4k and 32k, random weights) re-measured
# at this commit on a second GPU (the committed rows are the H200's). The run uses HEAD's
# tree (`git archive`), not the working tree, which other work was editing.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SRC=$PWD
if git rev-parse HEAD >/dev/null 2>&1; then
  SRC=$(mktemp -d) && git archive HEAD | tar -x -C "$SRC"
  echo "running HEAD $(git rev-parse --short HEAD) from $SRC"
fi
cd "$SRC"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 280 bash benchmarks/e2e_gpu.sh "$OUT" fused > /dev/null 2>&1; echo "fused exit $?"
timeout 280 bash benchmarks/e2e_gpu.sh "$OUT" fused-llama3 > /dev/null 2>&1; echo "fused-llama3 exit $?"
for f in "$OUT"/e2e_fused_llama2_7b.md "$OUT"/e2e_fused_llama3_8b.md; do [ -f "$f" ] && cat "$f"; done
tail -n 5 "$OUT"/e2e_fused*.log
