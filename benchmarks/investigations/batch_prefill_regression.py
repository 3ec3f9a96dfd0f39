"""BatchGenerator prefill of 8 prompts of 2,048 (random:llama3-8b, bfloat16), fp16 then kvq, timed and profiled.

Written to find why ``kvq bench batch``'s kvq prefill went from 0.66x fp16 (934b1d6, 2026-12-04) to 0.39x (cf1deed,
2026-12-06) on one H200: run it once per installed revision (each in its own process) and compare. Uses only APIs
both revisions have (kvq.bench.random_model, kvq.patch_model, mlx-lm's BatchGenerator). Results and what they
showed (the first-block checks' device waits): benchmarks/results/batch/2026-12-06-prefill-guard.

    python batch_prefill_regression.py OUT_PREFIX [--reps 3] [--profile]
"""
import argparse
import cProfile
import io
import json
import pstats
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np


def prefill(model, prompts):
    from mlx_lm.generate import BatchGenerator

    mx.synchronize()
    gen = BatchGenerator(model, stop_tokens=[], sampler=lambda x: mx.argmax(x, -1), prefill_step_size=2048,
                         completion_batch_size=32)
    tic = time.perf_counter()
    uids = gen.insert(prompts, [2] * len(prompts))
    seen = set()
    while len(seen) < len(uids):
        for r in gen.next_generated():
            seen.add(r.uid)
    mx.synchronize()
    took = time.perf_counter() - tic
    gen.close()
    return took


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--method", default="turboquant")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--guard-off", action="store_true", help="outlier_layers='off': no first-block checks")
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--prompt", type=int, default=2048)
    args = ap.parse_args()
    import kvq
    from kvq.bench.random_model import build_random_model, random_config

    model = build_random_model(random_config(args.model), mx.bfloat16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, min(32000, model.args.vocab_size), args.prompt).tolist() for _ in range(8)]
    rows = []
    for rep in range(args.reps + 1):
        fp16 = prefill(model, prompts)
        extra = {"outlier_layers": "off"} if args.guard_off else {}
        kvq.patch_model(model, method=args.method, bits=args.bits, sinks=4, window=128, flush=128, **extra)
        try:
            if args.profile and rep == args.reps:
                prof = cProfile.Profile()
                prof.enable()
                t = prefill(model, prompts)
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
                pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
                open(args.out + "-profile.txt", "w").write(s.getvalue())
            else:
                t = prefill(model, prompts)
        finally:
            kvq.unpatch_model(model)
        rows.append({"rep": rep, "fp16_s": fp16, "kvq_s": t, "speed": fp16 / t})
        print(rows[-1], flush=True)
    json.dump(rows, open(args.out + ".json", "w"), indent=1)


if __name__ == "__main__":
    main()
