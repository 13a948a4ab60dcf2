#!/usr/bin/env bash
# Probe (CPU): Gemma3-270M's calibrated presets with calibration windows cut by several
# versions of the code, e.g. before session 56 (only the first window starts with the BOS)
# against windows that each start with it (kvbits.methods.calibration_chunks). Each ARM is
# NAME=REV: REV runs from a git worktree ("." is this checkout as it is), in a fresh
# calibration folder (the models and texts are linked from $KVBITS_CACHE), so no arm reuses a
# cached fit. Same commands, same machine, one after the other; the perplexity tables land in
# OUT/NAME/.
#
#   bash benchmarks/probes/calibration_bos_ab.sh OUT before=1780906 after=.
set -euo pipefail
OUT=$(realpath -m "${1:?usage: calibration_bos_ab.sh OUT NAME=REV...}")
shift
ROOT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
CACHE=${KVBITS_CACHE:?set KVBITS_CACHE to the cache holding gemma3-270m and the texts}
mkdir -p "$OUT"

run() {  # run NAME SRC: every command below with the source tree SRC and a fresh calibration folder
    local name=$1 src=$2 cache="$OUT/$1/cache"
    mkdir -p "$cache"
    for d in downloads gguf models texts; do ln -sfn "$CACHE/$d" "$cache/$d"; done
    (cd "$OUT/$name" && export KVBITS_CACHE="$cache" PYTHONPATH="$src/src" &&
     python -m kvbits.cli ppl --model gemma3-270m --text lee-news --tokens 2048 --chunk 256 \
         --calib-tokens 2048 --no-progress \
         --presets fp16,kvquant-4,kvquant-3,kvquant-2,kvquant-3-offline,kvquant-2-offline,kivi-2-hadc,kivi-3-hadc,fp8 \
         --json news.json --md news.md &&
     python -m kvbits.cli ppl --model gemma3-270m --text sotu-2010-2016 --tokens 1024 --chunk 256 \
         --calib-tokens 2048 --no-progress \
         --presets fp16,kvquant-4,kvquant-3,kvquant-2,kivi-2-hadc,kivi-3-hadc,fp8 \
         --json sotu.json --md sotu.md) 2>&1 | tee "$OUT/$name.log"
}
for arm in "$@"; do
    name=${arm%%=*} rev=${arm#*=}
    if [ "$rev" = . ]; then run "$name" "$ROOT"; continue; fi
    git -C "$ROOT" worktree add -f --detach "$OUT/tree-$name" "$rev" >/dev/null
    run "$name" "$OUT/tree-$name"
    git -C "$ROOT" worktree remove --force "$OUT/tree-$name"
done
