"""Host cost of one layer's decode-step operations, three ways: as a cache writes them today, with the window
position as a device array, and that under ``mx.compile`` (#22: "try mx.compile and say what you found").

One layer of a decode step stores the new token's key and value in a preallocated window and attends over the
window so far. This times, per call, the graph building only (nothing evaluated inside the timer; every 50 calls
the result is evaluated so the graph stays small), 32 query / 8 KV heads, head_dim 128, bfloat16, a window of 160:

- ``python slices``: ``buf[:, :, n:n + 1] = k`` twice and ``buf[:, :, :n + 1]`` twice (what mlx-lm's KVCache and
  kvq's window do), then ``mx.fast.scaled_dot_product_attention``;
- ``device position``: ``mx.slice_update(buf, k, n, axes=(2,))`` with ``n`` a device array, attention over the
  whole buffer (a kernel that reads the valid length from ``n`` would need no slice; SDPA stands in for its cost);
- ``compiled``: the same function under ``mx.compile`` (one trace: ``n`` is an input array).

    python benchmarks/investigations/decode_ops_compile.py [--reps 2000] [--rounds 3] [--out decode_ops_compile.json]

Prints the median microseconds per call of each, per round; writes JSON. Not part of the library.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

B, H, HQ, D, CAP = 1, 8, 32, 128, 160


def attention(q, keys, values):
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=D ** -0.5)


def python_slices(wk, wv, k, q, n: int):
    wk[:, :, n:n + 1] = k
    wv[:, :, n:n + 1] = k
    return wk, wv, attention(q, wk[:, :, :n + 1], wv[:, :, :n + 1])


def device_position(wk, wv, k, q, n: mx.array):
    wk = mx.slice_update(wk, k, n, axes=(2,))
    wv = mx.slice_update(wv, k, n, axes=(2,))
    return wk, wv, attention(q, wk, wv)


def time_calls(fn, positions, reps: int, wk, wv, k, q) -> float:
    times = []
    for i in range(reps):
        n = positions[i % len(positions)]
        tic = time.perf_counter()
        _, _, out = fn(wk, wv, k, q, n)
        times.append(time.perf_counter() - tic)
        if i % 50 == 0:
            mx.eval(out)
    return statistics.median(times[100:]) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="decode_ops_compile.json")
    args = p.parse_args()
    wk = mx.zeros((B, H, CAP, D), mx.bfloat16)
    wv = mx.zeros((B, H, CAP, D), mx.bfloat16)
    k = mx.random.normal((B, H, 1, D)).astype(mx.bfloat16)
    q = mx.random.normal((B, HQ, 1, D)).astype(mx.bfloat16)
    ints = list(range(100))
    arrays = [mx.array([i]) for i in ints]
    mx.eval(wk, wv, k, q, *arrays)
    ways = [("python slices", python_slices, ints), ("device position", device_position, arrays),
            ("compiled", mx.compile(device_position), arrays)]
    rows = []
    for r in range(args.rounds):
        for name, fn, positions in ways:
            us = time_calls(fn, positions, args.reps, wk, wv, k, q)
            rows.append({"round": r + 1, "way": name, "build_us": us})
            print(f"round {r + 1} {name:<16} {us:6.2f} us per layer call", flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": str(mx.default_device()), "mlx": mx.__version__, "reps": args.reps, "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
