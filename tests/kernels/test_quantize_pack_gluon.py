"""The Gluon quantize + pack kernels (kvbits.kernels.quantize_pack_gluon).

Numerics run on a GPU: every test of test_quantize_pack.py goes through these kernels there for
the shapes they accept (bit-exact against the reference), and ``test_gpu_*`` below checks that the
realistic shapes do take this path and agree with the Triton kernel. On the CPU (no Gluon
interpreter): the launch plans tile their blocks exactly, and the kernels compile for sm_90 with
the slot axis in-thread (no shared memory for the keys, no local memory at all).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvbits.kernels import quantize_pack_gluon as qg

CUDA = torch.cuda.is_available()
BITS = (2, 3, 4, 8)


def _covers_exactly(shape, layout, num_warps):
    """No two threads hold the same element and the block is a whole number of layout tiles."""
    spt, lanes, warps = layout
    assert math.prod(lanes) == 32 and math.prod(warps) == num_warps, layout
    for n, a, b, c in zip(shape, spt, lanes, warps):
        assert n % (a * b * c) == 0, (shape, layout)
    return math.prod(shape) // (32 * num_warps)  # elements per thread


@pytest.mark.parametrize("bits", BITS)
def test_key_plans_tile_exactly(bits):
    slots = 32 if bits == 3 else 32 // bits
    for G in (8, 16, 24, 32, 64, 128, 256):
        for D in (16, 32, 64, 80, 96, 128, 256):
            plan = qg.keys_plan(bits, G, D)
            if G & (G - 1) or G % slots:  # groups that leave words partly empty: Triton kernel
                assert plan is None, (bits, G, D)
                continue
            if plan is None:
                continue
            shape = [slots, G // slots, plan["block_d"]]
            per_thread = _covers_exactly(shape, plan["layout"], plan["num_warps"])
            assert plan["layout"][0][0] == slots  # the packing OR stays in-thread
            assert per_thread <= 64 and plan["block_d"] >= min(D, 16), (bits, G, D, plan)
            assert plan["block_d"] < 2 * D or plan["block_d"] == plan["layout"][0][2]
    assert qg.keys_plan(bits, 32, 128) is not None or bits == 3  # the presets' shape is served
    assert qg.keys_plan(2, 32, 128) is not None


@pytest.mark.parametrize("bits", BITS)
def test_value_plans_tile_exactly(bits):
    slots = 32 if bits == 3 else 32 // bits
    for G in (16, 32, 64, 128):
        for D in (64, 80, 96, 128, 256):
            for GV in (8, 16, 32, 64, 128):
                plan = qg.values_plan(bits, G, GV, D)
                if G % slots or D % GV:
                    assert plan is None
                    continue
                if plan is None:
                    continue
                shape = [slots, G // slots, plan["ngb"], GV]
                a = _covers_exactly(shape, plan["stats"], plan["num_warps"])
                b = _covers_exactly(shape, plan["pack"], plan["num_warps"])
                assert a == b <= 64
                assert plan["stats"][0][3] == min(GV, 32)  # min/max of a token in-thread
                assert plan["pack"][0][0] == slots
    assert qg.values_plan(bits, 32, 32, 128) is not None


CHILD = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from kvbits.kernels import quantize_pack_gluon as qg
SIG = {"x": "*fp16", "valid_ptr": "*i1", "codes_ptr": "*i32", "scale_ptr": "*fp16",
       "zero_ptr": "*fp16", "H": "i32", "NG": "i32", "stride_b": "i32", "stride_h": "i32",
       "stride_t": "i32", "valid_sb": "i32", "valid_st": "i32"}
out = []
for kind, bits, G, GV, D, has_valid in json.loads(sys.argv[1]):
    slots = 32 if bits == 3 else 32 // bits
    if kind == "keys":
        fn, plan = qg._quantize_keys_kernel, qg.keys_plan(bits, G, D)
        cx = dict(D=D, G=G, BITS=bits, SLOTS=slots, W=G // slots, BLOCK_D=plan["block_d"],
                  HAS_VALID=has_valid)
    else:
        fn, plan = qg._quantize_values_kernel, qg.values_plan(bits, G, GV, D)
        cx = dict(D=D, G=G, GV=GV, BITS=bits, SLOTS=slots, W=G // slots, NGB=plan["ngb"],
                  HAS_VALID=has_valid)
    sig = {fn.arg_names[0]: "*fp16", **{k: v for k, v in SIG.items() if k != "x"}}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in sig.items()
             if v.startswith("*") or k.startswith("stride")}
    src = gluon._runtime.GluonASTSource(fn=fn, signature={**sig, **dict.fromkeys(cx, "constexpr")},
                                        constexprs=cx, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": plan["num_warps"]})
    ptx = c.asm["ptx"]
    out.append({"cfg": [kind, bits, G, GV, D, has_valid], "shared": c.metadata.shared,
                "local": ptx.count(".local"), "ld": ptx.count("ld.global")})
print(json.dumps(out))
'''

CONFIGS = [("keys", b, 32, 0, 128, False) for b in BITS] + [
    ("keys", 2, 128, 0, 128, True), ("keys", 4, 64, 0, 80, False),
    ("values", 2, 32, 32, 128, False), ("values", 4, 32, 64, 128, True),
    ("values", 8, 64, 128, 128, False), ("values", 3, 32, 32, 96, False)]


@pytest.mark.skipif(qg.gluon is None, reason="this Triton has no Gluon")
def test_kernels_compile_for_sm90_with_slots_in_thread(compile_sm90):
    results = compile_sm90(CHILD, CONFIGS)
    for r in results:
        kind, _, G, _, _, _ = r["cfg"]
        assert r["local"] == 0, r  # no spills, no local arrays
        if kind == "keys" and G == 32:  # min/max and packing in-thread or across lanes only
            assert r["shared"] == 0, r
        if kind == "values":  # only the one-byte codes change layout through shared memory
            assert r["shared"] <= G * 128, r


gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits", BITS)
def test_gpu_gluon_serves_presets_and_matches_triton(bits, monkeypatch):
    from kvbits.kernels import quantize_pack as qp
    from kvbits.reference import quant as ref

    x = torch.randn(2, 8, 4096, 128, dtype=torch.float16, device="cuda")
    x[..., 3] *= 30.0
    valid = torch.arange(4096, device="cuda")[None, :] >= torch.tensor([[0], [777]], device="cuda")
    for G, GV in ((32, 32), (64, 64), (128, 32)):
        if bits == 3 and G < 32:
            continue
        assert qg.eligible(x, bits, G) and qg.eligible(x, bits, G, GV)
        for v in (None, valid):
            got_k = qp.quantize_keys(x, bits, G, v)
            got_v = qp.quantize_values(x, bits, GV, G, v)
            for a, b in zip(got_k, ref.quantize_keys(x, bits, G, v)):
                assert torch.equal(a, b), (bits, G, "keys")
            for a, b in zip(got_v, ref.quantize_values(x, bits, GV, G, v)):
                assert torch.equal(a, b), (bits, G, GV, "values")
            monkeypatch.setattr(qp, "GLUON", False)
            for a, b in zip(got_k, qp.quantize_keys(x, bits, G, v)):
                assert torch.equal(a, b)
            monkeypatch.setattr(qp, "GLUON", True)
