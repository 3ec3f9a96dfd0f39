"""Which call of a batched decode step's build waits for the device (issue #52): mlx-lm's RoPE and the layers'
linear projections timed call by call in one pipelined build (the previous step in flight), turboquant:3 at
``--batch`` sequences of ``--context`` tokens.

    python benchmarks/investigations/rope_wait_step.py --batch 32 --context 16384

One H100 run (2026-12-07, before build and queue were printed apart; output not saved): at 32 sequences of 16K,
build and queue 15.6 ms, of which ``mx.async_eval`` 12.1 ms and RoPE 0.21 ms in all; at one sequence 4.7 and 2.8.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx


def main() -> None:
    from mlx_lm.models import rope_utils
    import mlx.nn as nn

    from kvq.bench import e2e, random_model
    from kvq.bench.fill import RandomKV, fill

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--method", default="turboquant:3")
    args = ap.parse_args()
    config = random_model.random_config("random:llama3-8b", None)
    model = random_model.build_random_model(config, mx.bfloat16)
    spec = e2e.parse_methods(args.method)[-1]
    caches = e2e.make_cache(model, spec, e2e.E2ESettings(contexts=(args.context,)))
    fill(caches, RandomKV(8, 128, mx.bfloat16, batch=args.batch), args.context, 4096)
    log = []
    recording = [False]

    def wrap(owner, name, label):
        real = getattr(owner, name)

        def timed(*a, **k):
            tic = time.perf_counter()
            out = real(*a, **k)
            if recording[0]:
                log.append((label, (time.perf_counter() - tic) * 1e3))
            return out
        setattr(owner, name, timed)

    wrap(rope_utils.Llama3RoPE, "__call__", "rope")
    wrap(nn.Linear, "__call__", "linear")
    wrap(nn.RMSNorm, "__call__", "rmsnorm")
    wrap(type(caches[0]), "update_and_fetch", "update")
    wrap(mx, "async_eval", "async_eval")

    def build(y):
        return mx.argmax(model(y, cache=caches)[:, -1:, :], axis=-1)

    nxt = build(mx.full((args.batch, 1), 1, dtype=mx.int32))
    mx.async_eval(nxt)
    for i in range(8):
        y = nxt
        recording[0] = i == 6
        tic = time.perf_counter()
        nxt = build(y)
        toc = time.perf_counter()
        mx.async_eval(nxt)
        if i == 6:  # the step whose calls are logged
            built, queued = (toc - tic) * 1e3, (time.perf_counter() - toc) * 1e3
        recording[0] = False
        y.tolist()
    mx.eval(nxt)
    slow = [(j, label, round(ms, 3)) for j, (label, ms) in enumerate(log) if ms > 0.5]
    print(f"build ms {built:.2f}, queue ms {queued:.2f}; calls {len(log)}; calls over 0.5 ms (index, kind, ms): {slow}")
    by = {}
    for label, ms in log:
        by[label] = by.get(label, 0) + ms
    print({k: round(v, 2) for k, v in by.items()})


if __name__ == "__main__":
    main()
