"""``kvq bench batch``: batched generation through mlx-lm's BatchGenerator (the server's path), per cache, kvcache in the
same run: prefill time, aggregate decode tokens/s and peak memory against the number of sequences.

Every row inserts the same random prompts into one BatchGenerator and runs it to the end; each repetition measures
kvcache (mlx-lm's own caches) first, so every ratio compares rows of one repetition in one process. --warmup untimed
repetitions of every row come first, then --reps timed ones; the tables give each (batch, method)'s median and
min-max over the timed ones. Writes OUT/NAME.json (every timed row, after each; at the end the medians as
"summary"), OUT/NAME.md and OUT/NAME.png.
"""

from __future__ import annotations

import argparse

from .bench_cmd import _model_config, add_model_and_cache_options, at_least, bench_specs, checked_bench, run_bench

EPILOG = """
models: the default model (SmolLM2-135M-Instruct), any --model kvq eval takes, or random:PRESET, a random-weight
llama of a real shape (random:llama3-8b, random:llama3-3b, random:llama3-1b, random:tiny; --layers cuts its layer
count). Prompts are random token ids.

methods: kvq eval's method strings for kvq caches; kvcache is mlx-lm's own caches (fp16 its older name; always measured first, the
reference). mlx-lm's QuantizedKVCache (mlx-affine:N) is not measured: BatchGenerator cannot batch it.

Defaults: --batches 1,8 and --prompt 2048 on a GPU, --batches 1,4 and --prompt 256 on the CPU.
Without --name, NAME is batch-DATE-DEVICE-MODEL, with -2, -3 ... added where an earlier run's files have that name.
The PNG needs matplotlib, kvq-core's plots extra (the error says how to install it here; or pass --no-plot).
"""


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvq bench batch``."""
    from ..bench import batch

    p = argparse.ArgumentParser(prog="kvq bench batch", description=__doc__.split("\n\n")[0].replace("``", ""),
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model name, folder, .gguf, Hub id, or random:PRESET")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated method strings (default: {','.join(batch.DEFAULT_METHODS)}, if installed)")
    p.add_argument("--batches", default=None, help="sequences generated together, comma-separated (see below)")
    p.add_argument("--prompt", type=int, default=None, help="tokens per prompt (see below)")
    p.add_argument("--shortest", type=int, default=None,
                   help="the shortest prompt's tokens: a batch's prompt lengths evenly spaced from --prompt down to "
                        "it, as a server's requests differ (default: every prompt --prompt tokens)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per sequence (default 64)")
    p.add_argument("--chunk", type=int, default=2048,
                   help="BatchGenerator's prefill_step_size (default 2048, mlx-lm's)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed repetitions of every row before the timed ones (default 1; they compile kernels)")
    p.add_argument("--reps", type=int, default=3,
                   help="timed repetitions of every row (default 3; the tables show their median and min-max)")
    add_model_and_cache_options(p)
    p.add_argument("--seed", type=int, default=0, help="seed of random weights and prompts (default 0)")
    p.add_argument("--out", default="bench-batch", help="output folder (default ./bench-batch)")
    p.add_argument("--name", default=None,
                   help="file name stem (default batch-DATE-DEVICE-MODEL; -2, -3 ... added when taken)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="write no PNG (matplotlib is not needed then)")
    return p


def check(args) -> dict:
    """Every input check of ``kvq bench batch`` that needs no model weights.

    :return: ``{"name", "config", "path", "settings", "specs", "dtype"}``.
    :raises ValueError: the first bad input, naming the option and what it allows.
    """
    from ..bench import batch
    from ..bench.ops import parse_sizes
    from ..bench.random_model import is_random
    from ..problem import device_kind

    on_cpu = device_kind() == "cpu"
    prompt = args.prompt if args.prompt is not None else 256 if on_cpu else 2048
    at_least(("--prompt", prompt, 1), ("--tokens", args.tokens, 2), ("--chunk", args.chunk, 1),
              ("--warmup", args.warmup, 0), ("--reps", args.reps, 1), ("--sinks", args.sinks, 0),
              ("--window", args.window, 0), ("--flush", args.flush, 1))
    if args.shortest is not None and not 1 <= args.shortest <= prompt:
        raise ValueError(f"--shortest must be from 1 to --prompt ({prompt}); got {args.shortest}")
    batches = parse_sizes(args.batches, "--batches", "1,8,32") if args.batches else (1, 4) if on_cpu else (1, 8)
    random = is_random(args.model)
    name, config, path = _model_config(args)
    limit = config.get("max_position_embeddings")
    if limit is not None and prompt + args.tokens > limit:
        raise ValueError(f"--prompt {prompt} + --tokens {args.tokens} exceed the model's max_position_embeddings "
                         f"({limit})")
    specs = bench_specs(args, config, random, batch.DEFAULT_METHODS)
    mlx = [s.label for s in specs if s.is_mlx]
    if mlx:
        raise ValueError(f"--methods: {', '.join(mlx)}: mlx-lm's BatchGenerator cannot batch its QuantizedKVCache; "
                         "choose kvcache and kvq methods")
    settings = batch.BatchSettings(batches, prompt, tokens=args.tokens, reps=args.reps, warmup=args.warmup,
                                   chunk=args.chunk, sinks=args.sinks, window=args.window, flush=args.flush,
                                   kernels=args.kernels, seed=args.seed, progress=not args.no_progress,
                                   shortest=args.shortest)
    return checked_bench((name, config, path), settings, specs, args, random)


def main(argv: list[str]) -> int:
    """Run ``kvq bench batch``; every argument (and matplotlib, for the plot) is checked before any model is
    loaded or built."""
    args = parser().parse_args(argv)
    checked = check(args)
    from ..bench import batch, batch_report

    settings = checked["settings"]
    return run_bench("kvq bench batch", argv, args, checked, "batch-",
                     ("batches", "prompt", "shortest", "tokens", "warmup", "reps", "chunk", "sinks", "window", "flush",
                      "kernels", "seed"),
                     lambda model, info, text_ids: batch.BatchBench(model, settings, info["vocab_size"]),
                     batch_report, notes=lambda info: batch.notes(settings), summary=batch.summarize)
