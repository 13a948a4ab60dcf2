#!/usr/bin/env bash
# Session 54 on the H200: the GPU kernels on a real model (benchmarks/probes/real_model_gpu.py).
# The GPU machine has no network and takes at most 64 MiB per call, so SmolLM2's 98 MB GGUF
# travels in two calls: `STAGE=a` (first half, the gguf wheel and the texts) then, while the
# machine is still warm, `STAGE=run PARTS=...` with the second half (.devcarry/b).
#   STAGE=a bash benchmarks/probes/run_s54.sh            (carry .devcarry/a)
#   STAGE=run PARTS=ppl,gen bash benchmarks/probes/run_s54.sh   (carry .devcarry/b)
#   STAGE=final bash benchmarks/probes/run_s54.sh   (carry .devcarry/b): the fp8 and kivi-2-hadc
#     rows and the bfloat16 model
set -uo pipefail
OUT=${OUT:-/tmp/out}
KVC=/tmp/kvc
if [ "${STAGE:-run}" = a ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devcarry/a/gguf-*.whl
  mkdir -p $KVC/gguf $KVC/texts && tar -xJf .devcarry/a/texts.tar.xz -C $KVC/texts
  cp .devcarry/a/part_a /tmp/part_a
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
  exit 0
fi
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 KVBITS_CACHE=$KVC HF_HUB_OFFLINE=1
G=$KVC/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $G ]; then
  [ -f /tmp/part_a ] || { echo "no /tmp/part_a: the machine was given back after STAGE=a"; exit 3; }
  cat /tmp/part_a .devcarry/b/part_b > $G
fi
sha256sum $G
if [ "${STAGE}" = final ]; then  # the presets the first calls missed, and a bfloat16 model
  PRESETS=fp8,kivi-2-hadc PARTS=ppl,bf16
fi
python3 benchmarks/probes/real_model_gpu.py --out $OUT --parts "${PARTS:-ppl,step,gen,bf16}" \
  ${PRESETS:+--presets $PRESETS} 2>&1 | grep -v "Loading weights" | tee $OUT/real_model_gpu_${PARTS//,/_}.log
