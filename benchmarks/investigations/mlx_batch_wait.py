"""A reproduction of the batched decode step's wait with MLX alone (issue #52; no kvq, no mlx-lm): a toy decoder
whose step is an embedding lookup of the last tokens ``[B, 1]`` int32, ``--layers`` of a matmul over a
``--width``-wide weight, RoPE, attention over one shared ``[B, 8, --context, 128]`` cache (so the device's step
grows with the batch, as a decode step's does) and a Python float (host-made scalars, as a model's step has), an
lm_head and an argmax; decoded pipelined as ``mlx_lm.generate`` does (build step n + 1, ``mx.async_eval`` it, then read
step n's tokens). For each batch: the median ms of the pipelined build, of ``mx.async_eval`` and of the wait for
the tokens, and of a build with nothing in flight. A build much longer pipelined than alone waited for the device.

    python benchmarks/investigations/mlx_batch_wait.py [--batches 1,2,3,4,32] [--layers 32] [--width 4096]

What it tests (benchmarks/results/host/README.md, 2026-12-07): whether the wait appears from three sequences on,
where the tokens (12 bytes and more) leave MLX's 8-byte pool of managed memory; ``--rounds`` repeats each batch.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,3,4,32")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    D, V = args.width, args.vocab
    embed = (mx.random.normal((V, D)) * 0.02).astype(mx.bfloat16)
    weights = [(mx.random.normal((D, D)) * D ** -0.5).astype(mx.bfloat16) for _ in range(args.layers)]
    head = (mx.random.normal((D, V)) * D ** -0.5).astype(mx.bfloat16)
    mx.eval(embed, head, *weights)
    offset = [0]

    def step(y, cache):
        h = embed[y]  # [B, 1, D]
        for w in weights:
            h = h @ w
            heads = h.reshape(h.shape[0], 1, D // 128, 128).transpose(0, 2, 1, 3)
            heads = mx.fast.rope(heads, 128, traditional=False, base=500000.0, scale=1.0, offset=offset[0])
            heads = mx.fast.scaled_dot_product_attention(heads, cache, cache, scale=128 ** -0.5)
            h = heads.transpose(0, 2, 1, 3).reshape(h.shape) * 0.5 + h * 0.5  # Python floats: host-made scalars
        offset[0] += 1
        return mx.argmax(h @ head, axis=-1)  # [B, 1] int32

    rows = []
    for _ in range(args.rounds):
        for batch in [int(b) for b in args.batches.split(",")]:
            cache = (mx.random.normal((batch, 8, args.context, 128)) * 0.5).astype(mx.bfloat16)
            mx.eval(cache)
            run = functools.partial(step, cache=cache)
            nxt = run(mx.zeros((batch, 1), mx.int32))
            mx.async_eval(nxt)
            parts = {"build": [], "async_eval": [], "wait": [], "build_alone": []}
            for i in range(args.steps + 4):
                t0 = time.perf_counter()
                y, nxt = nxt, None
                nxt = run(y)
                t1 = time.perf_counter()
                mx.async_eval(nxt)
                t2 = time.perf_counter()
                y.tolist()
                t3 = time.perf_counter()
                if i >= 4:
                    for k, v in (("build", t1 - t0), ("async_eval", t2 - t1), ("wait", t3 - t2)):
                        parts[k].append(v)
            mx.eval(nxt)
            for _ in range(8):
                mx.synchronize()
                t0 = time.perf_counter()
                nxt = run(nxt)
                parts["build_alone"].append(time.perf_counter() - t0)
                mx.eval(nxt)
            row = {"batch": batch, **{k: round(1e3 * statistics.median(v), 3) for k, v in parts.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del cache, run
            mx.clear_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
