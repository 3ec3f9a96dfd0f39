"""``kvq bench prefill``: prefill tokens/s and peak memory against prompt length, per cache, kvcache in the same run.

Every cache prefills the same prompt in chunks (mlx-lm's 2048 by default), each chunk's cache state evaluated before
the next as ``mlx_lm.generate`` does; each repetition measures kvcache (mlx-lm's KVCache) first, so every ratio compares
rows of one repetition in one process. Writes OUT/NAME.json (after every row), OUT/NAME.md and OUT/NAME.png.
"""

from __future__ import annotations

import argparse

from .bench_cmd import _model_config, add_model_and_cache_options, at_least, bench_specs, checked_bench, run_bench

EPILOG = """
models: the default model (SmolLM2-135M-Instruct), any --model kvq eval takes, or random:PRESET, a random-weight
llama of a real shape (random:llama3-8b, random:llama3-3b, random:llama3-1b, random:tiny; --layers cuts its layer
count). Real models prefill the Python language reference (repeated to the prompt length); random models random
token ids.

methods: kvq eval's method strings; kvcache is mlx-lm's KVCache (fp16 its older name; always measured first, the reference),
mlx-affine:N mlx-lm's QuantizedKVCache (kv_bits N, group 64).

Default prompt lengths: random models 1K,4K on the CPU, 8K,32K,128K on a GPU; real models 1K,2K,4K on the CPU,
1K..8K on a GPU (up to the model's maximum). Sizes take K suffixes (1K = 1024).
Without --name, NAME is prefill-DATE-DEVICE-MODEL, with -2, -3 ... added where an earlier run's files have that
name. The PNG needs matplotlib, kvq-core's plots extra (the error says how to install it here; or pass --no-plot).
"""


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvq bench prefill``."""
    from ..bench import prefill

    p = argparse.ArgumentParser(prog="kvq bench prefill", description=__doc__.split("\n\n")[0].replace("``", ""),
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model name, folder, .gguf, Hub id, or random:PRESET")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated method strings (default: {','.join(prefill.DEFAULT_METHODS)}, if "
                        "installed)")
    p.add_argument("--contexts", default=None, help="prompt lengths, comma-separated (see below)")
    p.add_argument("--chunk", type=int, default=2048,
                   help="tokens per forward pass (default 2048, mlx-lm's prefill_step_size)")
    p.add_argument("--reps", type=int, default=2, help="repetitions of every row (default 2; the first compiles)")
    add_model_and_cache_options(p)
    p.add_argument("--seed", type=int, default=0, help="seed of random weights and prompts (default 0)")
    p.add_argument("--out", default="bench-prefill", help="output folder (default ./bench-prefill)")
    p.add_argument("--name", default=None,
                   help="file name stem (default prefill-DATE-DEVICE-MODEL; -2, -3 ... added when taken)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="write no PNG (matplotlib is not needed then)")
    return p


def _contexts(text: str | None, random: bool, limit: int | None) -> tuple[int, ...]:
    from ..bench.ops import parse_sizes
    from ..problem import device_kind

    if text is not None:
        contexts = parse_sizes(text, "--contexts")
    elif random:
        contexts = (8192, 32768, 131072) if device_kind() != "cpu" else (1024, 4096)
    else:
        contexts = (1024, 2048, 4096, 8192) if device_kind() != "cpu" else (1024, 2048, 4096)
        contexts = tuple(c for c in contexts if limit is None or c <= limit)
    if limit is not None and max(contexts) > limit:
        raise ValueError(f"--contexts {max(contexts)} is longer than the model's max_position_embeddings ({limit})")
    return contexts


def check(args) -> dict:
    """Every input check of ``kvq bench prefill`` that needs no model weights.

    :return: ``{"name", "config", "path", "settings", "specs", "dtype"}``.
    :raises ValueError: the first bad input, naming the option and what it allows.
    """
    from ..bench import prefill
    from ..bench.random_model import is_random

    at_least(("--chunk", args.chunk, 1), ("--reps", args.reps, 1), ("--sinks", args.sinks, 0),
              ("--window", args.window, 0), ("--flush", args.flush, 1))
    random = is_random(args.model)
    name, config, path = _model_config(args)
    contexts = _contexts(args.contexts, random, config.get("max_position_embeddings"))
    specs = bench_specs(args, config, random, prefill.DEFAULT_METHODS)
    settings = prefill.PrefillSettings(contexts, args.chunk, args.reps, args.sinks, args.window, args.flush,
                                       args.kernels, args.seed, not args.no_progress)
    return checked_bench((name, config, path), settings, specs, args, random)


def main(argv: list[str]) -> int:
    """Run ``kvq bench prefill``; every argument (and matplotlib, for the plot) is checked before any model is
    loaded or built."""
    args = parser().parse_args(argv)
    checked = check(args)
    from ..bench import prefill, prefill_report

    settings = checked["settings"]
    prompt = "random token ids" if checked["path"] is None else "the Python language reference"
    return run_bench("kvq bench prefill", argv, args, checked, "prefill-",
                     ("contexts", "chunk", "reps", "sinks", "window", "flush", "kernels", "seed"),
                     lambda model, info, text_ids: prefill.PrefillBench(model, settings, info["vocab_size"], text_ids),
                     prefill_report, extra={"prompt": prompt})
