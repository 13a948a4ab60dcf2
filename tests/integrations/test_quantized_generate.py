"""transformers ``generate()`` with *quantized* presets: properties that must hold whatever
the preset (``test_generate_features.py`` checks the FP16 preset against ``DynamicCache``).

Tiny random decoders (a Llama, and a Mistral whose 24-token sliding window the runs cross)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as tf

from kvbits.integrations.hf import KVBitsCache, cache_kwargs

COMMON = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 32, "max_position_embeddings": 512, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/integrations/conftest.py


def tiny(arch: str):
    torch.manual_seed(0)
    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON)).eval()
    return tf.MistralForCausalLM(tf.MistralConfig(sliding_window=24, **COMMON)).eval()


def generate(model, ids, cache, mask=None, new=24, **kw):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids) if mask is None
                             else mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True,
                             **cache_kwargs(model, cache), **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("preset,pad,short,chunk,tol", [
    # the first chunk is all padding and flushes (R=0). Alone, the sequence's first chunk is
    # its prompt step, at full precision; in the batch its rows attend as generated (the last
    # one sees the group it brings due quantized), so the second layer's keys differ a little
    ("fp8-dynamic", 32, 40, 32, (5e-3, 1e-2)),
    ("fp8-dynamic:R=8", 64, 40, 32, (1e-4, 1e-5)),  # chunks of padding, flushes of it alone
    ("fp8-dynamic:R=8", 32, 40, None, (1e-4, 1e-5)),
    ("fp8-dynamic:R=8", 32, 30, None, (1e-4, 1e-5)),  # a prompt shorter than R + G: later
])                                                  # tokens are flushed with it, as alone
def test_fp8_dynamic_left_padded_batch_equals_single_runs(arch, preset, pad, short, chunk, tol):
    """fp8-dynamic's scales belong to each sequence's own tokens: a left-padded sequence gets
    the scales, tokens and logits it gets alone (padding of whole groups, prefill chunks that
    line up with its own). Its scales were set by the batch's first flush: from padding alone
    where that flush held no token of its own (scale 1 for ever: a prompt prefilled in chunks
    whose first chunk is its padding; logits 0.01-0.9 off, other tokens), else from the few
    tokens of its own the flush held (not the ones its own first flush holds alone)."""
    model = tiny(arch)
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, 256, (1, pad + short), generator=g),
            torch.randint(3, 256, (1, short), generator=g)]
    ids = torch.cat([rows[0], torch.cat([torch.zeros(1, pad, dtype=torch.long), rows[1]], 1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    kw = {} if chunk is None else {"prefill_chunk_size": chunk}
    batch = KVBitsCache(model, preset)
    tokens, logits = generate(model, ids, batch, mask, **kw)
    for b, x in enumerate(rows):
        alone = KVBitsCache(model, preset)
        want_tokens, want = generate(model, x, alone, **kw)
        assert tokens[b].tolist() == want_tokens[0].tolist(), b
        torch.testing.assert_close(logits[b], want[0], atol=tol[0], rtol=0)
        for s, a in zip(batch.stores, alone.stores):
            assert a._fp8_ready and s._fp8_ready  # (set, and fixed: the windows evict)
            torch.testing.assert_close(s.k_scale[b], a.k_scale[0], atol=0, rtol=tol[1])
            torch.testing.assert_close(s.v_scale[b], a.v_scale[0], atol=0, rtol=tol[1])


@pytest.mark.parametrize("mode", ["prompt-lookup", "assistant"])
def test_fp8_dynamic_scales_survive_crops_after_the_window_emptied_the_body(mode):
    """Mistral (24-token window), fp8-dynamic with an FP16 residual of 16: drafting (prompt
    lookup, an assistant model) gives the tokens and the scales of plain greedy decoding. The
    window evicts every quantized group now and then, and a crop of rejected drafts that
    found the body empty took the scales as unset: the next flush set them again from other
    tokens (scales 41% off; with a 70-token prompt the tokens parted from greedy's after 57
    steps). The prompt (30 tokens) and its first drafts flush nothing: the scales that the
    prompt's forward sets with its drafts are a documented exception (hf module docstring)."""
    model = tiny("mistral")
    phrase = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    x = phrase.repeat(1, 2)[:, :30]  # a repeat: prompt lookup finds drafts
    if mode == "prompt-lookup":
        kw = {"prompt_lookup_num_tokens": 10}
    else:
        draft = copy.deepcopy(model)
        g = torch.Generator().manual_seed(6)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
        kw = {"assistant_model": draft, "num_assistant_tokens": 10}
    greedy = KVBitsCache(model, "fp8-dynamic:R=16")
    want = generate(model, x, greedy, new=100)[0]
    drafted = KVBitsCache(model, "fp8-dynamic:R=16")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=100, min_new_tokens=100, pad_token_id=0,
                             **cache_kwargs(model, drafted), **kw)[:, 30:]
    assert all(s.evicted for s in drafted.stores)
    for a, b in zip(drafted.stores, greedy.stores):  # (draft rows: other float rounding)
        torch.testing.assert_close(a.k_scale, b.k_scale, atol=0, rtol=1e-5)
        torch.testing.assert_close(a.v_scale, b.v_scale, atol=0, rtol=1e-5)
    assert got.tolist() == want.tolist()
