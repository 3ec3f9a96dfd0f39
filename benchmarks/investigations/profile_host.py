"""Host (Python + graph building) time of one decode step against the device time, per cache.

A decode step pipelined as ``mlx_lm.generate`` does it (the next step's graph is built while the device runs
this one) takes max(host time, device time). This script separates the two for a random-weight model of a real
shape: for each method string it fills every layer's cache to ``--context`` tokens (random keys and values), then

1. times ``--steps`` pipelined steps (ms/token, as ``kvq bench e2e``),
2. times the graph building alone (``model(y, cache=...)`` with nothing evaluated inside the timer), and
3. with ``--profile``, runs cProfile over the building of ``--steps`` steps and prints the top functions,
4. with ``--flush-steps N``, N steps evaluated one at a time, the window-flush steps timed apart from the others.

``--batch B`` decodes B sequences together through the batch caches mlx-lm's ``BatchGenerator`` makes (kvq:
``BatchKVQCache``, packed for decode; fp16: ``BatchKVCache``), ``--ragged R`` with sequence i R tokens shorter.

    python benchmarks/investigations/profile_host.py --model random:llama3-8b --context 4096 \
        --methods fp16,affine:4,turboquant:4 --out host.json [--profile]

Writes the JSON to ``--out`` (one row per method: context, ms/token median and mean, host ms per step, host us per
layer). Uses ``kvq.bench`` (``e2e.make_cache``, ``fill.RandomKV``); nothing here is part of the library.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import mlx.core as mx
import numpy as np

from kvq.bench import e2e, random_model
from kvq.bench.fill import RandomKV, decode, fill


def build_seconds(model, caches, steps: int, evals: list | None = None, batch: int = 1) -> list[float]:
    """Seconds to build each of ``steps`` decode graphs (the step's logits evaluated after the timer); with
    ``evals``, the seconds from the built graph to its evaluated token (encoding and launching on the host plus
    whatever of the device's work is not overlapped) are appended to it. ``batch``: rows decoded together."""
    y, times = mx.ones((batch, 1), mx.int32), []
    for _ in range(steps):
        tic = time.perf_counter()
        logits = model(y, cache=caches)
        built = time.perf_counter()
        times.append(built - tic)
        y = mx.argmax(logits[:, -1:, :], axis=-1)
        mx.eval(y)
        if evals is not None:
            evals.append(time.perf_counter() - built)
    return times


def flush_report(model, caches, steps: int) -> dict:
    """``steps`` decode steps evaluated one at a time: median build and evaluation milliseconds of the steps that
    flush a kvq cache's window (the first layer's compressed token count changes) and of the others."""
    first = caches[0]
    y, rows = mx.array([[1]]), []
    for _ in range(steps):
        before = getattr(getattr(first, "compressed_keys", None), "length", None)
        tic = time.perf_counter()
        logits = model(y, cache=caches)
        built = time.perf_counter()
        y = mx.argmax(logits[:, -1:, :], axis=-1)
        mx.eval(y)
        done = time.perf_counter()
        flushed = before is not None and first.compressed_keys.length != before
        rows.append((flushed, built - tic, done - built))
    out = {}
    for kind, flag in (("flush", True), ("other", False)):
        sel = [r for r in rows if r[0] == flag]
        if sel:
            out[kind] = {"steps": len(sel), "build_ms_median": 1e3 * float(np.median([r[1] for r in sel])),
                         "eval_ms_median": 1e3 * float(np.median([r[2] for r in sel]))}
    return out


def batch_caches(model, spec, settings, batch: int, context: int, ragged: int, kv_heads: int, head_dim: int):
    """Per layer, the batch cache mlx-lm's ``BatchGenerator`` decodes with, holding ``batch`` sequences of random
    keys and values: sequence ``i`` of ``context - i * ragged`` tokens. kvq: a :class:`kvq.cache.BatchKVQCache`
    of one filled cache per sequence; fp16: mlx-lm's ``BatchKVCache`` (left-padded to the longest, as mlx-lm
    pads)."""
    from mlx_lm.models.cache import BatchKVCache

    from kvq.cache import BatchKVQCache

    lengths = [context - i * ragged for i in range(batch)]
    if spec.label == "fp16":
        pad = [context - n for n in lengths]
        caches = [BatchKVCache(pad) for _ in model.layers]
        fill(caches, RandomKV(kv_heads, head_dim, mx.bfloat16, batch=batch), context, settings.chunk)
        return caches
    per_sequence = []
    for i, n in enumerate(lengths):
        caches = e2e.make_cache(model, spec, settings)
        fill(caches, RandomKV(kv_heads, head_dim, mx.bfloat16, seed=i), n, settings.chunk)
        per_sequence.append(caches)
    return [BatchKVQCache(list(rows)) for rows in zip(*per_sequence)]


def captured_step(model, caches) -> bool:
    """One decode step between the CUDA driver's cuProfilerStart and cuProfilerStop (so ``ncu
    --profile-from-start off`` sees only its launches); False where the driver library is not found."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    y = mx.array([[1]])
    mx.eval(model(y, cache=caches))
    mx.synchronize()
    cuda.cuProfilerStart()
    mx.eval(model(y, cache=caches))
    mx.synchronize()
    cuda.cuProfilerStop()
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:llama3-8b")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--methods", default="fp16,affine:4,turboquant:4")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="cProfile the graph building of the kvq rows")
    p.add_argument("--layers", type=int, default=None, help="keep this many layers of the random model")
    p.add_argument("--capture", action="store_true",
                   help="after the timings, run one more step between cuProfilerStart/Stop "
                        "(for ncu --profile-from-start off)")
    p.add_argument("--flush-steps", type=int, default=0,
                   help="then this many steps evaluated one at a time, flush steps timed apart (build, evaluation)")
    p.add_argument("--batch", type=int, default=1,
                   help="sequences decoded together: kvq rows in a BatchKVQCache per layer (as mlx-lm's "
                        "BatchGenerator makes them), fp16 mlx-lm's BatchKVCache")
    p.add_argument("--ragged", type=int, default=0,
                   help="with --batch: sequence i holds context - i * RAGGED tokens (rows of different lengths)")
    p.add_argument("--out", default="host.json")
    args = p.parse_args()

    config = random_model.random_config(args.model.split(":", 1)[1], args.layers)
    model = random_model.build_random_model(config, mx.bfloat16)
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    layers = len(model.layers)
    settings = e2e.E2ESettings((args.context,), steps=args.steps, progress=False)
    warmup = settings.flush + 1  # as kvq bench e2e on a GPU: the first window flush untimed
    rows = []
    for spec in e2e.parse_methods(args.methods, head_dim):
        if args.batch > 1:
            caches = batch_caches(model, spec, settings, args.batch, args.context, args.ragged, kv_heads, head_dim)
        else:
            caches = e2e.make_cache(model, spec, settings)
            fill(caches, RandomKV(kv_heads, head_dim, mx.bfloat16), args.context, settings.chunk)
        timed, _ = decode(model, caches, 1, args.steps, warmup, batch=args.batch)
        evals: list = []
        host = build_seconds(model, caches, args.steps, evals, args.batch)
        row = {"method": spec.label, "context": args.context, "layers": layers, "batch": args.batch,
               "ragged": args.ragged,
               "ms_per_token_median": 1e3 * float(np.median(timed)), "ms_per_token_mean": 1e3 * float(np.mean(timed)),
               "host_ms_per_step_median": 1e3 * float(np.median(host)),
               "host_ms_per_step_max": 1e3 * float(np.max(host)),
               "host_us_per_layer": 1e6 * float(np.median(host)) / layers,
               "eval_ms_per_step_median": 1e3 * float(np.median(evals))}
        if args.profile and spec.label != "fp16":
            prof = cProfile.Profile()
            prof.enable()
            build_seconds(model, caches, args.steps, batch=args.batch)
            prof.disable()
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(40)
            row["profile"] = text.getvalue()
            print(text.getvalue())
        if args.flush_steps:
            row["flush_report"] = flush_report(model, caches, args.flush_steps)
        if args.capture:
            row["captured"] = captured_step(model, caches)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        del caches
        mx.clear_cache()
    with open(args.out, "w") as f:
        json.dump({"device": str(mx.default_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
