"""Milliseconds of every step of mlx-lm's ``BatchGenerator`` (``next_generated`` calls, the server's decode loop),
fp16 (mlx-lm's caches) against kvq method strings in the same process: where a batched decode spends its time
(the prefill step, the step that packs kvq's rows, window flushes, the last step's cache extraction).

    python benchmarks/batch_steps.py --model random:llama3-8b --batch 8 --prompt 2048 --tokens 64 \
        --methods turboquant:3,affine:4 --reps 2 --out steps.json

Prints one line per (method, repetition): the first steps, the median of the rest and the last; writes every step's
time to ``--out``. ``--interleave``: fp16 and each method decode at the same time, a step of each in turn, so a
machine whose speed drifts between runs (an H200 host here: fp16's median step 9.3 ms in one repetition, 17.8 in
the next) slows both alike; the ratio of their summed steps is the decode speed against fp16. Uses ``kvq.bench``
(``random_model``, ``e2e.parse_methods``); nothing here is part of the library.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np

from kvq.bench import e2e, random_model
from kvq.cache import patch_model, unpatch_model


def steps(model, prompts: list[list[int]], tokens: int, chunk: int) -> list[float]:
    """Seconds of each ``next_generated`` call until the generator is done (greedy, ``tokens`` per prompt)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[], sampler=lambda x: mx.argmax(x, -1), prefill_step_size=chunk,
                         completion_batch_size=max(32, len(prompts)))
    gen.insert(prompts, [tokens] * len(prompts))
    times = []
    for _ in range(10 * tokens + 100):
        tic = time.perf_counter()
        done = not gen.next_generated()
        times.append(time.perf_counter() - tic)
        if done:
            break
    gen.close()
    return times


def interleaved(model, spec, settings, prompts: list[list[int]], tokens: int, chunk: int) -> tuple[list, list]:
    """fp16 and ``spec`` decoding at the same time, one step of each in turn (so both see the same state of a
    noisy machine): the fp16 generator prefills with mlx-lm's caches before the model is patched (a patched model
    attends mlx-lm's caches with mlx-lm's attention), then the kvq generator prefills, then their steps
    alternate. Seconds of each generator's steps after its prefill."""
    from mlx_lm.generate import BatchGenerator

    def generator(target):
        gen = BatchGenerator(target, stop_tokens=[], sampler=lambda x: mx.argmax(x, -1), prefill_step_size=chunk,
                             completion_batch_size=max(32, len(prompts)))
        gen.insert(prompts, [tokens] * len(prompts))
        gen.next_generated()  # prefill: every sequence's first token
        return gen

    ref = generator(model)
    ours = generator(patch_model(model, **spec.cache_kwargs(settings.sinks, settings.window, settings.flush)))
    times = ([], [])
    try:
        for _ in range(10 * tokens + 100):
            ended = False
            for gen, out in zip((ref, ours), times):
                tic = time.perf_counter()
                ended |= not gen.next_generated()
                out.append(time.perf_counter() - tic)
            if ended:
                break
    finally:
        unpatch_model(model)
        ref.close()
        ours.close()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--methods", default="turboquant:3")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--interleave", action="store_true",
                   help="fp16 and each method decode at once, one step of each in turn (see interleaved)")
    p.add_argument("--out", default="steps.json")
    args = p.parse_args()

    config = random_model.random_config(args.model.split(":", 1)[1])
    model = random_model.build_random_model(config, mx.bfloat16)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, config["vocab_size"], args.prompt)] for _ in range(args.batch)]
    settings = e2e.E2ESettings((args.prompt,), progress=False)
    rows = []
    if args.interleave:
        for rep in range(args.reps):
            for spec in e2e.parse_methods(args.methods, config["head_dim"]):
                if spec.is_reference:  # mlx-lm's caches, decoding beside each method
                    continue
                ref, ours = interleaved(model, spec, settings, prompts, args.tokens, args.chunk)
                a, b = sum(ref[:-1]), sum(ours[:-1])  # the steps both ran (the last reports the end)
                rows.append({"method": spec.label, "rep": rep + 1, "fp16_ms": [1e3 * t for t in ref],
                             "ms": [1e3 * t for t in ours], "decode_speed_vs_fp16": a / b})
                print(f"{spec.label:14s} rep {rep + 1}: interleaved, fp16 {1e3 * a:.0f} ms, kvq {1e3 * b:.0f} ms for "
                      f"{len(ref) - 1} steps each: {a / b:.2f}x fp16's decode speed (median step "
                      f"{1e3 * np.median(ref[1:-1]):.2f} vs {1e3 * np.median(ours[1:-1]):.2f} ms)", flush=True)
                mx.clear_cache()
        with open(args.out, "w") as f:
            json.dump({"device": str(mx.default_device()), "args": vars(args), "rows": rows}, f, indent=1)
        return
    for rep in range(args.reps):
        for spec in e2e.parse_methods("fp16," + args.methods, config["head_dim"]):
            target = model
            if not spec.is_reference:
                target = patch_model(model, **spec.cache_kwargs(settings.sinks, settings.window, settings.flush))
            try:
                times = steps(target, prompts, args.tokens, args.chunk)
            finally:
                if not spec.is_reference:
                    unpatch_model(model)
            ms = [1e3 * t for t in times]
            rows.append({"method": spec.label, "rep": rep + 1, "ms": ms})
            print(f"{spec.label:14s} rep {rep + 1}: first {[round(x, 1) for x in ms[:6]]} median of the rest "
                  f"{np.median(ms[6:-2]):.2f} last {[round(x, 1) for x in ms[-2:]]} total {sum(ms):.0f}", flush=True)
            mx.clear_cache()
    with open(args.out, "w") as f:
        json.dump({"device": str(mx.default_device()), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
