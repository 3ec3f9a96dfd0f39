"""``kvq bench SUBCOMMAND``: benchmarks that write a JSON document, a markdown table and PNG plots.

Subcommands are registered in :data:`SUBCOMMANDS` as ``"module:function"``; the function takes the
subcommand's arguments (``list[str]``) and returns an exit code. It is imported only when chosen.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import shlex
import sys
from pathlib import Path

from ..defaults import DEFAULT_FLUSH
from .argtypes import add_layout_options

#: name -> ("module:function", one-line help).
SUBCOMMANDS = {
    "e2e": ("kvq.cli.bench_cmd:e2e_main", "decode tokens/s and memory against context length per cache"),
    "ops": ("kvq.cli.bench_ops_cmd:main", "each op per method, kernels vs pure MLX, time/memory/bandwidth vs size"),
    "prefill": ("kvq.cli.bench_prefill_cmd:main", "prefill tokens/s and peak memory against prompt length per cache"),
    "batch": ("kvq.cli.bench_batch_cmd:main", "batched generation through mlx-lm's BatchGenerator, per cache"),
    "capacity": ("kvq.cli.bench_capacity_cmd:main",
                 "the most sequences that fit in the device's memory per cache, and their decode tokens/s"),
}


def _usage() -> str:
    lines = ["usage: kvq bench SUBCOMMAND [options]", "", "subcommands:"]
    width = max(map(len, SUBCOMMANDS)) + 1
    lines += [f"  {name:<{width}} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines + ["", "Run 'kvq bench SUBCOMMAND --help' for its options."])


def main(argv: list[str]) -> int:
    """Dispatch ``kvq bench SUBCOMMAND ...``. :raises ValueError: an unknown subcommand (the known are named)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] not in SUBCOMMANDS:
        raise ValueError(f"unknown subcommand {argv[0]!r}; choose one of {', '.join(SUBCOMMANDS)}")
    module, function = SUBCOMMANDS[argv[0]][0].split(":")
    return getattr(importlib.import_module(module), function)(argv[1:])


# -- kvq bench e2e ----------------------------------------------------------------------------------------

E2E_EPILOG = """
models: the default model (SmolLM2-135M-Instruct, as kvq eval), any --model kvq eval takes, or random:PRESET, a
random-weight llama of a real shape (random:llama3-8b, random:llama3-3b, random:llama3-1b, random:tiny; --layers
cuts its layer count). Random models are filled with random keys and values; real models by default with the
keys and values of one real prefill of the Python language reference per context (--fill replay).

methods: kvq eval's method strings; kvcache is mlx-lm's KVCache (fp16 its older name; always measured first, the reference),
mlx-affine:N mlx-lm's QuantizedKVCache (kv_bits N, group 64), kvq-fp16 kvq's own 16-bit cache. A method
calibrated per model (vecinfer) uses --model's calibration unless [model_id=...] names another.

Default contexts: real models 1024,2048,4096 on the CPU, 1K..8K on a GPU (up to the model's maximum); random
models 1024,4096 on the CPU, 4K,16K,32K,64K,128K on a GPU. Sizes take K suffixes (1K = 1024).
Writes OUT/NAME.json (after every row), OUT/NAME.md and OUT/NAME.png; --report OUT/NAME.json redraws the last two.
Without --name, NAME is DATE-DEVICE-MODEL, with -2, -3 ... added where an earlier run's files have that name.
The PNG needs matplotlib, kvq-core's plots extra (the error says how to install it here; or pass --no-plot).
"""


def add_model_and_cache_options(p: argparse.ArgumentParser) -> None:
    """The options ``kvq bench e2e`` and ``kvq bench prefill`` share: ``--dtype``, ``--layers`` (the model) and
    ``--sinks``, ``--window``, ``--flush``, ``--kernels`` (kvq caches)."""
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="model dtype (default: random models bfloat16 on a GPU, float32 on the CPU; real models "
                        "as stored)")
    p.add_argument("--layers", type=int, default=None, help="random models: keep this many layers")
    add_layout_options(p)
    p.add_argument("--flush", type=int, default=DEFAULT_FLUSH, metavar="N",
                   help=f"kvq caches: tokens leave the window in blocks of N (default {DEFAULT_FLUSH}, as kvq "
                        "generate)")
    p.add_argument("--kernels", choices=("auto", "require", "off"), default="auto",
                   help="kvq caches: fused kernels (default auto)")


def e2e_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvq bench e2e``."""
    from ..bench import e2e

    summary = e2e.__doc__.split("\n\n")[0].replace("``", "")
    p = argparse.ArgumentParser(prog="kvq bench e2e", description=summary, epilog=E2E_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model name, folder, .gguf, Hub id, or random:PRESET")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated method strings (default: {','.join(e2e.DEFAULT_METHODS)}, if installed)")
    p.add_argument("--contexts", default=None, help="context lengths, comma-separated (see below)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed decode steps per row (default: --flush, one whole flush period, so tokens/s counts "
                        "the step that compresses as often as decoding meets it)")
    p.add_argument("--batch", type=int, default=1,
                   help="sequences decoded together, each of --contexts tokens (random fill only; default 1): "
                        "tokens/s then counts every row's token")
    p.add_argument("--rounds", type=int, default=1,
                   help="above 1: hold every cache of a context at once and decode --steps steps per cache per "
                        "round, the caches taking turns (order reversed every round), so a shared machine's slow "
                        "and fast periods fall on every cache alike (default 1: one cache after the other)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed decode steps first (default: --flush + 1 on a GPU, so the first window flush, "
                        "when quantize kernels compile, is untimed; 1 on the CPU)")
    p.add_argument("--fill", choices=e2e.FILLS, default=None,
                   help="how caches reach the context: random, replay (one real prefill), prefill (each cache)")
    p.add_argument("--chunk", type=int, default=4096, help="tokens per update_and_fetch when filling (default 4096)")
    add_model_and_cache_options(p)
    p.add_argument("--largest-first", action="store_true",
                   help="measure the longest context first (a run cut short keeps the rows that matter most)")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights, keys and values (default 0)")
    p.add_argument("--out", default="bench-e2e", help="output folder (default ./bench-e2e)")
    p.add_argument("--name", default=None,
                   help="file name stem (default DATE-DEVICE-MODEL; -2, -3 ... added when taken)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plot", action="store_true", help="write no PNG (matplotlib is not needed then)")
    p.add_argument("--report", default=None, metavar="JSON",
                   help="measure nothing: write the .md and .png of a result JSON (one cut short, say) beside it")
    return p


def e2e_report_only(path: str, plot: bool = True) -> int:
    """Write ``NAME.md`` and (with ``plot``) ``NAME.png`` beside the result ``NAME.json`` (rows measured so far)
    and print the tables. :raises ValueError: the file cannot be read or is not a ``kvq bench e2e`` result, or
    matplotlib is missing for the plot."""
    from ..bench import e2e_report

    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--report: cannot read {path}: {exc}") from None
    if not isinstance(document, dict) or document.get("benchmark") != "kvq bench e2e":
        raise ValueError(f"--report: {path} is not a kvq bench e2e result")
    json_path = Path(path)
    json_path.with_suffix(".md").write_text(e2e_report.markdown_file(document))
    if plot:
        e2e_report.plot(document, json_path.with_suffix(".png"))
    print(e2e_report.markdown(document["rows"]))
    return 0


def _model_config(args) -> tuple[str, dict, object]:
    """``(name, llama config dict, local path or None)`` of ``--model``, without loading weights."""
    from ..bench.random_model import is_random, random_config

    if is_random(args.model):
        return args.model, random_config(args.model, args.layers), None
    if args.layers is not None:
        raise ValueError(f"--layers applies to random:PRESET models only; got --model {args.model or 'default'}")
    from ..models import DEFAULT_MODEL, resolve_model

    path = resolve_model(args.model)
    config = json.loads((path / "config.json").read_text())
    return args.model or DEFAULT_MODEL, config.get("text_config", config), path


def _contexts(text: str | None, random: bool, limit: int | None) -> tuple[int, ...]:
    from ..bench.ops import parse_sizes
    from ..problem import device_kind

    if text is not None:
        return parse_sizes(text, "--contexts")
    gpu = device_kind() != "cpu"
    if random:
        return (4096, 16384, 32768, 65536, 131072) if gpu else (1024, 4096)
    return tuple(c for c in ((1024, 2048, 4096, 8192) if gpu else (1024, 2048, 4096)) if limit is None or c <= limit)


def e2e_check(args) -> dict:
    """Every input check of ``kvq bench e2e`` that needs no model weights.

    :return: ``{"name", "config", "path", "settings", "specs", "dtype"}``.
    :raises ValueError: the first bad input, naming the option and what it allows.
    """
    from ..bench import e2e
    from ..bench.random_model import is_random

    warmup = args.warmup if args.warmup is not None else 1 if _on_cpu() else args.flush + 1
    steps = args.flush if args.steps is None else args.steps
    at_least(("--steps", steps, 1), ("--warmup", warmup, 0), ("--chunk", args.chunk, 1),
              ("--sinks", args.sinks, 0), ("--window", args.window, 0), ("--flush", args.flush, 1),
              ("--rounds", args.rounds, 1))
    random = is_random(args.model)
    fill = args.fill or ("random" if random else "replay")
    if random and fill != "random":
        raise ValueError(f"--fill {fill}: random:PRESET models have no text to prefill; use --fill random")
    name, config, path = _model_config(args)
    limit = config.get("max_position_embeddings")
    contexts = _contexts(args.contexts, random, limit)
    if limit is not None and max(contexts) > limit:
        raise ValueError(f"--contexts {max(contexts)} is longer than the model's max_position_embeddings ({limit})")
    specs = bench_specs(args, config, random, e2e.DEFAULT_METHODS)
    contexts = tuple(sorted(contexts, reverse=args.largest_first))
    settings = e2e.E2ESettings(contexts, steps, warmup, args.chunk, fill, args.sinks, args.window,
                               args.kernels, args.seed, not args.no_progress, args.flush, args.batch, args.rounds)
    return checked_bench((name, config, path), settings, specs, args, random)


def bench_specs(args, config: dict, random: bool, defaults: tuple[str, ...]) -> list:
    """``--methods`` of a bench (``None``: the installed ``defaults``), validated for the head_dim of ``config``
    (the model's llama config, :func:`_model_config`), kvcache first; a method calibrated per model (vecinfer) uses
    ``--model``'s calibration unless ``[model_id=...]`` names another.

    :raises ValueError: an unknown method or bad parameters (the message names them)."""
    from ..bench import e2e
    from ..evaluation import spec as spec_module

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]

    specs = e2e.parse_methods(args.methods, head_dim, args.sinks, args.window, defaults=defaults)
    return [spec_module.spec_for_model(s, args.model, head_dim, args.sinks, args.window, calibrated=not random)
            for s in specs]


def at_least(*checks: tuple[str, int, int]) -> None:
    """Each ``(option, value, minimum)``: :raises ValueError: the first whose value is below its minimum, naming
    the option (``--steps must be >= 1; got 0``)."""
    for option, value, low in checks:
        if value < low:
            raise ValueError(f"{option} must be >= {low}; got {value}")


def checked_bench(model: tuple, settings, specs: list, args, random: bool) -> dict:
    """What a bench's input check returns (:func:`run_bench`'s ``checked``): ``{"name", "config", "path",
    "settings", "specs", "dtype"}`` from ``model`` (:func:`_model_config`'s answer), the bench's settings, its specs
    (:func:`bench_specs`) and :func:`default_dtype`."""
    name, config, path = model
    return {"name": name, "config": config, "path": path, "settings": settings, "specs": specs,
            "dtype": default_dtype(args, random)}


def default_dtype(args, random: bool, cpu: bool | None = None) -> str | None:
    """``--dtype``, else random models' default: float32 on the CPU, bfloat16 on a GPU (``cpu``: for which kind of
    device; ``None``: this machine's); real models as stored (``None``)."""
    if args.dtype or not random:
        return args.dtype
    return "float32" if (_on_cpu() if cpu is None else cpu) else "bfloat16"


def _on_cpu() -> bool:
    from ..problem import device_kind

    return device_kind() == "cpu"


def _load(checked: dict, seed: int):
    """``(model, text token ids or None)``: the random model built, or the real model and its tokenized text."""
    import mlx.core as mx

    from ..bench.random_model import build_random_model

    dtype = None if checked["dtype"] is None else getattr(mx, checked["dtype"])
    if checked["path"] is None:
        return build_random_model(checked["config"], dtype, seed), None
    from ..models import load
    from ..textdata import encode_text, language_reference

    model, tokenizer = load(checked["path"], dtype=dtype)
    return model, encode_text(tokenizer, language_reference())


def _model_info(name: str, model, path) -> dict:
    from mlx.utils import tree_flatten

    from ..bench.e2e import model_dtype

    a, weights = model.args, [v for _, v in tree_flatten(model.parameters())]
    fields = {key: getattr(a, name, None) for key, name in (
        ("hidden_size", "hidden_size"), ("q_heads", "num_attention_heads"), ("kv_heads", "num_key_value_heads"),
        ("intermediate_size", "intermediate_size"), ("vocab_size", "vocab_size"),
        ("max_position_embeddings", "max_position_embeddings"))}
    return {"name": name, "path": None if path is None else str(path), "layers": len(model.layers), **fields,
            "head_dim": getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads,
            "dtype": str(model_dtype(model)).split(".")[-1],
            "parameters": sum(w.size for w in weights), "weight_bytes": sum(w.nbytes for w in weights)}


def _result_paths(out: str, stem: str, named: bool, command: str = "kvq bench e2e") -> dict:
    """The result files; a default name already taken by an earlier run gets a suffix (``-2``, ``-3`` ...), and
    either case is said on stderr: nothing is overwritten silently."""
    from ..bench import output

    free = stem if named else output.unused_stem(out, stem)
    paths = output.output_paths(out, free)
    if free != stem:
        print(f"{command}: keeping an earlier run's {Path(out) / stem}.*; writing {paths['.json']}",
              file=sys.stderr)
    elif paths[".json"].exists():
        print(f"{command}: overwriting {paths['.json']} (--name {stem})", file=sys.stderr)
    return paths


def e2e_main(argv: list[str]) -> int:
    """Run ``kvq bench e2e``; every argument (and matplotlib, for the plot) is checked before any model is loaded
    or built."""
    args = e2e_parser().parse_args(argv)
    if args.report:
        return e2e_report_only(args.report, plot=not args.no_plot)
    checked = e2e_check(args)
    from ..bench import e2e, e2e_report

    settings = checked["settings"]

    def notes(info: dict) -> list[str]:
        limit, steps = info["max_position_embeddings"], settings.warmup + settings.rounds * (settings.steps + 2)
        lines = [f"context {c} + {steps} decode steps exceed max_position_embeddings {limit}"
                 for c in settings.contexts if limit and c + steps > limit]
        kvq_measured = any(e2e.cache_kind(spec) == "kvq KVQCache" for spec in checked["specs"])
        if kvq_measured and settings.steps % settings.flush:  # tokens/s weighs a flush's cost right only then
            lines.append(f"--steps {settings.steps} is not a multiple of --flush {settings.flush}: the timed steps "
                         f"hold {settings.steps // settings.flush} or {-(-settings.steps // settings.flush)} window "
                         f"flushes of a kvq cache where decoding holds one per {settings.flush} steps, so its "
                         f"tokens/s misweighs their cost (time a multiple of --flush steps)")
        return lines

    return run_bench("kvq bench e2e", argv, args, checked, "",
                     ("contexts", "steps", "warmup", "chunk", "fill", "sinks", "window", "kernels", "seed", "flush",
                      "batch", "rounds"),
                     lambda model, info, text_ids: e2e.E2EBench(model, settings, text_ids), e2e_report,
                     notes=notes)


def run_bench(title: str, argv: list[str], args, checked: dict, prefix: str, keys: tuple[str, ...], make_bench,
              report, extra: dict | None = None, notes=None, summary=None) -> int:
    """The part every ``kvq bench`` subcommand with a model shares, after its input checks: matplotlib checked
    (for the plot) before any model work, the result files chosen (``prefix`` DATE-DEVICE-MODEL without
    ``--name``), the model loaded or built, then a JSON document written after every row and the reports at the
    end (:func:`write_reports`).

    :param title: ``"kvq bench NAME"`` (the document's ``benchmark``). :param args: the parsed arguments (``name``,
        ``out``, ``seed``, ``no_plot``); :param checked: the subcommand's check result (``name``, ``config``,
        ``path``, ``settings``, ``specs``, ``dtype``).
    :param keys: the settings' attributes saved in the document; :param extra: more ``settings`` entries.
    :param make_bench: ``make_bench(model, model_info, text_ids)`` -> an object whose ``run(specs, on_row=)``
        measures the rows. :param report: the subcommand's report module (:func:`write_reports`).
    :param notes: ``notes(model_info)`` -> lines saved as the document's ``notes``.
    :param summary: ``summary(rows)`` -> what is saved as the document's ``summary`` once every row is measured
        (the medians of repeated rows).
    :return: the exit code (:func:`write_reports`: 1 where every row failed, else 0).
    """
    from ..bench import measure, output
    from ..problem import device_kind

    if not args.no_plot:
        output.pyplot()  # fail now, not after the measurements, when matplotlib is missing
    stem = args.name or f"{prefix}{datetime.date.today().isoformat()}-{device_kind()}-{output.slug(checked['name'])}"
    paths = _result_paths(args.out, stem, named=args.name is not None, command=title)
    model, text_ids = _load(checked, args.seed)
    settings = checked["settings"]
    info = _model_info(checked["name"], model, checked["path"])
    document = {"benchmark": title, "environment": measure.environment(f"{title} {shlex.join(argv)}"),
                "settings": {**{k: getattr(settings, k) for k in keys}, **(extra or {}),
                             "methods": [s.label for s in checked["specs"]]},
                "model": info, **({} if notes is None else {"notes": notes(info)}), "rows": []}
    for note in document.get("notes", []):  # before the run too: a reader may stop a run that measures nothing
        print(f"Note: {note}", file=sys.stderr)

    def save(row: dict) -> None:
        document["rows"].append(row)
        output.write_json(document, paths[".json"])

    make_bench(model, info, text_ids).run(checked["specs"], on_row=save)
    if summary is not None:
        document["summary"] = summary(document["rows"])
        output.write_json(document, paths[".json"])
    return write_reports(document, paths, report, plot=not args.no_plot)


def write_reports(document: dict, paths: dict, report, plot: bool) -> int:
    """After a bench's rows: ``NAME.md`` (and with ``plot`` ``NAME.png``) from ``report`` (a module with
    ``markdown_file``, ``plot`` and ``markdown``), the tables on stdout, a summary on stderr; returns the exit code:
    0, or 1 where every row failed (nothing was measured: a script running the benchmark must not read success;
    the files still say why each row failed)."""
    paths[".md"].write_text(report.markdown_file(document))
    wrote = [paths[".json"], paths[".md"]]
    if plot:
        report.plot(document, paths[".png"])
        wrote.append(paths[".png"])
    print(report.markdown(document["rows"]))
    for note in document.get("notes", []):  # in the .md too; a reader of the terminal needs them as much
        print(f"Note: {note}", file=sys.stderr)
    failed = sum(bool(r["error"]) for r in document["rows"])
    print(f"\n{len(document['rows'])} rows ({failed} failed); wrote {', '.join(map(str, wrote))}", file=sys.stderr)
    if document["rows"] and failed == len(document["rows"]):
        print("error: every row failed (see each row's error above and in the files)", file=sys.stderr)
        return 1
    return 0
