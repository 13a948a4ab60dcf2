"""Tests for kvbits.integrations.sampling: the capture-safe next-token choice, and the decode
loop with it. The draw must follow softmax(logits / T) restricted to the top-k / top-p set
(checked by frequencies over many independent rows), never leave that set, and reduce to the
argmax where the set has one token."""

from __future__ import annotations

import pytest
import torch

from kvbits.integrations.decode_loop import GreedyDecoder
from kvbits.integrations.hf import KVBitsCache
from kvbits.integrations.sampling import Sampling, next_token

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def expected(s: Sampling) -> torch.Tensor:
    """Reference probabilities in transformers' order: temperature, top-k, then top-p over the
    distribution renormalised on the top-k set."""
    p = (LOGITS / s.temperature).softmax(-1)
    order = p.argsort(descending=True).tolist()
    if s.top_k:
        order = order[: s.top_k]
    p_k = torch.zeros_like(p)
    p_k[order] = p[order] / p[order].sum()
    keep, mass = [], 0.0
    for j in order:
        if keep and mass >= s.top_p:
            break
        keep.append(j)
        mass += p_k[j].item()
    q = torch.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


@pytest.mark.parametrize("s", [Sampling(), Sampling(temperature=0.5), Sampling(top_k=3),
                               Sampling(top_p=0.8), Sampling(temperature=2.0, top_k=4,
                                                             top_p=0.9),
                               Sampling(temperature=1.5, top_k=3, top_p=0.7)])
def test_draws_follow_the_filtered_distribution(s):
    torch.manual_seed(0)
    n = 40000
    got = next_token(LOGITS.expand(n, -1), s).squeeze(1)
    freq = torch.bincount(got, minlength=LOGITS.numel()).double() / n
    want = expected(s).double()
    assert torch.all(freq[want == 0] == 0), (freq, want)  # never outside the kept set
    tol = 5 * (want * (1 - want) / n).sqrt() + 1e-9  # five standard errors per token
    assert torch.all((freq - want).abs() <= tol), (freq, want)


def test_one_token_sets_are_the_argmax_and_bad_knobs_are_refused():
    x = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    arg = x.argmax(-1, keepdim=True)
    assert torch.equal(next_token(x, None), arg)
    assert torch.equal(next_token(x, Sampling(top_k=1)), arg)
    assert torch.equal(next_token(x, Sampling(top_p=1e-6)), arg)
    assert torch.equal(next_token(x.half(), Sampling(top_k=1)), arg)  # FP16 logits too
    # a vanishing temperature is the argmax (logits / 1e-38 overflowed: inf - inf = NaN)
    assert torch.equal(next_token(x * 100, Sampling(temperature=1e-38)), arg)
    # (a float or bool top_k was taken, then failed in topk at the first draw)
    for bad in ({"temperature": 0.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5},
                {"top_k": 2.5}, {"top_k": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampling(**bad)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16)).eval()


def test_sampled_decoding_is_seeded_and_reduces_to_greedy():
    m = tiny_llama()
    ids = torch.randint(1, 96, (2, 37), generator=torch.Generator().manual_seed(2))

    def run(sampling, seed=0):
        torch.manual_seed(seed)
        cache = KVBitsCache(m, "kivi-2", residual_length=4, group_size=32)
        return GreedyDecoder(m, cache, graphs=False, sampling=sampling).generate(ids, 40)
    greedy = run(None)
    assert torch.equal(run(Sampling(top_k=1)), greedy)
    a, b, c = run(Sampling(), 1), run(Sampling(), 1), run(Sampling(), 2)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, greedy)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_sampled_decoding_under_graphs():
    """The draw inside the two captured step graphs: fresh numbers at every replay (not one
    token repeated), the same tokens for the same seed, and top-k 1 equal to greedy."""
    m = tiny_llama().half().cuda()
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(2)).cuda()

    def run(sampling, seed=0):
        torch.manual_seed(seed)
        dec = GreedyDecoder(m, KVBitsCache(m, "kivi-2"), graphs=True, sampling=sampling)
        out = dec.generate(ids, 200)
        assert dec.captures == 2
        return out
    a, b, c = run(Sampling(), 1), run(Sampling(), 1), run(Sampling(), 2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.unique().numel() > 20  # a random model: draws spread over the vocabulary
    assert torch.equal(run(Sampling(top_k=1)), run(None))
