"""Decode attention as a decode step runs it: ``--layers`` calls back to back in one graph, each layer's own cache,
each call's query made from the previous call's output (so the calls run in order, as layers do), wall clock per
call; fp16 SDPA over the same shape in the same process.

``kernel_durations.py`` reads each launch's GPU time under Nsight Compute, which replays one kernel at a time on an
otherwise idle GPU (clocks ramping, nothing overlapping); this measures what a step's chain of layers costs with
warm clocks: the kernels, the gaps between them and the small op that links them (the same op for fp16). B 1
(``--batch``), H_q 32, H_kv 8, D 128, one query; 4 sinks and a 128-token window uncompressed, as a KVQCache
attends, through the bound decode step a KVQCache replays.

    python benchmarks/kernel_chain.py --out chain.json [--contexts 4096,131072] [--layers 32] [--reps 2] \
        [--variants v.json]

Writes JSON: one row per (context, method, variant, rep) with ``us_per_call`` and ``x_fp16`` (fp16's time over
this one's: above 1 is faster than fp16).
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from knobs import tuned  # benchmarks/ (the script's folder is on sys.path)
from kv_encode import encode_kv

HQ, HKV, D = 32, 8, 128
METHODS = (("turboquant", {"bits": 3}), ("turboquant", {"bits": 4}), ("affine", {"bits": 4}))


def chain_time(call, q0: mx.array, layers: int, steps: int) -> float:
    """Seconds per call of ``call(i, q)`` (layer ``i``), ``layers`` calls per graph chained through their outputs
    (``q`` of layer ``i + 1`` is ``q0`` plus a thousandth of layer ``i``'s output), best of ``steps`` graphs after
    two warm-up graphs."""
    def step():
        q = q0
        for i in range(layers):
            out = call(i, q)
            q = (q0 + 1e-3 * out.astype(q0.dtype)).astype(q0.dtype)
        return q

    for _ in range(2):
        mx.eval(step())
    best = float("inf")
    for _ in range(steps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(step())
        mx.synchronize()
        best = min(best, time.perf_counter() - t)
    return best / layers


def main() -> None:
    import kvq_metal
    from kvq_metal import attend

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="4096,32768,131072", help="comma-separated token counts")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10, help="timed graphs per row (the best is kept)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of the whole sweep (all reported)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", default=None, help="JSON file: a list of kvq_metal.attend knob overrides (knobs.tuned)")
    args = ap.parse_args()
    variants = json.load(open(args.variants)) if args.variants else [{}]
    backend = kvq_metal.gpu_backend()
    B, L, rows = args.batch, args.layers, []
    for T in (int(t) for t in args.contexts.split(",")):
        q0 = mx.random.normal((B, HQ, 1, D)).astype(mx.float16)
        # one layer's fp16 keys and values, repeated per layer as separate arrays (a kernel's time does not depend
        # on the values it reads)
        k = mx.random.normal((B, HKV, T, D)).astype(mx.float16)
        v = mx.random.normal((B, HKV, T, D)).astype(mx.float16)
        mx.eval(q0, k, v)
        sinks = [mx.contiguous(x[:, :, :4]) for x in (k, v)]
        windows = [mx.contiguous(x[:, :, -128:]) for x in (k, v)]
        mx.eval(*sinks, *windows)
        encoded = {f"{n}{p['bits']}": encode_kv(n, p, k, v, backend)[2:] for n, p in METHODS}
        fk = [k + 0 for _ in range(L)]
        fv = [v + 0 for _ in range(L)]
        mx.eval(fk, fv)
        del k, v
        for rep in range(args.reps):
            fp16 = chain_time(lambda i, q: mx.fast.scaled_dot_product_attention(q, fk[i], fv[i], scale=D ** -0.5),
                              q0, L, args.steps)
            rows.append({"T": T, "rep": rep, "method": "fp16_sdpa", "us_per_call": fp16 * 1e6, "x_fp16": 1.0})
            print(json.dumps(rows[-1]), flush=True)
            for name, (kern, ke, ve) in encoded.items():
                kes = [ke.map(lambda a: a + 0) for _ in range(L)]
                ves = [ve.map(lambda a: a + 0) for _ in range(L)]
                mx.eval([e.data for e in kes + ves])
                for variant in variants:
                    with tuned(attend=variant):
                        steps = [kern._bind_unchecked(q0, kes[i], ves[i], D ** -0.5, *sinks, *windows)
                                 for i in range(L)]
                    t = chain_time(lambda i, q: steps[i](q, *windows), q0, L, args.steps)
                    rows.append({"T": T, "rep": rep, "method": name, **variant, "us_per_call": t * 1e6,
                                 "x_fp16": fp16 / t})
                    print(json.dumps(rows[-1]), flush=True)
                kes = ves = steps = None  # freed before the next method's copies
        fk = fv = encoded = None
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/kernel_chain.py " + " ".join(f"--{k} {v}" for k, v in
                                                                            vars(args).items() if v is not None),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
