"""Shared pieces of the benchmarks: environment record, copy bandwidth, random packed caches,
result files (JSON + Markdown) with the GPU name, versions and the command that made them."""

from __future__ import annotations

import datetime
import json
import platform
import shlex
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from kvbits.formats.layout import PackedKV
from kvbits.formats.packing import packed_length
from kvbits.spec import QuantSpec

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    """GPU name, library versions and the command line of this run."""
    import transformers
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
    }


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Measured device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    from triton.testing import do_bench

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    src = dst = None  # (freed)
    return nbytes / (ms * 1e-3)


def random_packed_kv(batch: int, kv_heads: int, context: int, head_dim: int, spec: QuantSpec,
                     dtype=torch.float16, device="cuda") -> PackedKV:
    """A layer holding ``context`` tokens per sequence with random codes, scales and zeros.

    The residual holds ``R + (context - R) % G`` tokens, the body the rest, as after decoding.
    Random int32 words are valid codes at every bit width; speed does not depend on values.
    """
    G, D = spec.group_size, head_dim
    body = max(0, (context - spec.residual_length) // G * G) if spec.quantized else 0
    res = context - body
    Gv = spec.value_group(D)
    B, H = batch, kv_heads

    def words(*shape):
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device=device)

    def scales(*shape, lo):
        return (torch.rand(*shape, device=device) * 0.05 + lo).to(torch.float16)

    n_groups = body // G
    n_vg = spec.value_groups(D)  # per-token scale groups (the last may be shorter)
    k_rows, k_cols = (body, n_vg) if spec.key_axis == "token" else (n_groups, D)
    v_rows, v_cols = (n_groups, D) if spec.value_axis == "channel" else (body, n_vg)
    kv = PackedKV(
        sink_k=torch.empty(B, H, 0, D, dtype=dtype, device=device),
        sink_v=torch.empty(B, H, 0, D, dtype=dtype, device=device), sink_len=0,
        k_codes=words(B, H, n_groups * packed_length(G, spec.key_bits), D),
        k_scale=scales(B, H, k_rows, k_cols, lo=0.01), k_zero=scales(B, H, k_rows, k_cols, lo=-1.0),
        v_codes=words(B, H, n_groups * packed_length(G, spec.value_bits), D),
        v_scale=scales(B, H, v_rows, v_cols, lo=0.01), v_zero=scales(B, H, v_rows, v_cols, lo=-1.0),
        body_len=body,
        res_k=torch.randn(B, H, res, D, dtype=dtype, device=device),
        res_v=torch.randn(B, H, res, D, dtype=dtype, device=device), res_len=res,
        key_bits=spec.key_bits, value_bits=spec.value_bits, group_size=G, value_group=Gv,
        key_axis=spec.key_axis, value_axis=spec.value_axis,
    )
    if spec.method == "fp8":  # e4m3 body token by token, one float32 multiplier per head
        def fp8(*shape):  # random e4m3 bit patterns without NaN (|x| bits < 0x7F), 1 B each
            mag = torch.randint(0, 0x7F, shape, dtype=torch.uint8, device=device)
            return (mag | (torch.randint(0, 2, shape, dtype=torch.uint8, device=device) << 7)
                    ).view(torch.float8_e4m3fn)
        kv.k_codes, kv.v_codes = fp8(B, H, body, D), fp8(B, H, body, D)
        kv.k_scale = torch.rand(B, H, 1, 1, device=device) * 0.01 + 0.01
        kv.v_scale = torch.rand(B, H, 1, 1, device=device) * 0.01 + 0.01
        kv.k_zero = kv.v_zero = None
        kv.fp8 = True
    if spec.method == "kvquant":
        _add_kvquant_fields(kv, spec, body)
    if spec.key_scales == "calibrated":  # one offline key scale row for every group
        kv.k_scale, kv.k_zero = scales(B, H, 1, D, lo=0.01), scales(B, H, 1, D, lo=-1.0)
        kv.key_scales_fixed = True
    return kv


def _add_kvquant_fields(kv: PackedKV, spec: QuantSpec, body: int) -> None:
    """What a KVQuant layer carries besides the codes: per-head codebooks (sorted, unevenly
    spaced levels in code units), ``spec.n_outliers(D)`` FP16 corrections per token for keys
    and values (random channels), and the rotary frequencies of pre-RoPE keys."""
    B, H, _, D = kv.res_k.shape
    device = kv.res_k.device

    def codebook(bits):
        steps = torch.rand(H, 1 << bits, device=device) + 0.3
        cb = torch.cumsum(steps, 1) - steps[:, :1]
        return cb / cb[:, -1:] * ((1 << bits) - 1)

    kv.k_codebook, kv.v_codebook = codebook(spec.key_bits), codebook(spec.value_bits)
    n_out = spec.n_outliers(D)
    if n_out:
        def idx():
            return torch.randint(0, D, (B, H, body, n_out), dtype=torch.uint8, device=device)

        def val():
            return torch.randn(B, H, body, n_out, device=device).to(torch.float16)
        kv.k_out_idx, kv.k_out_val, kv.v_out_idx, kv.v_out_val = idx(), val(), idx(), val()
    if spec.pre_rope:
        kv.rope_inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))


def packed_nbytes(kv: PackedKV) -> int:
    """Bytes of the tokens a decode step must read from a packed layer."""
    G, T = kv.group_size, kv.body_len
    n_groups = T // G
    if kv.fp8:
        body = [kv.k_codes[:, :, :T], kv.v_codes[:, :, :T], kv.k_scale, kv.v_scale]
    else:
        k_rows = T if kv.key_axis == "token" else 1 if kv.key_scales_fixed else n_groups
        v_rows = n_groups if kv.value_axis == "channel" else T
        body = [kv.k_codes[:, :, : n_groups * packed_length(G, kv.key_bits)],
                kv.k_scale[:, :, :k_rows], kv.k_zero[:, :, :k_rows],
                kv.v_codes[:, :, : n_groups * packed_length(G, kv.value_bits)],
                kv.v_scale[:, :, :v_rows], kv.v_zero[:, :, :v_rows]]
    body += [t[:, :, :T] for t in (kv.k_out_idx, kv.k_out_val, kv.v_out_idx, kv.v_out_val)
             if t is not None]  # KVQuant's outliers (its codebooks: a few bytes per head)
    fp = [kv.sink_k[:, :, : kv.sink_len], kv.sink_v[:, :, : kv.sink_len],
          kv.res_k[:, :, : kv.res_len], kv.res_v[:, :, : kv.res_len]]
    return sum(p.numel() * p.element_size() for p in body + fp)


def batch_slice(kv: PackedKV, b: int) -> PackedKV:
    """The layer restricted to sequence ``b`` (views), for reference checks at scale."""
    fields = {f: getattr(kv, f) for f in kv.__dataclass_fields__}
    per_layer = ("k_codebook", "v_codebook", "rope_inv_freq")  # no batch axis
    for name, value in fields.items():
        if isinstance(value, torch.Tensor) and name not in per_layer:
            fields[name] = value[b:b + 1]
    return PackedKV(**fields)


def write_results(name: str, rows: list[dict], columns: list[tuple[str, str]], env: dict,
                  notes: list[str] = (), out_dir: Path = RESULTS) -> None:
    """Write ``name.json`` (env + rows) and ``name.md`` (a table of ``columns``: (key, header))."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [f"# {name}", "", f"- GPU: {env['gpu']}; torch {env['torch']}, triton {env['triton']}, "
             f"transformers {env['transformers']}; {env['date']}",
             f"- command: `{env['command']}`", *[f"- {n}" for n in notes], "",
             "| " + " | ".join(h for _, h in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(k)) for k, _ in columns) + " |")
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


def write_model_results(out_dir: Path, name: str, title: str, script: str, fields: dict,
                        rows: list[dict], columns: list[str], prose: str,
                        setting: str = "") -> dict:
    """Result files of a real-model benchmark (CPU, the library's reference path): ``name.json``
    (meta + rows) and ``name.md`` (title, command, date, versions, ``prose``, the table of
    ``columns``). ``fields`` join the meta (model, text, knobs); ``setting`` precedes the
    versions (e.g. ``"CPU, 2 threads; "``). Returns the meta."""
    import time

    from kvbits.cli import _versions
    from kvbits.eval.memory import markdown_table

    meta = {"command": shlex.join(["python", f"benchmarks/{script}", *sys.argv[1:]]),
            **fields, "versions": _versions(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = [f"# {title}", "", f"```\n{meta['command']}\n```", "",
          f"{meta['date']}; {setting}"
          + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".", "", prose, "",
          markdown_table(columns, [[r[c] for c in columns] for r in rows])]
    (out_dir / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return meta


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def host_us(fn, n: int = 200, warmup: int = 0) -> float:
    """Host microseconds per call to enqueue ``fn`` (no synchronisation inside the loop), after
    ``warmup`` untimed calls."""
    import time

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6



# The long Llama rows the Gluon body probes time: (batch, query heads, KV heads, context, preset).
LONG_ROWS = [(8, 32, 8, 32768, "kivi-2"), (8, 32, 8, 131072, "kivi-2"),
             (8, 32, 8, 32768, "kivi-4"), (8, 32, 8, 131072, "kivi-4"),
             (8, 32, 32, 32768, "kivi-2"), (8, 32, 32, 32768, "kivi-4"),
             (1, 32, 8, 131072, "kivi-2"), (32, 32, 8, 32768, "kivi-2")]


def parse_rows(arg: str | None, default) -> list[tuple]:
    """A probe's ``B:Hq:Hkv:T:preset,...`` argument as tuples (``default`` when absent)."""
    if not arg:
        return list(default)
    return [tuple(int(x) if x.isdigit() else x for x in s.split(":")) for s in arg.split(",")]


def best_graph_us(fns: dict, rounds: int = 3) -> dict:
    """CUDA-graph time of each callable in µs: the best of ``rounds`` medians of
    ``triton.testing.do_bench_cudagraph``, the callables alternated within each round."""
    from triton.testing import do_bench_cudagraph

    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return {name: min(t) * 1e3 for name, t in times.items()}


def body_variants_ab(row: tuple, variants: dict, sms: int, head_dim: int = 128):
    """Run and time the Gluon body kernel's ``variants`` on one ``row`` (see ``LONG_ROWS``):
    each variant is ``fn(q, kv, out, lse, splits)`` writing the body partials. Returns the
    layer, the split count, ``{name: best µs}`` and ``{name: (out, lse)}`` from a first run."""
    from kvbits.kernels import decode_gluon as dg
    from kvbits.spec import resolve_spec

    B, hq, hkv, T, preset = row
    kv = random_packed_kv(B, hkv, T, head_dim, resolve_spec(preset))
    q = torch.randn(B, hq, 1, head_dim, dtype=torch.float16, device="cuda")
    splits = dg.split_count(kv.body_len, dg.body_splits(B * hkv, kv.body_len, sms, head_dim))
    calls, outs = {}, {}
    for name, fn in variants.items():
        out = torch.zeros(B * hq, splits, head_dim, dtype=torch.float32, device="cuda")
        lse = torch.zeros(B * hq, splits, dtype=torch.float32, device="cuda")

        def call(fn=fn, out=out, lse=lse):
            fn(q, kv, out, lse, splits)
        call()
        torch.cuda.synchronize()
        outs[name] = (out.clone(), lse.clone())
        calls[name] = call
    return kv, splits, best_graph_us(calls), outs


def attend_body_fn(module):
    """A ``body_variants_ab`` variant calling ``module.attend_body`` (the Gluon body modules)."""
    def fn(q, kv, out, lse, splits):
        module.attend_body(q, kv, out, lse, scale_log2=0.127, starts=q, lengths=q,
                           has_starts=False, has_lens=False, n_out=splits, splits=splits)
    return fn


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # (past 2**31 elements)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read_graph_us(nbytes: int, time_graph) -> float:
    """The faster of two plain reads of ``nbytes`` (``torch.sum`` into one int64; a Triton loop
    over int32 words), each timed by ``time_graph`` (the decode table's ``bench_graph``: the call
    captured in a CUDA graph, ``do_bench`` with its L2 flush): the least time any kernel that
    must read those bytes can show in that table, its fixed costs included (session 64)."""
    best = _time_reads(torch.ones(nbytes // 4, dtype=torch.int32, device="cuda"), time_graph)
    torch.cuda.empty_cache()  # (the buffer died with the call above)
    return best


def _time_reads(buf: torch.Tensor, time_graph) -> float:
    out = torch.empty((), dtype=torch.int64, device=buf.device)
    programs = torch.cuda.get_device_properties(buf.device).multi_processor_count * 8
    part = torch.empty(programs, dtype=torch.int32, device=buf.device)
    return min(time_graph(lambda: torch.sum(buf, dim=0, dtype=torch.int64, out=out)),
               time_graph(lambda: _read_kernel[(programs,)](buf, part, buf.numel(),
                                                            BLOCK=2048, num_warps=8)))
