"""``kvq bench capacity``: the largest batch of equal-length sequences that fits in the device's memory with each
cache, and its aggregate decode tokens/s, kvcache in the same run (the number a server operator cares about).

The chosen batch's decode is timed --reps times; the table gives the median and min-max of their tokens/s and ms
per step. Writes OUT/NAME.json (after every row, each repetition's figures in it), OUT/NAME.md and OUT/NAME.png.
"""

from __future__ import annotations

import argparse

from .bench_cmd import _model_config, add_model_and_cache_options, at_least, bench_specs, checked_bench, run_bench

EPILOG = """
models: as kvq bench e2e (random:PRESET random-weight llamas are the usual choice: random keys and values fill every
sequence). methods: kvq bench e2e's method strings; kvcache is mlx-lm's KVCache (fp16 its older name; always measured first).

--budget: bytes the run may hold in all (model, caches, decode temporaries), with K, M, G suffixes (powers of 1024);
default: the device's memory (mx.device_info()), required on the CPU. Defaults: --context 32K on a GPU, 1K on the
CPU. Without --name, NAME is capacity-DATE-DEVICE-MODEL, with -2, -3 ... added where an earlier run's files have
that name. The PNG needs matplotlib, kvq-core's plots extra (or pass --no-plot).
"""

DEFAULT_METHODS = ("kvcache", "turboquant:3", "turboquant:4", "affine:4")


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvq bench capacity``."""
    p = argparse.ArgumentParser(prog="kvq bench capacity", description=__doc__.split("\n\n")[0].replace("``", ""),
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model name, folder, .gguf, Hub id, or random:PRESET")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated method strings (default: {','.join(DEFAULT_METHODS)}, if installed)")
    p.add_argument("--context", default=None, help="tokens per sequence, K suffix allowed (see below)")
    p.add_argument("--budget", "--memory", dest="budget", default=None, help="bytes the run may hold, K/M/G suffixes (see below)")
    p.add_argument("--safety", type=float, default=0.9,
                   help="fraction of the predicted headroom the first batch tried may use (default 0.9)")
    p.add_argument("--max-batch", type=int, default=1024, help="the largest batch tried (default 1024)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed decode steps at the chosen batch (default: --flush, one whole flush period, as kvq "
                        "bench e2e)")
    p.add_argument("--reps", type=int, default=2,
                   help="timed decodes at the chosen batch (default 2; the table shows their median and min-max)")
    p.add_argument("--chunk", type=int, default=4096, help="tokens per cache update when filling (default 4096)")
    add_model_and_cache_options(p)
    p.add_argument("--seed", type=int, default=0, help="seed of random weights and keys/values (default 0)")
    p.add_argument("--out", default="bench-capacity", help="output folder (default ./bench-capacity)")
    p.add_argument("--name", default=None, help="file name stem (default capacity-DATE-DEVICE-MODEL)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="write no PNG (matplotlib is not needed then)")
    return p


def device_memory() -> int | None:
    """The default device's memory in bytes (``mx.device_info()``: CUDA's ``total_memory``, Metal's
    ``memory_size``), or ``None`` (the CPU back end reports none)."""
    import mlx.core as mx

    info = mx.device_info()
    value = info.get("total_memory", info.get("memory_size"))
    return int(value) if value else None


def check(args) -> dict:
    """Every input check of ``kvq bench capacity`` that needs no model weights.

    :return: ``{"name", "config", "path", "settings", "specs", "dtype"}``.
    :raises ValueError: the first bad input, naming the option and what it allows.
    """
    from ..bench import capacity
    from ..bench.ops import parse_size
    from ..bench.random_model import is_random
    from .bench_cmd import _on_cpu

    context = parse_size(args.context, "--context", "tokens") if args.context else 1024 if _on_cpu() else 32768
    if args.budget is None:
        budget = device_memory()
        if budget is None:
            raise ValueError("--budget is required here: this device reports no memory size (e.g. --budget 2G)")
    else:
        budget = parse_size(args.budget, "--budget", "bytes")
    steps = args.flush if args.steps is None else args.steps
    at_least(("--max-batch", args.max_batch, 1), ("--steps", steps, 1), ("--reps", args.reps, 1),
              ("--chunk", args.chunk, 1), ("--sinks", args.sinks, 0), ("--window", args.window, 0),
              ("--flush", args.flush, 1))
    if not 0 < args.safety <= 1:
        raise ValueError(f"--safety must be in (0, 1]; got {args.safety}")
    random = is_random(args.model)
    name, config, path = _model_config(args)
    specs = bench_specs(args, config, random, DEFAULT_METHODS)
    warmup = 1 if _on_cpu() else args.flush + 1
    settings = capacity.CapacitySettings(context, budget, safety=args.safety, max_batch=args.max_batch,
                                         steps=steps, reps=args.reps, warmup=warmup, chunk=args.chunk,
                                         sinks=args.sinks, window=args.window, kernels=args.kernels, flush=args.flush,
                                         seed=args.seed, progress=not args.no_progress)
    return checked_bench((name, config, path), settings, specs, args, random)


def main(argv: list[str]) -> int:
    """Run ``kvq bench capacity``; every argument (and matplotlib, for the plot) is checked before any model is
    loaded or built."""
    args = parser().parse_args(argv)
    checked = check(args)
    from ..bench import capacity, capacity_report

    settings = checked["settings"]
    return run_bench("kvq bench capacity", argv, args, checked, "capacity-",
                     ("context", "budget", "safety", "max_batch", "steps", "reps", "warmup", "chunk", "sinks", "window",
                      "kernels", "flush", "seed"),
                     lambda model, info, text_ids: capacity.CapacityBench(model, settings), capacity_report,
                     notes=lambda info: capacity.notes(settings))
