"""Where a batched decode step's host time goes (issue #52): for each batch, the seconds to build a step's graph
(``model(...)``), to queue it (``mx.async_eval``) and to wait for its tokens (``tolist``), pipelined as
``kvq.bench.fill.decode`` runs it, and the same steps with ``mx.eval`` before each build (nothing in flight: the
build's own time, and the device's time alone).

    python benchmarks/investigations/batch_host_probe.py --methods turboquant:3 --batches 1,32 --context 32768
        [--clear-cache] [--cache-limit-gb 4]

Measured on one H100 (MLX 0.32.4, 2026-12-07; turboquant:3, 32K tokens; the results README in
benchmarks/results/host/ has the table): at one sequence the pipelined build takes 1.8 ms and the step 5.3 ms (the
host sets the pace); at 32 sequences the build takes 20 ms against 2.8 ms with nothing in flight: it waits for
the device's previous step, so host and device work in turn (step 27.6 ms, about 20 ms of kernels). The wait shows
in whichever call meets it (mlx-lm's RoPE under cProfile, mx.async_eval when timed call by call, the queue with one
CUDA graph a step), and it stays with CUDA graphs off and with no megabyte limit per graph: a lock or a
synchronising call inside MLX, not a call of kvq's. --clear-cache and --cache-limit-gb test the next lead: MLX's
allocator frees cached buffers under memory pressure, holding its lock (cudaFree of managed memory waits for the
device).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np


def probe(model, caches, batch: int, steps: int) -> dict:
    def build(y):
        return mx.argmax(model(y, cache=caches)[:, -1:, :], axis=-1)

    out = {}
    # pipelined: as fill.decode
    nxt = build(mx.full((batch, 1), 1, dtype=mx.int32))
    mx.async_eval(nxt)
    import cProfile
    import pstats

    b, q, w = [], [], []
    profile = cProfile.Profile()
    for i in range(steps):
        y = nxt
        t0 = time.perf_counter()
        if i == steps // 2:  # one build under cProfile with the previous step in flight: where a build waits
            profile.enable()
        nxt = build(y)
        profile.disable()
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.tolist()
        t3 = time.perf_counter()
        b.append(t1 - t0), q.append(t2 - t1), w.append(t3 - t2)
    mx.eval(nxt)
    out["pipelined"] = {k: round(float(np.median(v)) * 1e3, 3) for k, v in (("build", b), ("queue", q), ("wait", w))}
    out["pipelined"]["step"] = round(out["pipelined"]["build"] + out["pipelined"]["queue"] + out["pipelined"]["wait"], 3)
    # serial: nothing in flight while building
    y = nxt
    b, q, w = [], [], []
    for _ in range(steps):
        mx.synchronize()
        t0 = time.perf_counter()
        nxt = build(y)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        nxt.tolist()
        t3 = time.perf_counter()
        b.append(t1 - t0), q.append(t2 - t1), w.append(t3 - t2)
        y = nxt
    out["serial"] = {k: round(float(np.median(v)) * 1e3, 3) for k, v in (("build", b), ("queue", q), ("device", w))}
    stats = pstats.Stats(profile).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:10]
    out["profiled_build_top"] = [(f"{k[0].split('/')[-1]}:{k[1]}({k[2]})", round(v[2] * 1e3, 3)) for k, v in top]
    return out


def main() -> None:
    from kvq.bench import e2e, random_model
    from kvq.bench.fill import RandomKV, fill

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--methods", default="turboquant:3")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default=None)
    ap.add_argument("--clear-cache", action="store_true",
                    help="mx.clear_cache() after the fill (MLX's buffer cache then holds none of the fill's temporaries)")
    ap.add_argument("--cache-limit-gb", type=float, default=None, help="mx.set_cache_limit for the decode steps")
    args = ap.parse_args()
    config = random_model.random_config(args.model, args.layers)
    model = random_model.build_random_model(config, mx.bfloat16)
    rows = []
    for method in args.methods.split(","):
        spec = e2e.parse_methods(method)[-1]
        for batch in [int(x) for x in args.batches.split(",")]:
            settings = e2e.E2ESettings(contexts=(args.context,))
            caches = e2e.make_cache(model, spec, settings)
            source = RandomKV(config["num_key_value_heads"], config["hidden_size"] // config["num_attention_heads"],
                              mx.bfloat16, batch=batch)
            fill(caches, source, args.context, 4096)
            if args.clear_cache:
                mx.clear_cache()
            if args.cache_limit_gb is not None:
                mx.set_cache_limit(int(args.cache_limit_gb * 1e9))
            memory = {"active_gb": round(mx.get_active_memory() / 1e9, 2), "cache_gb": round(mx.get_cache_memory() / 1e9, 2)}
            row = {"method": spec.label, "batch": batch, "after_fill": memory, **probe(model, caches, batch, args.steps),
                   "after_steps": {"active_gb": round(mx.get_active_memory() / 1e9, 2),
                                   "cache_gb": round(mx.get_cache_memory() / 1e9, 2)}}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del caches
            mx.clear_cache()
    if args.out:
        json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
