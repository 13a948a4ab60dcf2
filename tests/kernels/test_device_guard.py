"""Kernels launch on their tensors' GPU, not on the current one (models spread over GPUs).

Triton launches on the current CUDA device. A model loaded with ``device_map="auto"`` over two
GPUs runs its second half's layers with tensors on ``cuda:1`` while ``cuda:0`` stays current;
every op of :mod:`kvbits.ops` makes the tensors' device current around its launches
(``ops.on_device``). The rule is checked on the CPU; the launch itself where two GPUs are.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from test_decode_attention import Case, _query_and_args, compare, make_kv

from kvbits import ops
from kvbits.reference.attention import decode_attention as reference


class _Recorder:
    """Stands in for ``torch.cuda.device``: records the devices made current."""

    def __init__(self):
        self.entered = []

    def __call__(self, device):
        @contextlib.contextmanager
        def ctx():
            self.entered.append(device)
            yield
        return ctx()


@pytest.mark.parametrize(("current", "index", "switches"), [(0, 1, True), (1, 1, False),
                                                            (0, None, False)])
def test_on_device_makes_the_tensor_device_current(monkeypatch, current, index, switches):
    rec = _Recorder()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(torch.cuda, "device", rec)
    x = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", index)
                              if index is not None else torch.device("cuda"))
    with ops.on_device(x):
        pass
    assert rec.entered == ([x.device] if switches else [])


def test_on_device_is_a_no_op_off_cuda(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(torch.cuda, "device", rec)
    with ops.on_device(torch.zeros(1)):
        pass
    assert rec.entered == []


def test_every_kernel_entry_point_is_guarded(monkeypatch):
    """Each op that launches kernels calls them inside ``on_device`` of its input."""
    import kvbits.kernels.decode_attention as da
    import kvbits.kernels.quantize_pack as qp

    inside = []
    calls = []

    @contextlib.contextmanager
    def spy(x):
        inside.append(x)
        yield
        inside.pop()

    def stub(name):
        def kernel(x, *args, **kwargs):
            calls.append((name, list(inside) == [x]))
        return kernel
    monkeypatch.setattr(ops, "on_device", spy)
    monkeypatch.setattr(ops, "kernel_reads", lambda kv: True)
    monkeypatch.setattr(ops, "_check_call", lambda *a: None)  # (no layer here)
    monkeypatch.setenv("KVBITS_KERNELS", "triton")
    for mod, name in ((qp, "quantize_keys"), (qp, "quantize_values"), (da, "decode_attention")):
        monkeypatch.setattr(mod, name, stub(name))
    k = torch.zeros(1, 1, 32, 64)
    ops.quantize_keys(k, 2, 32)
    ops.quantize_values(k, 2, 32, 32)
    ops.decode_attention(k, None, scale=1.0)
    assert calls == [("quantize_keys", True), ("quantize_values", True),
                     ("decode_attention", True)]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kernels_on_the_second_gpu_while_the_first_is_current():
    """Quantize + attend with every tensor on ``cuda:1`` and ``cuda:0`` current: equal to the
    reference on the same codes (an unguarded launch fails or reads ``cuda:0``'s memory)."""
    c = Case(kb=2, vb=2, G=32, D=128, B=2, Hkv=2, HG=4, body=2048, res=64, S=4)
    torch.cuda.set_device(0)
    kv = make_kv(c, device="cuda:1")
    q, args = _query_and_args(c, device="cuda:1")
    out = ops.decode_attention(q, kv, **args)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    compare(out, reference(q, kv, **args), c.dtype, str(c))
    k = torch.randn(2, 2, 64, 128, dtype=torch.float16, device="cuda:1")
    with torch.cuda.device(1):
        want = ops.quantize_keys(k, 2, 32)
    got = ops.quantize_keys(k, 2, 32)  # cuda:0 current again
    assert torch.cuda.current_device() == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("gluon", [False, True])
def test_repeated_calls_on_two_gpus_keep_their_own_launch_plans(gluon):
    """The same layer shape attended on ``cuda:1`` and on ``cuda:0``, call after call (the
    later calls through kernels.launch's plans, which are per device), through the Triton
    kernel alone or with the Gluon body: every output equals the reference on its own GPU."""
    from kvbits.kernels.decode_attention import decode_attention

    torch.cuda.set_device(0)
    for rep in range(3):
        c = Case(kb=2, vb=2, G=32, D=128, B=2, Hkv=2, HG=4, body=4096, res=64, S=0, seed=rep)
        for dev in ("cuda:1", "cuda:0"):
            kv = make_kv(c, device=dev)
            q, args = _query_and_args(c, device=dev)
            with torch.cuda.device(torch.device(dev)):
                out = decode_attention(q, kv, gluon=gluon, **args)
            torch.cuda.synchronize(torch.device(dev))
            assert torch.cuda.current_device() == 0
            compare(out, reference(q, kv, **args), c.dtype, f"{dev} rep {rep} gluon {gluon}")
