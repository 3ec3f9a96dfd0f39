"""Does building ``mx.fast.rope`` wait for the device (issue #52: a batched decode step's build waited ~18 ms in
mlx-lm's Llama-3 RoPE)? With a long chain of matmuls in flight, the host seconds to build (not evaluate) one rope
call, for batches 1 and 32, an int or array offset, with and without ``freqs``; and, for comparison, other ops;
then the same with a chain that also reads scalars made from host data (MLX keeps those in a small pool of
managed memory, and a host write to a page the device is reading might have to wait: a guess beside the leads in
benchmarks/results/host/README.md, 2026-12-07). The last line prints how long the chain still ran after the builds
(it must be in flight while they are built).

Measured on one H100 (2026-12-07), the first half only (output not saved): no build waited (0.01-0.04 ms).

    python benchmarks/investigations/rope_wait.py
"""

from __future__ import annotations

import time

import mlx.core as mx


SCALARS = [False]


def in_flight():
    a = mx.random.normal((8192, 8192)).astype(mx.bfloat16)
    mx.eval(a)
    x = a
    for i in range(int(__import__("os").environ.get("CHAIN", 40))):
        x = x @ a  # ~40 x 1.1 TFLOP: tens of ms on an H100
        if SCALARS[0]:  # the chain also reads scalars made from host data (MLX's small pool of managed memory), as
            x = x * (1.0 + i * 1e-6)  # a decode step does (RoPE's offset, Python floats in ops)
    mx.async_eval(x)
    return x


def timed(label, fn, dependent: bool):
    x = in_flight()
    if dependent:  # the op's input depends on the work in flight (as a step's input does)
        dep = x[:1, :1].astype(mx.float32)
    tic = time.perf_counter()
    y = fn(dep if dependent else None)
    built = time.perf_counter() - tic
    tic = time.perf_counter()
    mx.eval(y, x)
    print(f"{label:60s} dependent={dependent!s:5s} build ms {built * 1e3:8.3f}, chain still ran "
          f"{(time.perf_counter() - tic) * 1e3:8.1f} ms", flush=True)


def main():
    freqs = mx.ones((64,), mx.float32)
    mx.eval(freqs)
    for scalars in (False, True):
        SCALARS[0] = scalars
        print(f"-- in-flight chain reads host-made scalars: {scalars}")
        cases(freqs)


def cases(freqs):
    for B in (1, 32):
        q = mx.random.normal((B, 32, 1, 128)).astype(mx.bfloat16)
        mx.eval(q)
        for dependent in (False, True):
            def inp(d, q=q):
                return q if d is None else q + d.astype(q.dtype)
            timed(f"rope B={B} offset int, freqs", lambda d: mx.fast.rope(inp(d), 128, traditional=False, base=None,
                                                                          scale=1.0, offset=32768, freqs=freqs), dependent)
            timed(f"rope B={B} offset int, base", lambda d: mx.fast.rope(inp(d), 128, traditional=False, base=5e5,
                                                                         scale=1.0, offset=32768), dependent)
            timed(f"rope B={B} offset array, freqs", lambda d: mx.fast.rope(inp(d), 128, traditional=False, base=None,
                                                                            scale=1.0, offset=mx.array(32768), freqs=freqs), dependent)
            timed(f"multiply B={B}", lambda d: inp(d) * 2, dependent)
            timed(f"mx.array(int)", lambda d: mx.array(32768), dependent)


if __name__ == "__main__":
    main()
