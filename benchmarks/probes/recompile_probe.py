"""Which kernels compile new variants as a generation goes on (GPU probe, session 50).

    PYTHONPATH=src python3 benchmarks/probes/recompile_probe.py [--new 300]

cold_start.py found kivi-2 with eager layer steps (``+eager-steps``: the path of beam search,
assisted decoding and ``step_graphs=False``) compiling 33 kernels on its first call (62 s on a
cold machine, against 5 with the default step graphs), and later calls at new lengths slower
than the fit. This runs ``generate`` on a 2-layer Llama-3-8B-shaped model (random weights) with
Triton's ``jit_cache_hook`` recording every in-process compile with the decode step it came at,
and prints, per kernel, the compiles after the first steps with the arguments whose
specialization changed against that kernel's earlier variant.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections import defaultdict

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--new", type=int, default=300)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--after", type=int, default=40, help="report compiles after this step")
    p.add_argument("--modes", default="eager-steps,graphs,beams")
    args = p.parse_args()
    from transformers import StoppingCriteria
    from triton import knobs

    from kvbits.eval.speed import build_model, model_config
    from kvbits.integrations.hf import KVBitsCache, cache_kwargs

    model = build_model(model_config("llama-3-8b", layers=2), device="cuda")
    ids = torch.randint(1, 32000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.cuda()
    state = {"step": 0, "events": []}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        sig = {k: str(v) for k, v in zip([p.name for p in fn.jit_function.params], key[1])} \
            if hasattr(fn, "jit_function") else {}
        consts = {str(k): str(v) for k, v in compile.get("constants", {}).items()}
        state["events"].append((state["step"], fn.name, {**sig, **consts,
                                                       "options": str(key[2:])[:200]}))
        return False

    try:
        knobs.runtime.jit_cache_hook = hook
    except AttributeError:  # (older Triton: a class attribute)
        from triton.runtime.jit import JITFunction

        JITFunction.cache_hook = hook

    class Count(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            state["step"] += 1
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    for mode in args.modes.split(","):
        state.update(step=0, events=[])
        cache = KVBitsCache(model, "kivi-2", step_graphs=mode == "graphs")
        extra = {"num_beams": 2, "early_stopping": False} if mode == "beams" else {}
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                       min_new_tokens=args.new, do_sample=False, temperature=None, top_p=None,
                       top_k=None, stopping_criteria=[Count()], **extra,
                       **cache_kwargs(model, cache))
        torch.cuda.synchronize()
        ev = state["events"]
        late = [e for e in ev if e[0] > args.after]
        print(f"\n== {mode}: {len(ev)} compiles in all, {len(late)} after step {args.after}")
        by_name = defaultdict(list)
        for step, name, rep in ev:
            by_name[name].append((step, rep))
        for name, items in by_name.items():
            steps = [s for s, _ in items]
            print(f"  {name}: {len(items)} variants at steps {steps}")
            for (_, a0), (s1, a1) in itertools.pairwise(items):
                diff = {k: (a0.get(k), a1.get(k)) for k in {*a0, *a1} if a0.get(k) != a1.get(k)}
                print(f"    step {s1}: {diff}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
