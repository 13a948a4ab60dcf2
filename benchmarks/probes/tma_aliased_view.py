"""Probe (GPU, Hopper): does the driver take a TMA tensor map whose dims alias (two dims stepping
over the same rows), and do its boxes land as the strides say? This is the plan for the TMA
ring's remaining shared-memory bank conflicts (docs/KERNEL_LOG.md, "What bounds the TMA ring"):

* value scales, ``[rows, 4]`` int32 (16-byte rows): the view ``[n - 16, 2, 4]`` with strides
  ``(4, 64, 1)`` and box ``[16, 2, 4]`` puts rows ``r`` and ``r + 16`` of a step side by side in
  shared memory (``8 r + 4 h + w``), so the lanes that read both no longer share banks;
* key scales, ``[groups, 64]`` int32: the view ``[n - SG + 1, 16, SG, 4]`` with strides
  ``(64, 4, 64, 1)`` and box ``[1, 16, SG, 4]`` interleaves a step's SG group rows by 16 bytes.

Each case copies boxes at several rows (the last ones up to the view's end) with Triton's tensor
descriptors and compares them with the same elements read by indexing. Prints one line per case.

    PYTHONPATH=src python3 benchmarks/probes/tma_aliased_view.py
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _copy3(desc, out, row, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr):
    x = desc.load([row, 0, 0])
    i = tl.arange(0, B0)[:, None, None]
    j = tl.arange(0, B1)[None, :, None]
    k = tl.arange(0, B2)[None, None, :]
    tl.store(out + (i * B1 + j) * B2 + k, x)


@triton.jit
def _copy4(desc, out, row, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr):
    x = desc.load([row, 0, 0, 0]).reshape(B1, B2, B3)
    i = tl.arange(0, B1)[:, None, None]
    j = tl.arange(0, B2)[None, :, None]
    k = tl.arange(0, B3)[None, None, :]
    tl.store(out + (i * B2 + j) * B3 + k, x)


def value_scales(n: int) -> str:
    t = torch.arange(n * 4, dtype=torch.int32, device="cuda").view(n, 4)
    shape, strides = [n - 16, 2, 4], [4, 64, 1]
    view = t.as_strided(shape, strides)
    desc = TensorDescriptor(view, shape, strides, [16, 2, 4])
    bad = []
    for row in sorted({0, 1, 32, n - 48, n - 33, n - 32, n - 17} & set(range(n - 16))):
        out = torch.full((16, 2, 4), -1, dtype=torch.int32, device="cuda")
        _copy3[(1,)](desc, out, row, 16, 2, 4)
        pad = torch.cat([t, torch.zeros(32, 4, dtype=t.dtype, device=t.device)])
        want = torch.stack([pad[row:row + 16], pad[row + 16:row + 32]], dim=1)
        want[max(0, n - 16 - row):] = 0  # rows past the view's outer extent come back zero
        if not torch.equal(out, want):
            bad.append(row)
    return f"value scales n={n}: " + ("ok" if not bad else f"MISMATCH at rows {bad}")


def key_scales(n: int, SG: int) -> str:
    t = torch.arange(n * 64, dtype=torch.int32, device="cuda").view(n, 64)
    shape, strides = [n - SG + 1, 16, SG, 4], [64, 4, 64, 1]
    view = t.as_strided(shape, strides)
    desc = TensorDescriptor(view, shape, strides, [1, 16, SG, 4])
    bad = []
    for row in sorted({0, SG, n - 2 * SG, n - SG} & set(range(n - SG + 1))):
        out = torch.full((16, SG, 4), -1, dtype=torch.int32, device="cuda")
        _copy4[(1,)](desc, out, row, 16, SG, 4)
        want = t[row:row + SG].view(SG, 16, 4).permute(1, 0, 2)
        if not torch.equal(out, want):
            bad.append(row)
    return f"key scales n={n} SG={SG}: " + ("ok" if not bad else f"MISMATCH at rows {bad}")


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    for case in (lambda: value_scales(256), lambda: value_scales(200), lambda: key_scales(64, 2),
                 lambda: key_scales(64, 4), lambda: key_scales(66, 2)):
        try:
            print(case(), flush=True)
        except Exception as e:  # noqa: BLE001 - a probe: report the refusal and go on
            print("REFUSED:", type(e).__name__, str(e)[:300], flush=True)
