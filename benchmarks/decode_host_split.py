"""Where a pipelined decode step's time goes on the host: building the graph (``model(y)``) against
``mx.async_eval`` (MLX encoding and launching it), per cache, with the device time of a prebuilt step beside them.

``mlx_lm.generate`` builds step n + 1 while the device runs step n; the step takes max(host, device) only if
``async_eval`` returns at once. On MLX's CUDA back end it does not: it encodes every operation into CUDA graphs
(``mlx/backend/cuda/device.cpp``), which costs microseconds per operation, and when it returns the previous token is
already done (``wait`` ~ 0). Then the step is host time, and every operation a cache adds per layer costs twice:
once to build, once to encode.

    python benchmarks/decode_host_split.py [--model random:llama3-8b] [--context 4096] \
        [--methods fp16,turboquant:4,fp16,turboquant:4] [--steps 64]

Prints one line per method: median ms of the whole step, of building, of async_eval, of the wait for the token,
and of evaluating a prebuilt step alone (no overlap). Methods may repeat: the host's speed drifts within a run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from kvq.bench import e2e, random_model
from kvq.bench.fill import RandomKV, fill


def split(model, caches, steps: int, warmup: int = 36) -> dict:
    """Median milliseconds of a pipelined step and its parts (``build``, ``async_eval``, ``wait``), and of a
    prebuilt step evaluated alone (``device``: its encoding plus the device's work)."""
    def step(y):
        return mx.argmax(model(y, cache=caches)[:, -1:, :], axis=-1)

    nxt = step(mx.array([[1]]))
    mx.async_eval(nxt)
    parts = {"step": [], "build": [], "async_eval": [], "wait": [], "device": []}
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        y, nxt = nxt, None
        nxt = step(y)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.item()
        t3 = time.perf_counter()
        if i >= warmup:
            for k, v in (("step", t3 - t0), ("build", t1 - t0), ("async_eval", t2 - t1), ("wait", t3 - t2)):
                parts[k].append(v)
    mx.eval(nxt)
    for _ in range(20):
        y = step(nxt)
        t0 = time.perf_counter()
        mx.eval(y)
        parts["device"].append(time.perf_counter() - t0)
        nxt = y
    return {k: 1e3 * statistics.median(v) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--methods", default="fp16,turboquant:4,fp16,turboquant:4")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    config = random_model.random_config(args.model)
    model = random_model.build_random_model(config, mx.bfloat16)
    settings = e2e.E2ESettings(contexts=(args.context,), flush=32)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    for label in args.methods.split(","):
        spec = e2e.parse_methods(label)[-1]
        caches = e2e.make_cache(model, spec, settings)
        fill(caches, RandomKV(config["num_key_value_heads"], head_dim, mx.bfloat16), args.context, 4096)
        ms = split(model, caches, args.steps)
        print(label, "  ".join(f"{k} {v:.2f}" for k, v in ms.items()), flush=True)
        del caches
        mx.clear_cache()


if __name__ == "__main__":
    main()
