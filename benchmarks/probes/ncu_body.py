"""Probe (GPU, under Nsight Compute): one decode-attention call whose body runs the Gluon TMA
ring, for ``ncu`` to read stall reasons, shared-memory bank conflicts and occupancy.

    KVBITS_GLUON_TMA=1 ncu --clock-control none -k regex:_body -c 1 -s 3 \
        --section WarpStateStats ... python3 benchmarks/probes/ncu_body.py [preset] [B] [T]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import random_packed_kv
from decode_attention import MODELS

from kvbits.kernels.decode_attention import decode_attention
from kvbits.spec import resolve_spec

preset = sys.argv[1] if len(sys.argv) > 1 else "kivi-2"
B = int(sys.argv[2]) if len(sys.argv) > 2 else 8
T = int(sys.argv[3]) if len(sys.argv) > 3 else 131072
hq, hkv, d = MODELS["llama-3-8b"]
q = torch.randn(B, hq, 1, d, dtype=torch.float16, device="cuda")
kv = random_packed_kv(B, hkv, T, d, resolve_spec(preset))
for _ in range(5):
    decode_attention(q, kv, scale=d ** -0.5)
torch.cuda.synchronize()
print("done", preset, B, T)
