#!/usr/bin/env bash
# `kvbits needle` on a GPU machine that has no network: the passkey prompts attend through the
# fused decode kernels (CUDA, float16 model) instead of the CPU reference.
#
# The machine cannot fetch SmolLM2, and its 98 MB GGUF is more than one device call carries, so
# it travels in two pieces, each in its own call while the machine stays warm:
#   here:   split -b 49m "$KVBITS_CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" .devcarry/gguf_part_
#           mkdir -p .devcarry/texts && cp "$KVBITS_CACHE"/texts/sotu-{2010-2016,pre-2000}.txt .devcarry/texts/
#           pip download --no-deps gguf==0.19.0 -d .whl      # the GPU image lacks gguf
#   call 1: carry .devcarry/gguf_part_aa;  PART=1 bash benchmarks/probes/needle_gpu.sh
#   call 2: carry .devcarry/gguf_part_ab .devcarry/texts .whl;  PART=2 bash benchmarks/probes/needle_gpu.sh ARGS
# ARGS go to `kvbits needle` (its --out defaults to $OUT). The cache is checked as on any machine
# (the GGUF's and the texts' sha256), so a damaged piece fails the run instead of changing it.
set -uo pipefail
cd "$(dirname "$0")/../.."
cache=/tmp/kvbits-cache
mkdir -p "$cache/gguf" "$cache/texts"
if [ "${PART:-}" = 1 ]; then
  cp .devcarry/gguf_part_aa "$cache/gguf/part_aa" && ls -l "$cache/gguf"
  exit
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:src KVBITS_CACHE=$cache PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ ! -f "$cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  cat "$cache/gguf/part_aa" .devcarry/gguf_part_ab > "$cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" \
    || exit 1
fi
cp .devcarry/texts/*.txt "$cache/texts/"
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -c "import sys; from kvbits.cli import main; sys.exit(main(sys.argv[1:]))" \
  needle --device cuda --out "${OUT:-kvbits-results}" "$@"
