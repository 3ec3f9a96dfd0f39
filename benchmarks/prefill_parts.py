"""Where one layer's prefill chunk spends its time on a kvq cache, part by part, against fp16's attention (#23).

    python benchmarks/prefill_parts.py OUT_DIR [--contexts 8K,32K] [--chunk 2048] [--methods turboquant:3,affine:4]
        [--kv-heads 8] [--q-heads 32] [--head-dim 128] [--dtype bfloat16] [--reps 10]

For each context (tokens already held) and method, one layer's cache is filled with random keys and values, then
the median seconds over ``--reps`` of: fp16's attention for the chunk (``mx.fast.scaled_dot_product_attention``,
causal, over context + chunk keys; and with the same mask as a boolean and as an additive array), decoding the
compressed tokens (keys and values), the whole chunk (``update_and_fetch`` and ``attend`` on a copy of the cache;
and building its graph alone, nothing evaluated: the host's share) and the update alone.
Writes OUT_DIR/prefill_parts.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx


def _size(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * 1024) if text.endswith("K") else int(text)


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` (evaluated) over ``reps`` runs after one warm-up."""
    mx.eval(fn())
    times = []
    for _ in range(reps):
        mx.synchronize()
        tic = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--contexts", default="8K,32K")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--methods", default="turboquant:3,turboquant:4,affine:4")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)

    from kvq.bench.fill import RandomKV, cache_arrays, fill
    from kvq.evaluation.spec import make_layer_cache, parse_method

    dtype = getattr(mx, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    D, C = args.head_dim, args.chunk
    source = RandomKV(args.kv_heads, D, dtype)
    rows = []
    for context in [_size(c) for c in args.contexts.split(",")]:
        q = mx.random.normal((1, args.q_heads, C, D), dtype, key=mx.random.key(1))
        k_new, v_new = source(0, context, context + C)
        k_all = mx.random.normal((1, args.kv_heads, context + C, D), dtype, key=mx.random.key(2))
        v_all = mx.random.normal((1, args.kv_heads, context + C, D), dtype, key=mx.random.key(3))
        mx.eval(q, k_new, v_new, k_all, v_all)
        scale = D ** -0.5
        row = {"context": context, "method": "fp16",
               "attention_s": timed(lambda: mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=scale,
                                                                                  mask="causal"), args.reps)}
        causal = mx.arange(context, context + C)[:, None] >= mx.arange(context + C)[None]
        row["masked_attention_s"] = timed(lambda: mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=scale,
                                                                                       mask=causal), args.reps)
        additive = mx.where(causal, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))
        row["additive_mask_attention_s"] = timed(
            lambda: mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=scale, mask=additive), args.reps)
        rows.append(row)
        print(json.dumps(row), flush=True)
        for label in [m.strip() for m in args.methods.split(",")]:
            cache = make_layer_cache(parse_method(label), sinks=4, window=128)
            fill([cache], source, context, C)
            row = {"context": context, "method": label}
            row["decode_kv_s"] = timed(lambda: [cache._dequantized(cache.compressed_keys, cache.config.key_params,
                                                                   dtype),
                                                cache._dequantized(cache.compressed_values,
                                                                   cache.config.value_params, dtype)], args.reps)

            def chunk():
                c = copy.deepcopy(cache)
                c.update_and_fetch(k_new, v_new)
                return [c.attend(q, scale)] + cache_arrays(c)

            row["chunk_s"] = timed(chunk, args.reps)
            builds = []
            for _ in range(args.reps):  # the host's share: building the chunk's graph, nothing evaluated
                mx.synchronize()
                tic = time.perf_counter()
                built = chunk()
                builds.append(time.perf_counter() - tic)
                mx.eval(built)
            row["chunk_build_s"] = statistics.median(builds)

            def update_only():
                c = copy.deepcopy(cache)
                c.update_and_fetch(k_new, v_new)
                c.release_chunk()
                return cache_arrays(c)

            row["update_s"] = timed(update_only, args.reps)
            rows.append(row)
            print(json.dumps(row), flush=True)
            (args.out / "prefill_parts.json").write_text(json.dumps({"rows": rows, "mlx": mx.__version__,
                                                                    "device": str(mx.default_device())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
