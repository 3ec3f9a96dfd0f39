"""``kvq fit``: the longest context one sequence (or --batch) can hold, and the most sequences of --context tokens,
that fit in this device's memory (or --memory) with mlx-lm's KVCache (kvcache) and each installed kvq cache; predicted, nothing allocated.

Writes OUT/NAME.json and OUT/NAME.png and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex

from .argtypes import add_layout_options

EPILOG = """
Predicted from: the model's weights (the sizes of its .safetensors files, read without loading it; random:PRESET
models: parameters x dtype size), its shape (layers, num_kv_heads, head_dim; sliding-window layers hold at most
their window) and each method's bits accounting (Method.accounting: codes, norms, scales per token), with kvq's
caches laid out as they really are (sinks and the window buffer of window + flush - 1 tokens in 16 bits, the
compressed store in steps of 256 tokens) and mlx-lm's KVCache in the model's dtype in steps of 256 tokens.
Per sequence, storing one chunk of --chunk tokens in one layer adds a moment's transient (the chunk, its copy,
the encoders' float32 work (--device: a CPU's pure-MLX encoders hold more), the layer's buffer copied as it
grows); a fixed 1 MiB allowance and the methods' shared constants (codebooks, rotations) are added once. The
caches may use --safety (default 0.9, as kvq bench capacity) of what the weights and the fixed term leave.

--memory: bytes in all, with K, M, G, T suffixes (powers of 1024: 24G, 141G); default: this device's memory as
MLX reports it (a GPU's total memory, an Apple GPU's recommended working set) or the machine's RAM on the CPU.
--context: tokens per sequence for the sequences column (K suffix; default 32K, or the model's maximum if less).
An NVIDIA H200 (sold as 141 GB) reports 150,754,820,096 bytes (140.4 GiB) to MLX: --memory 141G is 0.4% more.
--device gpu predicts for a GPU from another machine (the encoders' transient differs; give --memory).
The PNG needs matplotlib, kvq-core's plots extra (or pass --no-plot).
"""

#: Method strings predicted without --methods (those installed), kvcache (mlx-lm's KVCache) first.
DEFAULT_METHODS = ("kvcache", "affine:4", "turboquant:4", "turboquant:k4v3", "turboquant:3")


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvq fit``."""
    p = argparse.ArgumentParser(prog="kvq fit", description=__doc__.split("\n\n")[0].replace("``", ""),
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model name, folder, Hub id, or random:PRESET (default model)")
    p.add_argument("--memory", "--budget", dest="memory", default=None, help="bytes in all, K/M/G/T suffixes (default: this device's)")
    p.add_argument("--context", default=None,
                   help="tokens per sequence for the sequences column (default 32K, or the model's maximum if less)")
    p.add_argument("--batch", type=int, default=1, help="sequences for the longest-context column (default 1)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated method strings (default: {','.join(DEFAULT_METHODS)}, if installed)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="the model's dtype (default as kvq bench: real models as stored, random models bfloat16 "
                        "for a GPU, float32 for a CPU: the --device predicted for)")
    p.add_argument("--layers", type=int, default=None, help="random models: keep this many layers")
    add_layout_options(p)
    p.add_argument("--flush", type=int, default=None, help="kvq caches: tokens per compression (default kvq's)")
    p.add_argument("--safety", type=float, default=0.9, help="fraction of the free memory caches may use (0.9)")
    p.add_argument("--chunk", type=int, default=4096, help="tokens per cache update, for the transient (4096)")
    p.add_argument("--device", choices=("cpu", "gpu"), default=None,
                   help="whose encoders the transient counts (default: this device's kind)")
    p.add_argument("--out", default="kvq-fit", help="output folder (default ./kvq-fit)")
    p.add_argument("--name", default=None, help="file name stem (default fit-DATE-MODEL-MEMORY)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG (matplotlib is not needed then)")
    return p


def device_memory() -> tuple[int, str]:
    """``(bytes, where from)``: the GPU's memory as MLX reports it (:func:`kvq.cli.bench_capacity_cmd.
    device_memory`; an Apple GPU's ``max_recommended_working_set_size`` first), else the machine's RAM."""
    import mlx.core as mx

    from .bench_capacity_cmd import device_memory as gpu_memory

    working_set = mx.device_info().get("max_recommended_working_set_size")
    if working_set:
        return int(working_set), "MLX: recommended working set"
    memory = gpu_memory()
    if memory:
        return memory, "MLX: device memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the machine's RAM"


def check(args) -> dict:
    """Every input check; returns ``{"device", "shape", "budget", "specs", "context", "memory_source"}``.

    :raises ValueError: the first bad input, naming the option and what it allows.
    """
    from ..bench import fit
    from ..bench.ops import parse_size
    from ..bench.random_model import is_random
    from .bench_cmd import _model_config, at_least, bench_specs, default_dtype


    if args.memory is not None:
        memory, source = parse_size(args.memory, "--memory", "bytes"), "--memory"
    else:
        memory, source = device_memory()
    context = parse_size(args.context, "--context", "tokens") if args.context is not None else None
    at_least(("--batch", args.batch, 1), ("--sinks", args.sinks, 0), ("--window", args.window, 0),
             ("--chunk", args.chunk, 1), ("--flush", args.flush or 1, 1))
    if not 0 < args.safety <= 1:
        raise ValueError(f"--safety must be in (0, 1]; got {args.safety}")
    from ..problem import device_kind

    device = args.device or ("cpu" if device_kind() == "cpu" else "gpu")
    name, config, path = _model_config(args)
    random = is_random(args.model)
    # a random model's dtype follows the device predicted for (--device gpu from a CPU: bfloat16, as kvq bench runs it
    # on a GPU), not the machine this runs on
    shape = fit.model_shape(name, config, path, default_dtype(args, random, cpu=device == "cpu"))
    context = context or min(32768, shape.max_context or 32768)
    specs = bench_specs(args, config, random, DEFAULT_METHODS)
    budget = fit.Budget(shape, memory, args.safety, args.chunk)
    return {"device": device, "shape": shape, "budget": budget, "specs": specs, "context": context,
            "memory_source": source}


def document(args, checked: dict, argv: list[str]) -> dict:
    """The JSON document: settings, model, one row per cache (:func:`kvq.bench.fit_report.row`)."""
    import attrs

    from ..bench import fit, fit_report
    from ..bench.measure import environment

    budget, context = checked["budget"], checked["context"]
    costs = [fit.cache_cost(s, budget.shape, args.sinks, args.window, args.flush, checked["device"])
             for s in checked["specs"]]
    return {"benchmark": "kvq fit", "environment": environment(f"kvq fit {shlex.join(argv)}"),
            "settings": {"memory": budget.memory, "memory_source": checked["memory_source"], "context": context,
                         "batch": args.batch, "device": checked["device"], "safety": budget.safety,
                         "chunk": budget.chunk,
                         "fixed_overhead": fit.FIXED_OVERHEAD},
            "model": attrs.asdict(budget.shape),
            "rows": [fit_report.row(budget, c, context, args.batch) for c in costs]}



def size_tag(n: int) -> str:
    """``n`` bytes as a file name's tag in :func:`kvq.bench.fit_report.size_unit`'s unit: ``"24g"``, ``"512m"``,
    ``"1k"``, ``"100b"`` (a memory below 1 GiB was named ``0g``)."""
    from ..bench.fit_report import size_unit

    value, unit = size_unit(n)
    return f"{value:.0f}{unit[0].lower()}"


def main(argv: list[str]) -> int:
    """Run ``kvq fit``: check every input (and matplotlib, for the plot), predict, print and write the files."""
    from ..bench import fit_report, output

    args = parser().parse_args(argv)
    if not args.no_plot:
        output.pyplot()
    checked = check(args)
    doc = document(args, checked, argv)
    memory = size_tag(checked["budget"].memory)
    stem = args.name or f"fit-{datetime.date.today().isoformat()}-{output.slug(doc['model']['name'])}-{memory}"
    paths = output.output_paths(args.out, stem, (".json", ".png"))
    output.write_json(doc, paths[".json"])
    print(fit_report.markdown(doc))
    if not args.no_plot:
        fit_report.plot(doc, paths[".png"])
    print(f"\nwrote {paths['.json']}" + ("" if args.no_plot else f", {paths['.png']}"))
    return 0
