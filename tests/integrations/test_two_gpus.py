"""A model spread over two GPUs, as ``device_map`` places one: its later layers, the final norm
and the head on ``cuda:1`` while ``cuda:0`` stays current, hidden states moved between them by
forward hooks (what accelerate's dispatch does). ``generate`` with a ``KVBitsCache`` must give
the tokens of the same model on one GPU: each layer's store, kernels and step graphs live on
its own device. ``graph_generate`` falls back to transformers' loop there (a CUDA graph
captures one device), with the same tokens. Skipped without two GPUs.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from test_decode_loop import prompt, tiny_llama
from torch.utils._pytree import tree_map

from kvbits.integrations import graph_generate
from kvbits.integrations.hf import KVBitsCache, cache_kwargs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

NEW = 120


def _moved(device):
    return lambda x: x.to(device) if isinstance(x, torch.Tensor) else x


def spread(model, first: int):
    """``model`` (on ``cuda:0``) with layers ``first:``, the norm and the head on ``cuda:1``;
    the logits come back to ``cuda:0``, where ``generate`` keeps its tokens."""
    second = torch.device("cuda", 1)
    for module in [*model.model.layers[first:], model.model.norm, model.lm_head]:
        module.to(second)
        module.register_forward_pre_hook(
            lambda m, args, kwargs: (tree_map(_moved(second), args),
                                     tree_map(_moved(second), kwargs)), with_kwargs=True)
    model.lm_head.register_forward_hook(lambda m, args, out: out.to("cuda:0"))
    return model


@pytest.fixture(scope="module")
def models():
    """(on one GPU, over two): 4 layers, head_dim 64 (the pre-RoPE kernels' smallest)."""
    torch.cuda.set_device(0)
    one = tiny_llama(0, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, num_hidden_layers=4,
                     max_position_embeddings=1024).half()
    two = spread(copy.deepcopy(one).cuda(0), 2)
    return one.cuda(0), two


def generate(model, ids, cache, **kw):
    with torch.no_grad(), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW, min_new_tokens=NEW, output_scores=True,
                             return_dict_in_generate=True, **cache_kwargs(model, cache), **kw)
    warned = [str(w.message) for w in warned if "kvbits" in str(w.message)
              or "graph_generate" in str(w.message)]
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1), warned


def agree(got, want, s_got, s_want, label):
    """Equal tokens until the first tie broken otherwise (>= 40 steps), scores close there."""
    same = int((got == want).all(0).int().cumprod(0).sum())
    assert same >= 40, (label, same)
    torch.testing.assert_close(s_got[:, :same].float(), s_want[:, :same].float(), atol=2e-2,
                               rtol=2e-2, msg=label)


@pytest.mark.parametrize("preset,kw", [("kivi-2", {}), ("kivi-4", {"sink_tokens": 2}),
                                       ("uniform-int4", {}),
                                       ("kvquant-3", {"calibration": "uniform"})])
@pytest.mark.parametrize("steps", ["auto", True, False])
def test_generate_over_two_gpus_as_on_one(models, preset, kw, steps, monkeypatch):
    from kvbits.kernels import decode_attention as da

    monkeypatch.setattr(da, "FINISH_FP_TOKENS", 0)  # one FP16 route, eager or captured
    monkeypatch.setattr(da, "MERGE_IN_SPLITS", "0")
    one, two = models
    ids = prompt(300, 2).cuda(0)
    kw = {"residual_length": 16, **kw}
    want, s_want, _ = generate(one, ids, KVBitsCache(one, preset, step_graphs=steps, **kw))
    cache = KVBitsCache(two, preset, step_graphs=steps, **kw)
    got, s_got, warned = generate(two, ids, cache)
    assert torch.cuda.current_device() == 0
    assert not warned, warned  # (a failed capture warns and goes on eagerly)
    devices = [store.device.index for store in cache.stores]
    assert devices == [0, 0, 1, 1], devices
    agree(got, want, s_got, s_want, f"{preset} step_graphs={steps}")


def test_graph_generate_falls_back_over_two_gpus(models):
    one, two = models
    ids = prompt(200, 1).cuda(0)
    want, s_want, _ = generate(one, ids, KVBitsCache(one, "kivi-2"))
    got, s_got, warned = generate(two, ids, KVBitsCache(two, "kivi-2"),
                                  custom_generate=graph_generate)
    assert any("spread over cuda:0, cuda:1" in w for w in warned), warned
    agree(got, want, s_got, s_want, "graph_generate")
