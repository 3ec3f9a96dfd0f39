"""Host cost of one decode step of the caches alone, per layer: building (``update_and_fetch`` + attention) and
``mx.async_eval``, for mlx-lm's KVCache (with ``mx.fast.scaled_dot_product_attention``) and kvq caches.

A decode step on a big GPU is host time (``benchmarks/decode_host_split.py``); this isolates the part a cache adds,
without a model around it: ``--layers`` caches filled with ``--context`` random tokens (32 query / 8 KV heads,
head_dim 128, bfloat16 by default), then rounds of ``--steps`` steps per method, the methods alternating round by
round (the host's speed drifts). Each step appends one token to every layer's cache and attends one query; the
outputs of a step are evaluated with ``mx.async_eval`` and the step before waited for, as ``mlx_lm.generate`` does.
Window flushes happen as in decode (every ``flush`` steps); ``--profile`` adds cProfile's table of one kvq round.

    python benchmarks/cache_step_cost.py [--methods fp16,turboquant:4,turboquant:3,affine:4] [--context 4096]
        [--rounds 3] [--out cache_step.json]

``--stub-kernels`` replaces the kernels' bound steps by stubs that return at once (:func:`stub_bound_steps`): kvq's
host work of a bound decode step alone, on any machine. ``--batch B`` measures a batch of ``B`` sequences per layer:
kvq's packed rows (:class:`kvq.cache.BatchKVQCache` over rows of different lengths, which flush at different steps:
the p90 shows the steps where some row flushes and the ragged step is bound again) against one mlx-lm KVCache of
``B`` rows (issue #52: no per-row host work in a batched decode step).

Prints, per method and round, the median and p90 microseconds per layer of building and of ``async_eval``; writes
JSON. Not part of the library.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from kvq.bench.fill import RandomKV, fill


def make_caches(method: str, layers: int, flush: int) -> list:
    """``layers`` empty caches of ``method`` (``kvcache``, or ``fp16`` its older name: mlx-lm's KVCache; else a
    kvq spec ``name:bits``)."""
    if method in ("kvcache", "fp16"):
        return [KVCache() for _ in range(layers)]
    from kvq.cache import KVQCache, make_config

    name, _, bits = method.partition(":")
    return [KVQCache(make_config(name, bits=int(bits), flush=flush)) for _ in range(layers)]


def make_batch(method: str, layers: int, flush: int, batch: int, context: int, source) -> list:
    """``layers`` caches of ``batch`` sequences filled with ``source``: mlx-lm's KVCache of ``batch`` rows of
    ``context`` tokens (the reference: one array per layer, no per-row work), or kvq's
    :class:`kvq.cache.BatchKVQCache` over single-sequence rows of ``context + 7 i`` tokens (rows of different
    lengths, as a server's; they pack at the first decode step and flush at different steps)."""
    H, D, dtype = source.kv_heads, source.head_dim, source.dtype
    if method in ("kvcache", "fp16"):
        caches = [KVCache() for _ in range(layers)]
        for cache in caches:
            k = mx.random.normal((batch, H, context, D)).astype(dtype)
            cache.update_and_fetch(k, k * 0.5)
            mx.eval(cache.keys, cache.values)
        return caches
    from kvq.cache import BatchKVQCache

    rows = []
    for i in range(batch):
        row = make_caches(method, layers, flush)
        fill(row, source, context + 7 * i, 4096)
        rows.append(row)
    return [BatchKVQCache([rows[i][layer] for i in range(batch)]) for layer in range(layers)]


def attend(cache, q, k, v, scale):
    """One layer's decode: store ``k``/``v``, attend ``q`` (mlx-lm's KVCache: its keys and SDPA)."""
    keys, values = cache.update_and_fetch(k, v)
    if isinstance(cache, KVCache):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)
    return cache.attend(q, scale)


def run_round(caches, tokens, steps: int, scale: float, profile: bool = False) -> dict:
    """``steps`` pipelined decode steps over ``caches``: per-layer microseconds of building and of async_eval."""
    build, encode = [], []
    prof = cProfile.Profile() if profile else None
    prev = None
    for i in range(steps):
        q, k, v = tokens[i % len(tokens)]
        if prof:
            prof.enable()
        t0 = time.perf_counter()
        outs = [attend(c, q, k, v, scale) for c in caches]
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        if prof:
            prof.disable()
        if prev is not None:
            mx.eval(prev)
        prev = outs
        build.append((t1 - t0) / len(caches) * 1e6)
        encode.append((t2 - t1) / len(caches) * 1e6)
    mx.eval(prev)
    row = {}
    for name, xs in (("build_us", build), ("async_eval_us", encode)):
        xs = sorted(xs)
        row[name] = statistics.median(xs)
        row[name.replace("_us", "_p90_us")] = xs[int(0.9 * (len(xs) - 1))]
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        row["profile"] = out.getvalue()
    return row


def stub_bound_steps(methods) -> None:
    """Every kvq method's pure-MLX implementation binds a decode step that returns a preallocated output at once
    (:class:`kvq.contract.BindsDense`, and ``reads_in_place`` as kvq_metal's steps say): a bound step then costs
    only kvq's own host work (the window append, the binding check, the window slice), the kernel's launch and its
    GPU time left out; so a machine without a GPU
    measures the host path of a bound decode step, and two revisions compare on it."""
    from kvq.plugins import registry

    for m in methods:
        if m in ("kvcache", "fp16"):
            continue
        impl = registry().implementations[(m.partition(":")[0], "mlx")]

        def bind(queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values):
            out = mx.zeros((*queries.shape[:3], values.head_dim), queries.dtype)
            mx.eval(out)

            def step(q, wk, wv, lengths=None):  # a single stream's step, or a batch's (with lengths)
                # the window and counts evaluated with the output, as a kernel's inputs are (else their writes
                # pile up unevaluated from step to step)
                return mx.depends([out], [wk, wv] + ([] if lengths is None else [lengths]))[0]

            step.reads_in_place = True  # as kvq_metal's DecodeStep: a batch keeps it across its flushes
            return step

        impl.bind_dense = impl.bind_ragged_dense = bind


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="fp16,turboquant:4,turboquant:3,affine:4")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--flush", type=int, default=32)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--stub-kernels", action="store_true",
                   help="bound decode steps that return at once (stub_bound_steps): kvq's host work alone, any device")
    p.add_argument("--batch", type=int, default=1,
                   help="sequences per cache (> 1: kvq's BatchKVQCache over rows of different lengths, packed)")
    p.add_argument("--out", default="cache_step.json")
    args = p.parse_args()
    if args.batch < 1:
        p.error(f"--batch must be >= 1; got {args.batch}")
    H, Hq, D, dtype, B = 8, 32, 128, mx.bfloat16, args.batch
    methods = args.methods.split(",")
    if args.stub_kernels:
        stub_bound_steps(methods)
    all_caches = {}
    for m in methods:
        source = RandomKV(H, D, dtype)
        if B > 1:
            caches = make_batch(m, args.layers, args.flush, B, args.context, source)
        else:
            caches = make_caches(m, args.layers, args.flush)
            fill(caches, source, args.context, 4096)
        all_caches[m] = caches
    tokens = []
    for _ in range(4):
        q = mx.random.normal((B, Hq, 1, D)).astype(dtype)
        k = mx.random.normal((B, H, 1, D)).astype(dtype)
        tokens.append((q, k, k * 0.5))
    mx.eval(tokens)
    scale = D ** -0.5
    for m in methods:  # compile and bind
        run_round(all_caches[m], tokens, 8, scale)
    rows = []
    for r in range(args.rounds):
        for m in methods:
            profile = args.profile and r == 0 and m not in ("kvcache", "fp16")
            row = run_round(all_caches[m], tokens, args.steps, scale, profile)
            row.update(method=m, round=r + 1)
            rows.append(row)
            print(f"round {r + 1} {m:<14} build {row['build_us']:6.1f} us/layer (p90 {row['build_p90_us']:6.1f})  "
                  f"async_eval {row['async_eval_us']:6.1f} (p90 {row['async_eval_p90_us']:6.1f})", flush=True)
            if "profile" in row:
                print(row["profile"])
    with open(args.out, "w") as f:
        json.dump({"device": str(mx.default_device()), "mlx": mx.__version__, "context": args.context,
                   "stub_kernels": args.stub_kernels, "batch": B,
                   "layers": args.layers, "steps": args.steps, "flush": args.flush, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
