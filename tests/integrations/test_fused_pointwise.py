"""Tests for kvbits.integrations.fused_pointwise: the decode loop with the steps' norms, MLP
activation and RoPE compiled.

On the CPU the compile runs with the ``aot_eager`` backend (dynamo's tracing, guards and graph
splitting, without generating kernels, so no C++ compiler is needed): the tokens must equal the
unfused loop's, each compiled function must trace once for all layers (a guard on a layer index
or a cache length would recompile per layer or per step), and the model must be restored after.
Inductor's kernels inside captured CUDA graphs are checked on a GPU
(``test_decode_loop.test_gpu_fused_pointwise_under_graphs``).
"""

from __future__ import annotations

import pytest
import torch

from kvbits.integrations.decode_loop import GreedyDecoder
from kvbits.integrations.fused_pointwise import fused_pointwise
from kvbits.integrations.hf import KVBitsCache


def tiny(arch: str):
    """A random 3-layer model of ``arch`` with a peaked output distribution."""
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    if arch == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(head_dim=16, **common))
    elif arch == "qwen2":  # q/k/v biases
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    elif arch == "qwen3":  # per-head q/k RMSNorms inside the attention
        m = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, **common))
    elif arch == "phi3":  # fused qkv and gate_up projections
        m = tf.Phi3ForCausalLM(tf.Phi3Config(pad_token_id=0, **common))
    else:  # gemma3: (1 + w) norms, four norms per layer, sliding and full layers
        m = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            head_dim=16, sliding_window=16, layer_types=["sliding_attention"] * 2
            + ["full_attention"], **common))
    m = m.eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    return m


@pytest.mark.parametrize("arch,preset", [("llama", "kivi-2"), ("llama", "fp16"),
                                         ("qwen2", "kivi-2"), ("qwen3", "kivi-4"),
                                         ("phi3", "kivi-2"), ("gemma3", "kivi-2")])
def test_fused_decode_is_unchanged_compiles_once_and_restores(arch, preset):
    import torch._dynamo
    from torch._dynamo.utils import counters

    m = tiny(arch)
    ids = torch.randint(1, 96, (2, 37), generator=torch.Generator().manual_seed(3))
    kw = dict(residual_length=4, group_size=32)
    want = GreedyDecoder(m, KVBitsCache(m, preset, **kw), graphs=False).generate(ids, 40)
    before = {sub: dict(sub.__dict__) for sub in m.modules()}
    attn_module = __import__(type(m).__module__, fromlist=["x"])
    rope = getattr(attn_module, "apply_rotary_pos_emb", None)
    torch._dynamo.reset()
    counters.clear()
    got = GreedyDecoder(m, KVBitsCache(m, preset, **kw), graphs=False,
                        fuse="aot_eager").generate(ids, 40)
    assert torch.equal(got, want)
    # one graph per compiled function and input rank at the decode shape, whatever the layer
    # count: norm classes (+1 where per-head q/k norms see 4-D inputs) + MLP + RoPE
    n_norms = len({type(s) for s in m.modules() if type(s).__name__.endswith("RMSNorm")})
    head_norms = any(name.endswith("q_norm") for name, _ in m.named_modules())
    assert counters["frames"]["ok"] == n_norms + head_norms + 2, dict(counters["frames"])
    assert getattr(attn_module, "apply_rotary_pos_emb", None) is rope
    assert {sub: dict(sub.__dict__) for sub in m.modules()} == before


def test_fused_pointwise_scope_and_errors():
    m = tiny("llama")
    with fused_pointwise(m, "eager") as n:  # 2 norms x 3 layers + final norm, 3 MLPs, RoPE
        assert n == 7 + 3 + 1
        assert all("forward" in s.__dict__ for s in m.modules()
                   if type(s).__name__.endswith(("RMSNorm", "MLP")))
    assert not any("forward" in s.__dict__ for s in m.modules())
    with pytest.raises(RuntimeError, match="boom"), fused_pointwise(m, "eager"):
        raise RuntimeError("boom")  # restored on errors too
    assert not any("forward" in s.__dict__ for s in m.modules())
    hooked = m.model.layers[0].mlp  # an instance-level forward (e.g. an offload hook) stays
    hooked.forward = hook = lambda x: type(hooked).forward(hooked, x)  # noqa: E731
    with fused_pointwise(m, "eager") as n:
        assert n == 7 + 2 + 1 and hooked.forward is hook
    assert hooked.forward is hook
    del hooked.forward
    with pytest.raises(ValueError, match="backend"):
        with fused_pointwise(m, "fast"):
            pass
    with pytest.raises(ValueError, match="fuse"):
        GreedyDecoder(m, KVBitsCache(m, "kivi-2"), fuse="fast")
