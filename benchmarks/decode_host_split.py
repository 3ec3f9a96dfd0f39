"""Where a pipelined decode step's time goes on the host: building the graph (``model(y)``) against
``mx.async_eval`` (MLX encoding and launching it), per cache, with the device time of a prebuilt step beside them.

``mlx_lm.generate`` builds step n + 1 while the device runs step n; the step takes max(host, device) only if
``async_eval`` returns at once. On MLX's CUDA back end it does not: it encodes every operation into CUDA graphs
(``mlx/backend/cuda/device.cpp``), which costs microseconds per operation, and when it returns the previous token is
already done (``wait`` ~ 0). Then the step is host time, and every operation a cache adds per layer costs twice:
once to build, once to encode. (At 32 sequences of 32K on an H100 that host time also held a ~17 ms wait for the
device inside the build: below.)

    python benchmarks/decode_host_split.py [--model random:llama3-8b] [--context 4096] \
        [--methods fp16,turboquant:4,fp16,turboquant:4] [--steps 64] [--batches 1,32] [--profile] \
        [--clear-cache] [--cache-limit-gb GB] [--out rows.json]

Prints one line per method and batch: median ms of the whole step, of building, of async_eval, of the wait for the
token, of a build with nothing in flight, and of evaluating a prebuilt step alone (no overlap). Methods may repeat:
the host's speed drifts within a run.

Batches (#52): on one H100 at 32 x 32K tokens a pipelined build took 20 ms against 3 with nothing in flight, so
host and device took turns. It waited behind the buffers the fill had left in MLX's buffer cache: with the cache
emptied after the fill (``--clear-cache``) the build took 2.5 ms (benchmarks/results/host/README.md, 2026-12-07).
Since ``ae25aa6`` the fill empties it after each chunk, as mlx-lm's ``generate_step`` does, so ``--clear-cache``
now repeats what the fill did; ``--batches 1,2,3,4,32`` and ``--cache-limit-gb 0`` were the tests of other leads.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import mlx.core as mx

from kvq.bench import e2e, random_model
from kvq.bench.fill import RandomKV, fill


def split(model, caches, steps: int, warmup: int = 36, batch: int = 1, profile: bool = False) -> dict:
    """Median milliseconds of a pipelined step and its parts (``build``, ``async_eval``, ``wait``), of a build with
    nothing in flight (``build_alone``: after ``mx.synchronize``; a pipelined ``build`` much longer than it has
    waited for the device), and of a prebuilt step evaluated alone (``device``: its encoding plus the device's
    work).
    ``batch`` rows decode together (the caches hold that many). With ``profile``, one pipelined build runs under
    cProfile and ``profiled_build`` lists the functions with the most own time (a wait shows in whichever call
    meets it)."""
    def step(y):
        return mx.argmax(model(y, cache=caches)[:, -1:, :], axis=-1)

    profiler = cProfile.Profile()
    nxt = step(mx.full((batch, 1), 1, dtype=mx.int32))
    mx.async_eval(nxt)
    parts = {"step": [], "build": [], "async_eval": [], "wait": [], "build_alone": [], "device": []}
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        y, nxt = nxt, None
        if profile and i == warmup:
            profiler.enable()
        nxt = step(y)
        profiler.disable()
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.tolist()
        t3 = time.perf_counter()
        if i >= warmup:
            for k, v in (("step", t3 - t0), ("build", t1 - t0), ("async_eval", t2 - t1), ("wait", t3 - t2)):
                parts[k].append(v)
    mx.eval(nxt)
    for _ in range(20):
        mx.synchronize()
        t0 = time.perf_counter()
        y = step(nxt)
        parts["build_alone"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mx.eval(y)
        parts["device"].append(time.perf_counter() - t0)
        nxt = y
    out = {k: round(1e3 * statistics.median(v), 3) for k, v in parts.items()}
    if profile:
        stats = sorted(pstats.Stats(profiler).stats.items(), key=lambda kv: -kv[1][2])[:10]
        out["profiled_build"] = [(f"{k[0].split('/')[-1]}:{k[1]}({k[2]})", round(v[2] * 1e3, 3)) for k, v in stats]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--methods", default="fp16,turboquant:4,fp16,turboquant:4")
    ap.add_argument("--batches", default="1", help="sequences decoded together, comma-separated (default 1)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="one pipelined build under cProfile")
    ap.add_argument("--clear-cache", action="store_true",
                    help="mx.clear_cache() after the fill (MLX's buffer cache then holds none of its temporaries)")
    ap.add_argument("--cache-limit-gb", type=float, default=None, help="mx.set_cache_limit for the decode steps")
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    config = random_model.random_config(args.model)
    model = random_model.build_random_model(config, mx.bfloat16)
    settings = e2e.E2ESettings(contexts=(args.context,), flush=32)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rows = []
    for label in args.methods.split(","):
        spec = e2e.parse_methods(label)[-1]
        for batch in [int(b) for b in args.batches.split(",")]:
            caches = e2e.make_cache(model, spec, settings)
            fill(caches, RandomKV(config["num_key_value_heads"], head_dim, mx.bfloat16, batch=batch), args.context,
                 4096)
            if args.clear_cache:
                mx.clear_cache()
            previous = None
            if args.cache_limit_gb is not None:
                previous = mx.set_cache_limit(int(args.cache_limit_gb * 1e9))
            memory = {"active_gb": round(mx.get_active_memory() / 1e9, 2),
                      "cache_gb": round(mx.get_cache_memory() / 1e9, 2)}
            ms = split(model, caches, args.steps, batch=batch, profile=args.profile)
            rows.append({"method": label, "batch": batch, "context": args.context, "after_fill": memory, **ms})
            if args.out:  # after every row: a later row that fails (out of memory, a timeout) loses nothing
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)
            print(label, f"batch {batch}", "  ".join(f"{k} {v:.2f}" for k, v in ms.items() if k != "profiled_build"),
                  ms.get("profiled_build", ""), flush=True)
            del caches
            mx.clear_cache()
            if previous is not None:
                mx.set_cache_limit(previous)


if __name__ == "__main__":
    main()
