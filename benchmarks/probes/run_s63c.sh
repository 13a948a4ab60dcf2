#!/usr/bin/env bash
# Session 63, third device call: the whole GPU suite again after the numerics QA changed the
# append path (each layer's first flush reads K/V's range once, outside graph capture;
# Hadamard-rotated fp16 keys clamp at 65504; fp8's dynamic amax ignores non-finite elements).
# Run from the working tree (committed and clean when sent): the device's copy of .git can be
# older than the tree (run_s63b.sh's `git archive HEAD` there took 7c44397, whose src/ was the
# same as the tree's at that call).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TEST_S=480 DETAILS=gpu_suite_s63c.txt bash benchmarks/probes/run_gpu_suite_sharded.sh
# The range check on CUDA: it warns on a store's first flush, and a flush inside graph capture
# (a store whose first flush is captured) neither reads the device nor fails the capture.
PYTHONPATH=src python3 - <<'PY'
import warnings, torch
from kvbits.cache.store import LayerStore
from kvbits.spec import resolve_spec
spec = resolve_spec("kivi-2").replace(residual_length=0, group_size=32)
k = torch.randn(2, 2, 64, 128, device="cuda", dtype=torch.bfloat16); v = k.clone()
k[1, 0, 9, 4] = 2e5
st = LayerStore(spec, 2, 2, 128, torch.bfloat16, "cuda", layer_idx=5)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always"); st.append(k, v); torch.cuda.synchronize()
print("eager first flush:", [str(x.message)[:90] for x in w if "beyond" in str(x.message)])
st2 = LayerStore(spec, 2, 2, 128, torch.bfloat16, "cuda", layer_idx=6)
st2.reserve(256) if hasattr(st2, "reserve") else None
g = torch.cuda.CUDAGraph(); s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
try:
    with torch.cuda.stream(s), warnings.catch_warnings(record=True) as w2, torch.cuda.graph(g):
        warnings.simplefilter("always"); st2.append(k, v)
    print("captured first flush: ok, warnings", len([x for x in w2 if "beyond" in str(x.message)]),
          "checked", st2._range_checked)
except Exception as e:
    print("captured first flush raised (capture of a growing store may not be supported):",
          type(e).__name__, str(e)[:160])
PY
