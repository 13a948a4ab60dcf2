"""Probe (GPU): a left-padded batch whose padding outlasts the prompt's first prefill chunks
(``prefill_chunk_size``), through the kernels: the padded row's logits at the prompt's end
against the unchunked run and DynamicCache (session 33's fix of the padding read from the first
chunk only; the CPU test is ``test_chunked_prefill_with_padding_longer_than_a_chunk``).

    PYTHONPATH=src python3 benchmarks/probes/chunked_padding_gpu.py
"""
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvbits.integrations.hf import KVBitsCache, cache_kwargs

DEV = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64)
model = LlamaForCausalLM(cfg).eval().to(DEV, torch.float16 if DEV == "cuda" else torch.float32)
ids = torch.randint(3, 256, (2, 150), device=DEV)
for pad in (100, 96):
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0

    def first_logits(cache, chunk, mask=mask):
        kw = {"prefill_chunk_size": chunk} if chunk else {}
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                                 pad_token_id=0, output_scores=True,
                                 return_dict_in_generate=True, **cache_kwargs(model, cache), **kw)
        return out.scores[0].float()
    ref = first_logits(DynamicCache(), 0)
    for preset, kw in (("fp16", {}), ("kivi-4", {"residual_length": 96, "sink_tokens": 2}),
                       ("kivi-2", {"residual_length": 96})):
        for chunk in (0, 32):
            got = first_logits(KVBitsCache(model, preset, **kw), chunk)
            err = [(got[r] - ref[r]).abs().max().item() / ref[r].abs().max().item()
                   for r in (0, 1)]
            print(f"pad {pad} {preset} {kw} chunk {chunk}: rel err row 0 {err[0]:.2e}, "
                  f"row 1 (padded) {err[1]:.2e}", flush=True)
