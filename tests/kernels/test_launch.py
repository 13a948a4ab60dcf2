"""kvbits.kernels.launch.FastLaunch: a specialization's later launches skip Triton's binder.

CPU: the key's classes agree with Triton's own binder (the rules the fast path relies on) over
integers, alignments and bools, and a launch on CPU tensors (the interpreter) goes through the
JIT without keeping a plan. GPU: launches through a plan compute what the JIT computes, a new
class (alignment, an integer equal to 1 or divisible by 16) never reuses another class's kernel,
and repeated decode calls through the plans match the reference."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from kvbits.kernels.launch import FastLaunch, Keywords, hooked, keyword_maker

CUDA = torch.cuda.is_available()


def _axpb_fn(X, Y, n, m, f, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    """``Y[i] = X[i] * n + m (+ f where FLAG)`` for ``i < n``: ``n`` is specialized (its
    divisibility feeds the mask), ``m`` is not."""
    i = tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < n, other=0.0)
    y = x * n + m
    if FLAG:
        y = y + f
    tl.store(Y + i, y, mask=i < n)


_axpb = triton.jit(do_not_specialize=("m",))(_axpb_fn)  # interpreted on a CPU-only machine
_axpb_jit = JITFunction(_axpb_fn, do_not_specialize=("m",))  # the binder's rules, anywhere


def _reference(x, n, m, f, flag):
    y = torch.zeros_like(x)
    y[:n] = x[:n] * n + m + (f if flag else 0.0)
    return y


def test_classes_agree_with_the_binder():
    """The fast path's classes are Triton's: for every (alignment, specialized integer,
    unspecialized integer, bool-like constexpr) the binder's specialization matches."""
    binder = create_function_from_signature(_axpb_jit.signature, _axpb_jit.params,
                                            make_backend(GPUTarget("cuda", 90, 32)))
    launch = FastLaunch(_axpb_jit)
    x = torch.zeros(64)
    checked = 0
    for t in (x, x[1:], x[4:]):
        for n in (0, 1, 2, 16, 17, 48, -3, 2**31, 2**31 + 16, -2**40, 2**63):
            for m in (1, 16, 2**40):
                args = (t, t, n, m, 1.5)
                spec = binder(*args, FLAG=True, BLOCK=64)[1]
                assert FastLaunch.agrees(launch.classes(args), spec), (args, spec)
                checked += 1
    assert checked == 3 * 11 * 3


def test_generated_key_is_the_classes():
    """The per-kernel generated key (built from the first launch's argument types) gives the
    same classes as the readable classifier for random integers and alignments, and None for an
    argument of another type (that launch goes through the JIT)."""
    import random

    from kvbits.kernels.launch import _key_function

    launch = FastLaunch(_axpb_jit)
    x = torch.zeros(64)
    fast = _key_function((x, x, 16, 5, 1.0), launch._specialized, launch._aligned)
    rng = random.Random(0)
    ints = [0, 1, 2, 16, 17, -3, -16, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**40 + 16, 2**63,
            2**64]
    for _ in range(500):
        args = (x[rng.choice((0, 1, 4))], x[rng.choice((0, 2))], rng.choice(ints),
                rng.choice(ints), rng.random())
        assert fast(*args) == tuple(launch.classes(args))
    assert fast(x, x, 16, 5, 1) is None  # an int where the float was
    assert fast(x, 3, 16, 5, 1.0) is None  # an int where a tensor was


def test_agrees_refuses_other_classes():
    """A key whose class the binder does not confirm keeps no plan."""
    launch = FastLaunch(_axpb_jit)
    x = torch.zeros(64)
    parts = launch.classes((x, x, 16, 5, 1.0))
    assert not FastLaunch.agrees(parts, [("*fp32", ""), ("*fp32", "D"), ("i32", "D"),
                                         ("i32", None), ("fp32", None)])
    assert not FastLaunch.agrees(parts, [("*fp32", "D"), ("*fp32", "D"), ("i32", ""),
                                         ("i32", None), ("fp32", None)])
    assert not FastLaunch.agrees(parts, [("*fp32", "D"), ("*fp32", "D"), ("constexpr", 1),
                                         ("i32", None), ("fp32", None)])
    assert launch.classes((x, x, 16, (1, 2), 1.0)) is None  # a tuple: the JIT's


def test_only_real_hooks_send_launches_to_the_jit():
    """Triton 3.6+ keeps an empty hook chain: that is no hook (the fast path stays on)."""
    from triton import knobs

    chain = type(knobs.runtime.launch_enter_hook)
    assert not hooked(None)
    if hasattr(chain, "add"):
        empty = chain()
        assert not hooked(empty)
        empty.add(print)
        assert hooked(empty)
    assert hooked(print)


def test_other_jit_internals_fall_back_for_good():
    """A JIT function without Triton 3.4-3.9's per-device binder: no plan, and every later
    launch of that wrapper goes through the JIT."""

    class OtherJIT:
        params = _axpb_jit.params

        def __getitem__(self, grid):
            return lambda *a, **kw: "launched"

    launch = FastLaunch(OtherJIT())
    x = torch.zeros(4)
    launch._plan((0, *launch.classes((x, x, 16, 5, 1.0))), object(), (x, x, 16, 5, 1.0), {})
    assert launch._jit_only and not launch._plans
    assert launch.run((1,), (x, x, 16, 5, 1.0), {}) == "launched"


def test_keywords_are_made_once_and_key_by_value():
    """``keyword_maker`` returns the same :class:`Keywords` for the same values (a decode step
    reuses the step before's), distinct ones for other values, refuses a wrong count; equal
    keywords are equal plan-key parts whichever object holds them."""
    make = keyword_maker(("FLAG", "BLOCK"))
    a = make(True, 64)
    assert a is make(True, 64) and a.kwargs == {"FLAG": True, "BLOCK": 64}
    assert make(False, 64) != a and make(True, 32) != a
    other = Keywords({"FLAG": True, "BLOCK": 64})
    assert other == a and hash(other) == hash(a) and len({a: 1, other: 2}) == 1
    assert Keywords({"BLOCK": 64, "FLAG": True}) != a  # the order of a call's keywords counts
    with pytest.raises(TypeError, match="expected 2 keyword values"):
        make(True)


@pytest.mark.skipif(CUDA, reason="the CPU path")
def test_keywords_launch_on_cpu_goes_through_the_jit():
    launch = FastLaunch(_axpb)
    x = torch.randn(64)
    y = torch.zeros(64)
    launch.launch((1,), (x, y, 17, 3, 0.5), keyword_maker(("FLAG", "BLOCK"))(False, 64))
    torch.testing.assert_close(y, _reference(x, 17, 3, 0.5, False))
    assert not launch._plans


@pytest.mark.skipif(CUDA, reason="the CPU path")
def test_cpu_launch_goes_through_the_jit():
    launch = FastLaunch(_axpb)
    x = torch.randn(64)
    for n in (16, 17):
        y = torch.zeros(64)
        launch[(1,)](x, y, n, 3, 0.5, FLAG=True, BLOCK=64)
        torch.testing.assert_close(y, _reference(x, n, 3, 0.5, True))
    assert not launch._plans


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_plans_compute_what_the_jit_computes():
    """Launch after launch through the plans: new data, every class of ``n``, a misaligned
    pointer (its own plan and kernel), ``m`` past int32 (an i64 kernel); each result equals the
    reference."""
    launch = FastLaunch(_axpb)
    base = torch.randn(80, device="cuda")
    for rep in range(3):
        for n in (16, 17, 1, 48, 33):
            for off in (0, 1, 4):
                for m in (5, 2**33):
                    x = (base + rep)[off:off + 64]  # off 1: 4-byte aligned only
                    y = torch.zeros(64, device="cuda")
                    if off == 4:  # the same launch with its keywords built once (Keywords)
                        launch.launch((1,), (x, y, n, m, 0.25),
                                      keyword_maker(("FLAG", "BLOCK"))(rep % 2 == 0, 64))
                    else:
                        launch[(1,)](x, y, n, m, 0.25, FLAG=rep % 2 == 0, BLOCK=64)
                    want = _reference(x.double(), n, m, 0.25, rep % 2 == 0)
                    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=m * 1e-6)
    aligned = {k[1][2] for k in launch._plans}  # X's class in each plan's key
    assert aligned == {True, False}  # plans of both alignments, each reused


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4", "kvquant-3"])
def test_repeated_decode_calls_match_the_reference(preset, monkeypatch):
    """decode_attention called again and again on one layer (the second call on goes through
    the plans), with fresh queries, a query view at an odd offset, and a layer that grew by a
    group: every output equals the reference, and bit for bit the JIT's own launch of it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from common import random_packed_kv

    from kvbits.kernels import decode_attention as da
    from kvbits.kernels import launch
    from kvbits.reference.attention import decode_attention as reference
    from kvbits.spec import resolve_spec

    spec = resolve_spec(preset)
    for T in (4096, 4096 + 32):
        kv = random_packed_kv(2, 2, T, 128, spec)
        for rep in range(4):
            buf = torch.randn(2 * 8 * 128 + rep, dtype=torch.float16, device="cuda")
            q = buf[rep:rep + 2 * 8 * 128].view(2, 8, 1, 128)
            got = da.decode_attention(q.contiguous() if rep % 2 else q, kv, scale=0.088)
            monkeypatch.setattr(launch, "ENABLED", False)
            jit = da.decode_attention(q, kv, scale=0.088)
            monkeypatch.setattr(launch, "ENABLED", True)
            assert torch.equal(got, jit)
            want = reference(q.float(), kv, scale=0.088)
            err = (got.float() - want).norm() / want.norm()
            assert err < 1e-2, (T, rep, float(err))
    assert da._FINISH._plans


def test_descriptor_arguments_have_a_class():
    """A TMA descriptor argument (the ring's kernel takes six) keys its plan by what the JIT
    specializes it on (dtype, block shape, shared layout), not by its buffer, so a layer's
    next step reuses the plan; another block shape or layout is another class, and a tensor
    where the descriptor was sends the launch through the JIT."""
    dt = pytest.importorskip("kvbits.kernels.decode_gluon_tma")
    if dt.gluon is None:
        pytest.skip("this Triton has no Gluon")
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kvbits.kernels.launch import _descriptor_class, _key_function

    def desc(t, block, swizzle=128):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle, element_bitwidth=32, rank=3)
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)
    a = torch.zeros(64, 4, 32, dtype=torch.int32)
    b = torch.zeros(128, 4, 32, dtype=torch.int32)  # another buffer and shape, the same class
    launch = FastLaunch(_axpb_jit)
    x = torch.zeros(64)
    args = (x, desc(a, [4, 2, 32]), 16, 5, 1.0)
    fast = _key_function(args, launch._specialized, launch._aligned)
    assert fast(*args) == tuple(launch.classes(args))
    again = (x, desc(b, [4, 2, 32]), 16, 5, 1.0)
    assert fast(*again) == fast(*args)
    assert fast(x, desc(a, [2, 2, 32]), 16, 5, 1.0) != fast(*args)  # block shape
    assert fast(x, desc(a, [4, 2, 32], swizzle=0), 16, 5, 1.0) != fast(*args)  # layout
    assert fast(x, x, 16, 5, 1.0) is None  # a tensor where the descriptor was
    assert _descriptor_class(args[1])[:3] == ("d", torch.int32, (4, 2, 32))
    assert FastLaunch.agrees(launch.classes(args), [("*fp32", "D"), ("tensordesc<...>", None),
                                                    ("i32", "D"), ("i32", None), ("fp32", None)])
