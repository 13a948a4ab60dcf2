"""``model.generate(..., custom_generate=graph_generate)``: transformers' ``generate`` with its
decoding loop replaced by :class:`~kvbits.integrations.decode_loop.GreedyDecoder`, whose steps
are replayed from CUDA graphs.

Why: eager ``generate`` is bound by host time at small batch (tens of ms of Python and launches
per step against a few ms of GPU work for a 7-8B model on an H200, ``benchmarks/results/e2e.md``),
so no cache shows its GPU speed there. transformers (5.x) calls a callable ``custom_generate``
in place of its own loop, after preparing the inputs, the generation config, the logits
processors and the stopping criteria; so a user keeps ``generate``'s API and output: the prompt
followed by the new tokens, stopped at max length or when every sequence has produced an EOS
token, with the tokens after a sequence's own EOS replaced by the pad token (what ``generate``
returns).

Served here: a :class:`~kvbits.integrations.hf.KVBitsCache` or transformers' ``StaticCache``;
greedy decoding, or sampling with temperature / top-k / top-p (drawn inside the graph,
:mod:`~kvbits.integrations.sampling`; a draw of its own, so sampled tokens do not repeat
``generate``'s under the same seed); ``min_new_tokens`` / ``min_length`` (EOS banned until
then, inside the graph); ``repetition_penalty`` (the tokens seen, prompt included, its left
padding not, kept as a device mask); stopping on max length and EOS; left-padded batches with a
KVBitsCache.
A streamer (batch 1) gets each token as the step that made it ends (one synchronisation per
step); ``return_dict_in_generate`` gives the sequences and the cache. Anything else (another
logits processor such as ``no_repeat_ngram_size``, served processors given to ``generate`` in
another order or twice, a stopping criterion given with other values than the config's,
``use_cache=False``, scores, logits, attentions or hidden states as output, a padded
StaticCache, another cache, a model spread over several GPUs) runs transformers' own loop,
with a warning that names the reason. Beam search and assisted
decoding are refused. On the CPU the same loop runs its steps eagerly.
"""

from __future__ import annotations

import sys
import warnings
from typing import NamedTuple

import torch

from .decode_loop import GreedyDecoder, is_stop, model_gpus
from .hf import KVBitsCache
from .sampling import Sampling

__all__ = ["graph_generate"]

_OUTPUT_FLAGS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
_STOPS = ("MaxLengthCriteria", "EosTokenCriteria")
# Tensor inputs of ``model_kwargs`` the loop feeds (or, for positions, makes itself); any other
# (``inputs_embeds``, ``token_type_ids``, ``pixel_values``) it would drop, so transformers' loop
# serves those calls.
_FED = ("attention_mask", "position_ids", "cache_position")


def graph_generate(model, input_ids: torch.Tensor, logits_processor, stopping_criteria,
                   generation_config, synced_gpus: bool = False, streamer=None, *,
                   fuse: str | None = None, **model_kwargs):
    """The decoding loop ``generate`` calls (its ``_sample``'s signature). ``fuse``: passed to
    :class:`~kvbits.integrations.decode_loop.GreedyDecoder`; give it to ``generate``
    (``generate(..., custom_generate=graph_generate, fuse="inductor")``), which hands a
    callable's own extra parameters on."""
    if streamer is None:
        streamer = _generate_streamer(model)
    if generation_config.num_beams != 1 or any(
            k in model_kwargs for k in ("assistant_model", "candidate_generator")):
        raise ValueError("graph_generate: decodes greedily or by sampling (num_beams=1, no "
                         f"assistant model); got num_beams={generation_config.num_beams}")
    cache = model_kwargs.get("past_key_values", model_kwargs.get("cache"))
    rules, reason = _plan(model, cache, logits_processor, stopping_criteria, generation_config,
                          synced_gpus, streamer, model_kwargs.get("attention_mask"),
                          *input_ids.shape, inputs=[k for k, v in model_kwargs.items()
                                                    if isinstance(v, torch.Tensor)
                                                    and k not in _FED])
    if reason is not None:
        warnings.warn(f"graph_generate: {reason}; transformers' own decoding loop runs instead",
                      stacklevel=2)
        return type(model)._sample(model, input_ids, logits_processor=logits_processor,
                                   stopping_criteria=stopping_criteria,
                                   generation_config=generation_config, synced_gpus=synced_gpus,
                                   streamer=streamer, **model_kwargs)
    n = generation_config.max_length - input_ids.shape[1]
    eos = generation_config._eos_token_tensor
    new = input_ids[:, :0]
    if n >= 1:
        decoder = GreedyDecoder(model, cache, fuse=fuse, sampling=rules.sampling,
                                repetition_penalty=rules.repetition_penalty)
        if streamer is not None:  # each step's token to the host as it comes (one sync a step)
            decoder.step_done = _Stream(decoder, streamer)
        new = decoder.generate(input_ids, n, stop_tokens=eos, min_new_tokens=rules.min_new_tokens,
                               attention_mask=model_kwargs.get("attention_mask"))
        if streamer is not None:
            decoder.step_done.put(new.shape[1])
    pad = generation_config._pad_token_tensor
    if eos is not None and pad is not None:  # generate's padding after each sequence's EOS
        is_eos = is_stop(new, eos.to(new.device).reshape(-1))
        new = new.masked_fill((is_eos.cumsum(1) - is_eos.long()) > 0, int(pad))
    if streamer is not None:
        streamer.end()
    sequences = torch.cat([input_ids, new.to(input_ids.device)], dim=1)
    if generation_config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        # (transformers from 5.2x names the field ``cache`` and logs a deprecation notice for
        # ``past_key_values``, which earlier versions name it)
        name = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ \
            else "past_key_values"
        return GenerateDecoderOnlyOutput(sequences=sequences, **{name: cache})
    return sequences


def _generate_streamer(model):
    """The ``streamer`` given to ``generate``, which transformers (5.17-5.24) does not pass on to
    a callable ``custom_generate`` (only the callable's own extra parameters), though it has
    already handed the prompt to it: without it here, the streamer would get no tokens and no
    ``end`` (a ``TextIteratorStreamer``'s reader would wait forever). Read from the frame of
    ``model.generate`` among this loop's callers (wrappers in between allowed); None if none."""
    frame = sys._getframe(2)  # graph_generate's caller
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code.co_name == "generate" and frame.f_locals.get("self") is model:
            return frame.f_locals.get("streamer")
        frame = frame.f_back
    return None


class _Stream:
    """``GreedyDecoder.step_done`` that hands the tokens decoded so far, not yet handed, to a
    transformers streamer (``put``: the new tokens of the batch's one sequence)."""

    def __init__(self, decoder: GreedyDecoder, streamer):
        self.decoder, self.streamer, self.sent = decoder, streamer, 0

    def __call__(self, done: int) -> None:
        self.put(done)

    def put(self, done: int) -> None:
        if done > self.sent:
            self.streamer.put(self.decoder.tokens[:, self.sent:done].cpu())
            self.sent = done


def _plan(model, cache, processors, criteria, config, synced_gpus, streamer, attention_mask,
          batch: int, prompt_len: int, inputs=()):
    """``(rules, None)`` where the loop serves the call, else ``(None, reason)``. ``inputs``:
    the names of model inputs given besides token ids and the attention mask."""
    if not isinstance(cache, KVBitsCache) and type(cache).__name__ != "StaticCache":
        return None, f"the cache is a {type(cache).__name__}, not a KVBitsCache or StaticCache"
    gpus = model_gpus(model)
    if len(gpus) > 1:  # (a CUDA graph captures one device's stream)
        return None, f"the model is spread over {', '.join(gpus)} (the loop's graphs need one GPU)"
    if streamer is not None and batch > 1:
        return None, "a streamer with a batch of several sequences"
    if synced_gpus:
        return None, "synced_gpus is set"
    if inputs:
        return None, (f"model inputs {list(inputs)} given (the loop feeds token ids and the "
                      "attention mask only)")
    flags = [f for f in _OUTPUT_FLAGS if getattr(config, f, False)]
    if flags:
        return None, f"{', '.join(flags)} asked for"
    if attention_mask is not None and not bool(attention_mask.all()):
        if not isinstance(cache, KVBitsCache):
            return None, "the attention mask pads the batch (the loop pads only a KVBitsCache)"
        if cache.get_seq_length():
            return None, ("the attention mask pads a batch whose cache already holds tokens "
                          "(the loop pads only an empty KVBitsCache)")
    if not getattr(config, "use_cache", True):
        return None, "use_cache=False (the loop decodes from the cache)"
    other = [type(c).__name__ for c in criteria if type(c).__name__ not in _STOPS]
    if other:
        return None, f"stopping criteria {other} (served: max length and EOS)"
    # a criterion given to generate takes the place of the config's: the loop stops where the
    # config says, so another value is transformers' loop's to serve
    eos = config._eos_token_tensor
    for c in criteria:
        if type(c).__name__ == "MaxLengthCriteria" and c.max_length != config.max_length:
            return None, (f"a MaxLengthCriteria of max_length={c.max_length}, not the "
                          f"config's {config.max_length}")
        if type(c).__name__ == "EosTokenCriteria" and (
                eos is None or not _same_ids(c.eos_token_id, eos)):
            return None, ("an EosTokenCriteria of other ids than the config's eos_token_id "
                          f"({None if eos is None else eos.reshape(-1).tolist()})")
    padding = None if attention_mask is None else (attention_mask == 0).sum(-1)
    return _sampling(processors, config, prompt_len, padding)


class _Rules(NamedTuple):
    """What ``generate``'s logits processors ask of the loop."""

    sampling: Sampling | None  # temperature, then top-k, then top-p; None: greedy
    min_new_tokens: int  # EOS banned before (the min-length processors)
    repetition_penalty: float  # 1: none


def _sampling(processors, config, prompt_len: int, padding: torch.Tensor | None = None):
    """``(_Rules, None)`` equal to ``generate``'s processors, or ``(None, reason)`` where there
    are others, or these in an order whose result differs from the loop's (the penalty and the
    EOS ban, then temperature, top-k and top-p: the order ``generate`` makes them in; those
    given to ``generate`` come in the order given, before its warpers, or in the place of its
    own of the same type). ``padding``: each sequence's left padding (``[B]``), or None."""
    kw, other, min_new, penalty = {}, [], 0, 1.0
    eos = config._eos_token_tensor
    names = [type(p).__name__ for p in processors]
    shaping = [i for i, n in enumerate(names) if n in _BEFORE_WARPERS]
    for i, (p, name) in enumerate(zip(processors, names)):
        if name in _SERVED and names.count(name) > 1:  # (the loop keeps one of each)
            other.append(f"{name} twice")
        elif name in ("TopKLogitsWarper", "TopPLogitsWarper") and shaping and shaping[-1] > i:
            other.append(f"{name} before {names[shaping[-1]]} (another order)")
        elif name == "TopPLogitsWarper" and any(n in ("TemperatureLogitsWarper",
                                                     "TopKLogitsWarper") for n in names[i + 1:]):
            other.append(f"{name} before temperature or top-k (another order)")
        elif name in ("TopKLogitsWarper", "TopPLogitsWarper") and \
                getattr(p, "filter_value", -float("inf")) != -float("inf"):
            other.append(f"{name} with filter_value={p.filter_value}")
        elif name == "MinNewTokensLengthLogitsProcessor" and eos is not None and \
                _same_ids(p.eos_token_id, eos):  # (counted from its own prompt length)
            min_new = max(min_new, p.min_new_tokens + p.prompt_length_to_skip - prompt_len)
        elif name == "MinLengthLogitsProcessor" and eos is not None and \
                _same_ids(p.eos_token_id, eos):
            min_new = max(min_new, p.min_length - prompt_len)
        elif name == "RepetitionPenaltyLogitsProcessor" and _ignores_padding(p, padding):
            penalty = float(p.penalty)
        elif name == "TemperatureLogitsWarper":
            kw["temperature"] = float(p.temperature)
        elif name == "TopKLogitsWarper":
            kw["top_k"] = int(p.top_k)
        elif name == "TopPLogitsWarper" and getattr(p, "min_tokens_to_keep", 1) == 1:
            if p.top_p > 0:
                kw["top_p"] = float(p.top_p)
            else:  # (transformers' processor keeps the most likely token; Sampling's top_p
                kw["top_k"] = 1  # is in (0, 1])
        elif name == "RepetitionPenaltyLogitsProcessor":  # (the loop counts the prompt
            # without its left padding)
            other.append(f"{name} with prompt_ignore_length={p.prompt_ignore_length!r}")
        else:
            other.append(name)
    if other:
        return None, (f"logits processors {other} (served: repetition penalty, min length, "
                      "temperature, top-k, top-p, in that order)")
    return _Rules(Sampling(**kw) if config.do_sample else None, min_new, penalty), None


# Processors the loop applies before the warpers (they commute with one another and with the
# temperature, not with top-k / top-p); with the warpers, those it serves (once each).
_BEFORE_WARPERS = ("MinNewTokensLengthLogitsProcessor", "MinLengthLogitsProcessor",
                   "RepetitionPenaltyLogitsProcessor")
_SERVED = _BEFORE_WARPERS + ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")


def _ignores_padding(processor, padding: torch.Tensor | None) -> bool:
    """Whether a repetition penalty processor counts the tokens the loop counts: the prompt's
    and the new ones, the left padding not (``prompt_ignore_length``: transformers sets it to
    each sequence's padding from 5.2x; None before, when it counted the padding too)."""
    ignore = getattr(processor, "prompt_ignore_length", None)
    padded = padding is not None and bool(padding.any())
    if ignore is None or isinstance(ignore, int):
        return not padded and not ignore
    ignore = torch.as_tensor(ignore).cpu()
    if padding is None:
        return not bool(ignore.any())
    return ignore.shape == padding.shape and torch.equal(ignore, padding.cpu().to(ignore.dtype))


def _same_ids(a, b: torch.Tensor) -> bool:
    a = torch.as_tensor(a).reshape(-1).cpu()
    return sorted(a.tolist()) == sorted(b.reshape(-1).cpu().tolist())
