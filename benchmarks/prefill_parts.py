"""Where one layer's prefill chunk spends its time on a kvq cache, part by part, against fp16's attention (#23).

    python benchmarks/prefill_parts.py OUT_DIR [--contexts 8K,32K] [--chunk 2048] [--methods turboquant:3,affine:4]
        [--kv-heads 8] [--q-heads 32] [--head-dim 128] [--dtype bfloat16] [--reps 10]

For each context (tokens already held) and method, one layer's cache is filled with random keys and values, then
the median seconds over ``--reps`` of: fp16's attention for the chunk (``mx.fast.scaled_dot_product_attention``,
causal, over context + chunk keys; and with the same mask as a boolean and as an additive array), decoding the
compressed tokens (keys and values), the whole chunk (``update_and_fetch`` and ``attend``; and building its graph
alone, nothing evaluated: the host's share) and the update alone. Each repetition updates its own copy of the filled
cache, made before its clock starts (until 2026-12-05 the copy was timed too).
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


def layer_parser(doc: str, contexts: str) -> argparse.ArgumentParser:
    """The options of one layer's shape and timing that this script and ``prefill_masks.py`` share."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--contexts", default=contexts)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=10)
    return ap


def write_row(path: Path, rows: list, row: dict) -> None:
    """Append ``row``, print it, and rewrite ``path`` with every row so far (a run cut short keeps its rows)."""
    rows.append(row)
    print(json.dumps(row), flush=True)
    path.write_text(json.dumps({"rows": rows, "mlx": mx.__version__, "device": str(mx.default_device())}, indent=1))


def layer_source(args):
    """``(dtype, RandomKV source)`` of the parsed options; makes ``args.out``."""
    from kvq.bench.fill import RandomKV

    dtype = getattr(mx, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    return dtype, RandomKV(args.kv_heads, args.head_dim, dtype)


def layer_inputs(args, source, context: int):
    """A chunk's queries ``[1, H_q, chunk, D]``, its keys and values from ``source`` (positions ``context ..
    context + chunk``), and fp16's keys and values over ``context + chunk`` tokens (random, evaluated)."""
    D, C, dtype = args.head_dim, args.chunk, getattr(mx, args.dtype)
    q = mx.random.normal((1, args.q_heads, C, D), dtype, key=mx.random.key(1))
    k_new, v_new = source(0, context, context + C)
    k_all = mx.random.normal((1, args.kv_heads, context + C, D), dtype, key=mx.random.key(2))
    v_all = mx.random.normal((1, args.kv_heads, context + C, D), dtype, key=mx.random.key(3))
    mx.eval(q, k_new, v_new, k_all, v_all)
    return q, k_new, v_new, k_all, v_all


def filled_copies(cache, n: int) -> list:
    """``n`` copies of a filled cache, evaluated: each repetition updates its own, made before its clock starts (the
    copy is the benchmark's, not the chunk's: a prefill updates the one cache it has)."""
    from kvq.bench.fill import cache_arrays

    copies = [copy.deepcopy(cache) for _ in range(n)]
    mx.eval([cache_arrays(c) for c in copies])
    return copies


def main(argv=None) -> int:
    ap = layer_parser(__doc__, "8K,32K")
    ap.add_argument("--methods", default="turboquant:3,turboquant:4,affine:4")
    args = ap.parse_args(argv)

    from kvq.bench.fill import cache_arrays, fill
    from kvq.cache.choice import dequantize
    from kvq.evaluation.spec import make_layer_cache, parse_method

    dtype, source = layer_source(args)
    D, C = args.head_dim, args.chunk
    rows = []
    for context in [_size(c) for c in args.contexts.split(",")]:
        q, k_new, v_new, k_all, v_all = layer_inputs(args, source, context)
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
        write_row(args.out / "prefill_parts.json", rows, row)
        for label in [m.strip() for m in args.methods.split(",")]:
            cache = make_layer_cache(parse_method(label), sinks=4, window=128)
            fill([cache], source, context, C)
            row = {"context": context, "method": label}
            row["decode_kv_s"] = timed(lambda: [dequantize(cache.config, cache.config.key_params,
                                                           cache.compressed_keys.view(), dtype),
                                                dequantize(cache.config, cache.config.value_params,
                                                           cache.compressed_values.view(), dtype)], args.reps)
            copies = filled_copies(cache, 2 * args.reps + 1)  # timed's warm-up and reps, then the builds

            def chunk():
                c = copies.pop()
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
            copies = filled_copies(cache, args.reps + 1)

            def update_only():
                c = copies.pop()
                c.update_and_fetch(k_new, v_new)
                c.release_chunk()
                return cache_arrays(c)

            row["update_s"] = timed(update_only, args.reps)
            write_row(args.out / "prefill_parts.json", rows, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
