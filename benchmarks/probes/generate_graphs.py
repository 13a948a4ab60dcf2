"""Probe (GPU): transformers' ``generate`` as users call it, eager against
``custom_generate=graph_generate`` (kvbits' CUDA-graph loop), batch 1, random weights.

Each ``generate`` call of n new tokens takes a + n * t: the steady time per token t, from calls
of N and 5 N tokens (medians of 3), and a = the prefill plus, through graph_generate, the eager
warm-up steps and the captures (one graph per kind of step, every call: the graphs point at the
call's own cache). Beside it, the median step of one 5 N-token call, each step timed with a
synchronisation as ``kvbits bench`` times them (eager rows: the eager steps). A quantized
cache's flushing step comes every G = 32 steps and is captured
the first time it comes, so both calls must hold one (N >= 34, the default 40): with N = 24
(session 32's first runs) the longer call alone paid that capture, ~0.5-1 ms per token of
bias at 32 layers. The probe reports t and a - (the FP16 eager row's a), the
per-call overhead. FP16 SDPA restricted to the flash backend (torch's default, cuDNN, costs ~1 ms
of host time per call on the H200 host). Rows: FP16 DynamicCache eager (the baseline), kivi-2
eager, and through graph_generate: kivi-2, kivi-4, and kvbits' FP16 cache (the control: same
loop and graphs, nothing quantized).

    PYTHONPATH=src python3 benchmarks/probes/generate_graphs.py [MODEL] [CONTEXTS] [N] [ROWS]

``ROWS``: indices into ``VARIANTS`` to run (default all; the first row, the baseline, always).
"""
import gc
import itertools
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from kvbits.eval.speed import build_model, model_config
from kvbits.integrations import KVBitsCache, graph_generate
from kvbits.integrations.decode_loop import GreedyDecoder
from kvbits.integrations.hf import cache_kwargs

name = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
contexts = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "4096,32768").split(",")]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 40
model = build_model(model_config(name, max_positions=max(contexts) + 5 * N + 64))
model.generation_config.eos_token_id = None  # random weights: never stop early (and no
model.config.eos_token_id = None             # min_new_tokens, a processor graph_generate refuses)
BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
VARIANTS = [("fp16 DynamicCache, eager", "dynamic", False), ("kivi-2, eager", "kivi-2", False),
            ("fp16 (kvbits), graph_generate", "fp16", True),
            ("kivi-2, graph_generate", "kivi-2", True), ("kivi-4, graph_generate", "kivi-4", True)]
if len(sys.argv) > 4:
    VARIANTS = [v for i, v in enumerate(VARIANTS) if i == 0 or str(i) in sys.argv[4].split(",")]


def median_step(ids, preset, graphs, new):
    """Median ms between consecutive decode steps of one call, from its 40th step on (past the
    captures); the loop's steps through GreedyDecoder's hook, generate's through a stopping
    criterion that synchronises, as kvbits bench does."""
    from transformers import StoppingCriteria

    times = []

    def mark():
        torch.cuda.synchronize()
        times.append(time.perf_counter())

    class Mark(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            mark()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    real = GreedyDecoder._tick
    GreedyDecoder._tick = lambda self, done: (mark(), real(self, done))[1]
    try:
        run(ids, preset, graphs, new, stopping_criteria=[Mark()] if not graphs else None)
    finally:
        GreedyDecoder._tick = real
    steps = [b - a for a, b in itertools.pairwise(times[40:])]
    return statistics.median(steps) * 1e3 if steps else float("nan")


def run(ids, preset, graphs, new, stopping_criteria=None):
    gc.collect()
    torch.cuda.empty_cache()
    cache = DynamicCache() if preset == "dynamic" else KVBitsCache(model, preset)
    kw = {"custom_generate": graph_generate} if graphs else {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad(), sdpa_kernel(BACKENDS):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, pad_token_id=0,
                             **({"stopping_criteria": stopping_criteria}
                                if stopping_criteria else {}),
                             **cache_kwargs(model, cache), **kw)
    torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + new
    return time.perf_counter() - t0, out


print(f"# {torch.cuda.get_device_name()}, {name}, random weights, batch 1, N = {N}; torch "
      f"{torch.__version__}", flush=True)
for T in contexts:
    ids = torch.randint(100, 20000, (1, T), device="cuda")
    base = None
    toks = {}
    for label, preset, graphs in VARIANTS:
        run(ids, preset, graphs, 4)  # warm-up: compiles
        short = statistics.median(run(ids, preset, graphs, N)[0] for _ in range(3))
        long = statistics.median(run(ids, preset, graphs, 5 * N)[0] for _ in range(3))
        tpot = (long - short) / (4 * N) * 1e3
        fixed = short * 1e3 - N * tpot
        base = base or (tpot, fixed)
        toks[label] = run(ids, preset, graphs, 17)[1][0, T:]
        same = ""
        if graphs and preset != "fp16":
            eager = toks.get(f"{preset}, eager")
            if eager is not None:
                same = f"; first 16 tokens as eager: {torch.equal(eager[:16], toks[label][:16])}"
        step = median_step(ids, preset, graphs, 5 * N)
        print(f"T={T:6d} {label:32s} {tpot:7.2f} ms/token {1e3 / tpot:6.1f} tok/s "
              f"{base[0] / tpot:5.2f}x the FP16 eager row; per call +{fixed - base[1]:6.0f} ms; "
              f"median step {step:6.2f} ms{same}", flush=True)
