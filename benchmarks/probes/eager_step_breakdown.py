"""Read a trace of ``eager_step_trace.py`` (gzipped Chrome trace with torch.profiler's Python
tracer): the mean inclusive time of the Python functions called under each call of a root
function, per root call, to a given depth (no GPU needed).

    python3 benchmarks/probes/eager_step_breakdown.py TRACE.json.gz "hf.py(542): kvbits_attention_forward" [DEPTH] [TOP]

Roots used in session 29: ``modeling_llama.py(243): forward`` (a decoder layer's attention),
``hf.py(542): kvbits_attention_forward``, ``cache_utils.py(1370): update``,
``launch.py(165): launch``. Times are traced times: the tracer inflates Python-heavy code, so
compare functions within one trace, not against untraced timings.
"""
import collections
import gzip
import json
import sys


def breakdown(path: str, root: str, depth: int = 1, top: int = 25) -> None:
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    py = [e for e in events if e.get("cat") == "python_function" and e.get("ph") == "X"]
    children = collections.defaultdict(list)
    for e in py:
        parent = e["args"].get("Python parent id")
        if parent is not None:
            children[parent].append(e)
    roots = [e for e in py if root in e["name"]]
    if not roots:
        raise SystemExit(f"no call of {root!r} in {path}")
    n = len(roots)
    total, calls = collections.defaultdict(float), collections.Counter()

    def walk(e, d, prefix):
        for k in children[e["args"]["Python id"]]:
            key = prefix + k["name"]
            total[key] += k["dur"]
            calls[key] += 1
            if d > 1:
                walk(k, d - 1, key + " > ")
    for r in roots:
        walk(r, depth, "")
    print(f"== {path}: {root}, {n} calls, {sum(e['dur'] for e in roots) / n:.1f} us each")
    for key, us in sorted(total.items(), key=lambda x: -x[1])[:top]:
        print(f"  {us / n:8.1f} us {calls[key] / n:5.2f}x  {key}")


if __name__ == "__main__":
    breakdown(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1,
              int(sys.argv[4]) if len(sys.argv) > 4 else 25)
