"""``kvq generate``: generate text with a real model and a compressed KV cache, and say what it cost.

    kvq generate --method turboquant --bits 3 --prompt "Why is the sky blue?" --compare kvcache --window 16 --flush 16

A short chat compresses only with a small window and flush, as here: the defaults (4 sinks, window 128, flush 128)
leave a conversation's first 259 tokens uncompressed.

Streams the generated text (``mlx_lm.stream_generate`` with a cache from ``kvq.make_prompt_cache``), then prints
prompt and generation tokens/s, the KV bytes resident for the compressed cache and for the reference, mlx-lm's
``KVCache`` in the model's dtype (``nbytes`` and the measured growth of ``mx.get_active_memory``), the ratio, and
with ``--compare kvcache`` (or ``fp16``, its older name) how well the method follows the reference: top-1 agreement
and mean KL(kvcache || method) on the reference's greedy tokens, teacher-forced.

Under ``mlx.launch`` every rank loads its shard of the model (tensor parallel, or ``--pipeline``) and its own kvq
caches (:mod:`kvq.distributed`); only rank 0 prints, and bytes are those of rank 0's caches.

    mlx.launch --backend ring -n 2 -- python -m kvq.cli generate --model M --method turboquant --bits 4 --prompt hi
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np

from .. import quality
from ..defaults import DEFAULT_FLUSH, DEFAULT_SINKS, DEFAULT_WINDOW
from ..selection import KERNELS
from .select_cmd import parse_param

#: The reference cache's options: mlx-lm's own caches for the model, in its dtype (:data:`kvq.cache.method_string.REFERENCE`).
REFERENCE = {"method": "kvcache"}
#: Prompt tokens per prefill step (mlx-lm uses 2048; on a 2-core CPU 512 was as fast, and holds less memory).
PREFILL_STEP = 512


@dataclass
class Run:
    """What one generation with one cache produced and cost.

    ``nbytes`` and ``measured`` are the cache's bytes after generation: the layers' ``nbytes`` and the growth of
    ``mx.get_active_memory`` from the empty cache to the filled one (everything else freed). ``logprobs`` holds
    the float32 ``[V]`` distribution of every generated token when recorded (the reference run).
    """

    label: str
    options: dict
    tokens: list[int]
    text: str
    prompt_tokens: int
    prompt_tps: float
    generation_tps: float
    cached_tokens: int
    nbytes: int
    measured: int
    logprobs: list[np.ndarray] = field(default_factory=list)
    comparison: quality.Comparison | None = None
    #: tokens compressed in the layer that holds the most (``None``: not kvq caches)
    compressed_tokens: int | None = None
    #: the kvq caches' (sinks, window, flush_tokens) as configured (``None``: not kvq caches); flush_tokens is
    #: ``--flush`` made a multiple of the methods' blocks (QJL's 32-token groups)
    schedule: tuple[int, int, int] | None = None
    #: the flush the kvq caches would run with ``--flush 1``: their methods' block (1, or QJL's 32); ``None``: not
    #: kvq caches
    least_flush: int | None = None


def cache_options(args: argparse.Namespace) -> dict:
    """``kvq.make_prompt_cache`` keyword arguments from the parsed command line.

    ``--method`` also takes ``kvq eval``'s method strings (``turboquant:4``, ``affine:k8v4``, ``qjl+affine:4``,
    ``turboquant:3[rotation=qr]``); they carry their own parameters, so ``--bits``/``--param`` and the per-side
    options are refused next to them. A method calibrated per model (``vecinfer``) uses ``--model``'s
    calibration unless ``--param model_id=...`` names another, and parameters that cannot encode yet (no such
    calibration) fail here, before the model is loaded (:func:`kvq.evaluation.spec.for_model`).

    ``--sinks``, ``--window`` and ``--flush`` default to 4, 128 and :data:`kvq.cache.DEFAULT_FLUSH`; where a
    method string sets one too (``turboquant:4[window=16]``), it is refused with another value.

    :raises ValueError: such a combination, a string that does not parse, bad or unready parameters, ``--sinks``
        or ``--window`` below 0, ``--flush`` below 1, a method string's sinks/window/flush or ``--param bits=``
        contradicted by ``--sinks``/``--window``/``--flush`` or ``--bits``.
    """
    from ..cache.method_string import KVQ_FP16, REFERENCE, is_method_string, parse_method

    if args.method.strip() == REFERENCE:
        compare = (f"compare against it with --compare {REFERENCE}" if hasattr(args, "compare") else
                   "to serve it, run mlx-lm's own server on the same model folder (mlx_lm.server --model FOLDER; "
                   "kvq keeps the models it converts under kvq.models.models_dir())")
        raise ValueError(f"--method {REFERENCE} is the reference (mlx-lm's KVCache), which kvq does not compress: "
                         f"{compare}; kvq's own 16-bit cache is --method fp16 ({KVQ_FP16} in method strings)")
    stated = {}  # --sinks, --window, --flush as given (None: not given; the parser's defaults are None)
    for name, low in (("sinks", 0), ("window", 0), ("flush", 1)):  # named as the command line spells them
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise ValueError(f"--{name} must be an integer >= {low}; got {value}")
        if value is not None:
            stated[name] = value
    layout = {**_LAYOUT_DEFAULTS, **stated}
    if is_method_string(args.method):

        given = [name for name, value in (("--bits", args.bits), ("--param", args.param),
                                          ("--key-method", args.key_method), ("--value-method", args.value_method),
                                          ("--key-param", args.key_param), ("--value-param", args.value_param))
                 if value]
        if given:
            raise ValueError(f"--method {args.method!r} carries its own parameters: drop {', '.join(given)} or "
                             f"write --method NAME with them")
        spec = parse_method(args.method.strip())
        if spec.is_mlx:
            raise ValueError(f"--method {args.method!r}: mlx-affine (mlx-lm's own cache) is for kvq eval and "
                             f"kvq bench; use --method affine for kvq's")
        # a method string's own sinks/window/flush ("affine:4[flush=128]") win over the options' defaults; given
        # both ways with different values, neither is picked silently
        clash = [name for name, value in stated.items() if spec.cache_options.get(name, value) != value]
        if clash:
            raise ValueError(f"--method {args.method!r} sets "
                             f"{', '.join(f'{n}={spec.cache_options[n]}' for n in clash)}; got "
                             f"{', '.join(f'--{n} {stated[n]}' for n in clash)} as well: give each once")
        return _for_model({**spec.cache_kwargs(layout["sinks"], layout["window"], layout["flush"]),
                           "kernels": getattr(args, "kernels", "auto")}, args.model)
    shared = dict(parse_param(p) for p in args.param)
    if args.bits is not None:
        if "bits" in shared and shared["bits"] != args.bits:
            raise ValueError(f"--bits {args.bits} and --param bits={shared['bits']} disagree: give bits once")
        shared["bits"] = args.bits
    options = {"method": args.method, **layout, "kernels": getattr(args, "kernels", "auto"), **shared}
    if args.key_method or args.key_param:
        options["key_method"] = args.key_method
        options["key_params"] = dict(parse_param(p) for p in args.key_param)
    if args.value_method or args.value_param:
        options["value_method"] = args.value_method
        options["value_params"] = dict(parse_param(p) for p in args.value_param)
    return _for_model(options, args.model)


def _for_model(options: dict, model: str | None) -> dict:
    """:func:`kvq.evaluation.spec.for_model` of ``options``, an unknown parameter named with this command's
    options for the cache's own settings (:class:`kvq.cache.UnknownParameterError` names their Python names).

    :raises ValueError: an unknown parameter (the method's allowed ones listed), and what ``for_model`` raises.
    """
    from ..cache import UnknownParameterError, cache_settings
    from ..evaluation.spec import for_model

    try:
        return for_model(options, model)
    except UnknownParameterError as exc:
        spelled = ([_CACHE_OPTIONS[name] for name in cache_settings() if name in _CACHE_OPTIONS]
                   + [f"--param {name}=..." for name in cache_settings() if name not in _CACHE_OPTIONS])
        raise ValueError(f"{exc.method_message}; the cache's own settings: {', '.join(spelled)}") from None


#: What ``--sinks``, ``--window`` and ``--flush`` default to (:func:`kvq.cache.make_config`'s defaults).
_LAYOUT_DEFAULTS = {"sinks": DEFAULT_SINKS, "window": DEFAULT_WINDOW, "flush": DEFAULT_FLUSH}

#: The option of :func:`add_cache_arguments` that sets each cache setting (:func:`kvq.cache.cache_settings`); the
#: others go through ``--param NAME=VALUE``.
_CACHE_OPTIONS = {"key_method": "--key-method", "value_method": "--value-method", "key_params": "--key-param",
                  "value_params": "--value-param", "sinks": "--sinks", "window": "--window", "kernels": "--kernels",
                  "flush": "--flush"}


def params_label(params, side: str | None = None) -> str:
    """``"turboquant bits=3"``: the method with its bits and every parameter that differs from the default (for a
    ``side``, ``"keys"`` or ``"values"``, the method's default for that side: VecInfer's ``role``)."""
    from ..contract import SideDefaults, optional_hook

    side_defaults = optional_hook(type(params), SideDefaults) if side else None
    defaults = side_defaults(side) if side_defaults is not None else {}
    shown = [f.name for f in attrs.fields(type(params))
             if f.init and (f.name == "bits" or getattr(params, f.name) != defaults.get(f.name, _default(f, params)))]
    return " ".join([params.method, *(f"{name}={getattr(params, name)}" for name in shown)])


def _default(field_: attrs.Attribute, params):
    """The default of an attrs field, given the other values of ``params`` (for defaults that depend on them)."""
    default = field_.default
    if isinstance(default, attrs.Factory):
        return default.factory(params) if default.takes_self else default.factory()
    return default


def cache_label(options: dict) -> str:
    """One line naming the key and value methods of ``options`` (as :func:`cache_options` returns them)."""
    from ..cache import CacheConfig, make_config

    config = make_config(**options)
    fields = {f.name: f.default for f in attrs.fields(CacheConfig)}
    shown = [f"{name} {getattr(config, name)}" for name in ("sinks", "window", "flush")
             if getattr(config, name) != fields[name]]
    if config.budget is None and config.flush_tokens != config.flush:  # QJL's groups: --flush 16 runs 32
        shown = [f"{item} (runs {config.flush_tokens})" if item.startswith("flush ") else item for item in shown]
    settings = ", ".join(shown)
    settings = f" ({settings})" if settings else ""  # the cache's settings where they are not the defaults
    if config.budget is not None:  # each layer's settings are chosen at its head_dims (kvq.cache.budget)
        method = config.key_params.method
        return f"{method} bits={config.budget:g} (a budget){settings}"
    keys, values = params_label(config.key_params, "keys"), params_label(config.value_params, "values")
    return (keys if keys == values else f"K {keys} / V {values}") + settings


def _bits(text: str) -> int | float:
    """``--bits``: ``"4"`` -> 4, ``"3.5"`` -> 3.5 (a budget: :mod:`kvq.cache.budget`).
    :raises argparse.ArgumentTypeError: not a number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bits must be a number (4, or a budget such as 3.5); got {text!r}") \
            from None
    return int(value) if value.is_integer() else value


def bits_per_coordinate(options: dict, model) -> tuple[float, float]:
    """``(keys, values)`` bits per coordinate of the compressed tokens (``accounting(head_dim)``)."""
    from ..cache import make_config

    _, key_dim, value_dim = quality.kv_layout(model)
    config = make_config(**options).within_budget(key_dim, value_dim)  # a bits budget's settings (kvq.cache.budget)
    return (config.key_params.accounting(key_dim).bits_per_coordinate,
            config.value_params.accounting(value_dim).bits_per_coordinate)


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text from ``--prompt`` or ``--prompt-file`` (``-`` reads standard input).

    :raises ValueError: the file cannot be read, or the prompt is empty.
    """
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(args.prompt_file).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read --prompt-file {args.prompt_file}: {error}") from None
    if not text.strip():
        raise ValueError("the prompt is empty")
    return text


def prompt_ids(tokenizer, text: str, chat: bool | None) -> list[int]:
    """Token ids of ``text``, wrapped in the tokenizer's chat template as one user message when ``chat``.

    :param chat: ``None``: use the chat template when the tokenizer has one.
    :raises ValueError: ``chat`` is True but the tokenizer has no chat template.
    """
    if chat is None:
        chat = bool(getattr(tokenizer, "has_chat_template", False))
    if not chat:
        return list(tokenizer.encode(text))
    if not getattr(tokenizer, "has_chat_template", False):
        raise ValueError("--chat: this model's tokenizer has no chat template (use --no-chat)")
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def prefill(model, cache: list, ids: list[int], step: int = PREFILL_STEP, label: str = "") -> float:
    """Run ``ids`` through the model into ``cache`` in chunks of ``step`` tokens (:func:`kvq.cache.prompt.
    prefill_prompt`), freeing MLX's buffer cache after each; returns the seconds it took. A progress bar (standard
    error, terminals only) shows the tokens done."""
    from tqdm import tqdm

    from ..cache.prompt import prefill_prompt

    start = time.perf_counter()
    with tqdm(total=len(ids), unit="tok", desc=f"prefill {label}".strip(), leave=False, disable=None) as bar:
        prefill_prompt(model, cache, ids, step=step, on_chunk=bar.update)
    return time.perf_counter() - start


def run_cache(model, tokenizer, ids: list[int], options: dict, max_tokens: int, *, record: bool = False,
              reference: Run | None = None, on_text: Callable[[str], None] | None = None,
              sampling: dict | None = None) -> Run:
    """Generate from ``ids`` with a fresh cache (greedily unless ``sampling`` says otherwise), measuring
    speed and bytes.

    The prompt except its last token is prefilled here (timed); ``mlx_lm.stream_generate`` then runs on the last
    token, as ``generate_step`` itself would. With ``reference``, a copy of the prefilled cache first replays the
    reference's tokens (:func:`kvq.quality.compare_to_reference`); the copy is freed before bytes are measured.

    :param options: ``kvq.make_prompt_cache`` keyword arguments (``method=``, ``bits=``, ``sinks=`` ...), or
        :data:`REFERENCE` for mlx-lm's own caches.
    :param record: keep every generated token's log-probabilities (for use as a reference).
    :param on_text: called with each new piece of text as it is generated.
    :param sampling: ``{"temp": float, "top_p": float, "seed": int}`` for ``mlx_lm.sample_utils.make_sampler``
        (the seed is set before generating, so runs with the same seed draw alike); ``None``: greedy.
    :return: :class:`Run`.
    :raises ValueError: bad method or parameters, or a head_dim the method does not support.
    """
    import mlx_lm

    cache, label = _make_cache(model, options)
    before = quality.settle()
    prefill_seconds = prefill(model, cache, ids[:-1], label=label)
    comparison = None
    if reference is not None:
        forced = copy.deepcopy(cache)
        comparison = quality.compare_to_reference(model, forced, ids[-1], reference.tokens, reference.logprobs)
        del forced
    tokens, pieces, logprobs = [], [], []
    extra = {}
    if sampling and sampling.get("temp", 0.0) > 0:
        from mlx_lm.sample_utils import make_sampler

        mx.random.seed(sampling.get("seed", 0))
        extra["sampler"] = make_sampler(temp=sampling["temp"], top_p=sampling.get("top_p", 0.0))
    for response in mlx_lm.stream_generate(model, tokenizer, mx.array(ids[-1:]), max_tokens=max_tokens,
                                           prompt_cache=cache, **extra):
        tokens.append(response.token)
        pieces.append(response.text)
        if record:
            logprobs.append(np.array(response.logprobs.astype(mx.float32)))
        if on_text is not None:
            on_text(response.text)
        first_token_seconds, generation_tps = 1 / response.prompt_tps, response.generation_tps
    del response
    measured = quality.settle() - before
    return Run(label, options, tokens, "".join(pieces), len(ids), len(ids) / (prefill_seconds + first_token_seconds),
               generation_tps, tokens_held(cache), quality.cache_nbytes(cache), measured, logprobs, comparison,
               _most_compressed(cache), _schedule(cache), _least_flush(cache))


def _make_cache(model, options: dict) -> tuple[list, str]:
    """The caches of ``options`` and their label: mlx-lm's own for :data:`REFERENCE` (``"kvcache (float32)"``),
    else kvq's (this rank's under mlx.launch)."""
    from ..cache import make_prompt_cache
    from ..cache.patch import mlx_lm_caches
    from ..evaluation.spec import model_dtype, reference_label

    if options == REFERENCE:
        return mlx_lm_caches(model), reference_label(model_dtype(model))
    return make_prompt_cache(model, **options), cache_label(options)


def tokens_held(cache: list) -> int:
    """Tokens of the sequence the caches hold: the most any layer holds (a sliding-window layer, often layer 0 as
    in Gemma 3, holds only its window)."""
    return max(layer.size() for layer in cache)


def filled_reference_bytes(model, num_tokens: int) -> tuple[int, int]:
    """``(nbytes, measured)`` of the reference caches filled with ``num_tokens`` zeros in the model's dtype (sizes
    do not depend on the values), as a run fills them: the prompt but its last token in chunks of
    :data:`PREFILL_STEP`, then one token (a sliding-window layer trims to its window at that single-token update;
    filled in one update it would hold every token)."""
    from ..evaluation.spec import model_dtype

    kv_heads, key_dim, value_dim = quality.kv_layout(model)
    cache, _ = _make_cache(model, REFERENCE)
    dtype = model_dtype(model)
    chunks = [min(PREFILL_STEP, num_tokens - 1 - start) for start in range(0, num_tokens - 1, PREFILL_STEP)] + [1]
    before = quality.settle()
    for layer in cache:
        for n in chunks:
            layer.update_and_fetch(mx.zeros((1, kv_heads, n, key_dim), dtype),
                                   mx.zeros((1, kv_heads, n, value_dim), dtype))
            mx.eval(layer.state)
    return quality.cache_nbytes(cache), quality.settle() - before


def reference_bytes(model, run: Run, reference: Run | None) -> tuple[int, int, str]:
    """``(nbytes, measured, note)`` of the reference caches holding as many tokens as ``run``'s cache.

    The reference run's own bytes when it holds that many tokens; otherwise the reference caches filled with zeros
    to that length (:func:`filled_reference_bytes`), which the note says.
    """
    if reference is not None and reference.cached_tokens == run.cached_tokens:
        return reference.nbytes, reference.measured, ""
    nbytes, measured = filled_reference_bytes(model, run.cached_tokens)
    why = "" if reference is None else (f"; the reference run stopped at {reference.cached_tokens} tokens, and "
                                        f"its answer and speeds are its own")
    return nbytes, measured, (f"kvcache bytes: of mlx-lm's KVCache holding this run's {run.cached_tokens} tokens "
                              f"(filled with zeros{why})")


def _most_compressed(cache: list) -> int | None:
    """Tokens held compressed by the layer that holds the most (a sliding-window layer, often layer 0, may hold
    none while the full-attention layers compress); ``None`` without kvq caches."""
    counts = [c.compressed_keys.length for c in cache if hasattr(c, "compressed_keys")]
    return max(counts) if counts else None


def _first_config(cache: list):
    """The :class:`~kvq.cache.CacheConfig` of the first full-attention kvq cache (else of the first kvq cache);
    ``None`` without kvq caches. A sliding-window layer's (:class:`~kvq.cache.RotatingKVQCache`: gemma-3's layer 0)
    has the model's ``keep`` for sinks (0) and a window capped by its size, not what ``--sinks``/``--window`` set."""
    from ..cache import RotatingKVQCache

    kvq_caches = [c for c in cache if hasattr(c, "config")]
    full = [c for c in kvq_caches if not isinstance(c, RotatingKVQCache)]
    return next((c.config for c in full or kvq_caches), None)


def _schedule(cache: list) -> tuple[int, int, int] | None:
    """:func:`_first_config`'s ``(sinks, window, flush_tokens)``; ``None`` without kvq caches."""
    config = _first_config(cache)
    return None if config is None else (config.sinks, config.window, config.flush_tokens)


def _least_flush(cache: list) -> int | None:
    """:func:`_first_config`'s flush with ``flush=1`` (:attr:`kvq.cache.CacheConfig.flush_tokens`: the least
    common multiple of its methods' blocks); ``None`` without kvq caches."""
    config = _first_config(cache)
    return None if config is None else attrs.evolve(config, flush=1).flush_tokens


def megabytes(n: int) -> str:
    """``"12.35 MB"`` (10^6 bytes)."""
    return f"{n / 1e6:.2f} MB"


def summary_rows(model, run: Run, reference: Run | None) -> tuple[list[list[str]], list[str]]:
    """Table rows (label, reference, method) comparing ``run`` with the reference (mlx-lm's KVCache), and
    footnotes."""
    from ..cache.schedule import first_flush, most_held
    from ..evaluation.spec import model_dtype, reference_label

    ref_nbytes, ref_measured, note = reference_bytes(model, run, reference)
    kb, vb = bits_per_coordinate(run.options, model)
    width = model_dtype(model).size * 8
    dash = "-"
    sinks, window, flush = run.schedule or tuple(
        run.options.get(k, d) for k, d in (("sinks", 4), ("window", 128), ("flush", DEFAULT_FLUSH)))
    held = first_flush(sinks, window, flush) - 1  # the most tokens held before the first flush
    nothing = run.compressed_tokens == 0 if run.compressed_tokens is not None else run.cached_tokens <= held
    nothing = nothing and run.options.get("method") != "fp16"
    unmeant = " (none compressed)" if nothing else ""  # a ratio of allocations, not of compression (NOTE below)
    rows = [
        ["cache", reference_label(model_dtype(model)), run.label],
        ["bits/coordinate (K / V)", f"{width} / {width}", f"{kb:.2f} / {vb:.2f}"],
        ["prompt tokens/s", dash if reference is None else f"{reference.prompt_tps:.1f}", f"{run.prompt_tps:.1f}"],
        ["generation tokens/s", dash if reference is None else f"{reference.generation_tps:.1f}",
         f"{run.generation_tps:.1f}"],
        ["tokens in cache", str(reference.cached_tokens if reference and not note else run.cached_tokens),
         str(run.cached_tokens) + ("" if run.compressed_tokens is None or run.options.get("method") == "fp16"
                                   else f" ({run.compressed_tokens} compressed)")],
        ["KV bytes (nbytes)", megabytes(ref_nbytes), megabytes(run.nbytes)],
        ["KV bytes (measured)", megabytes(ref_measured), megabytes(run.measured)],
        ["compression vs kvcache (nbytes)", "1.00x", f"{ref_nbytes / run.nbytes:.2f}x{unmeant}"],
        ["compression vs kvcache (measured)", "1.00x", f"{ref_measured / max(run.measured, 1):.2f}x{unmeant}"],
    ]
    if reference is not None and run.comparison is not None:
        c = run.comparison
        rows += [["top-1 agreement (kvcache tokens)", dash, f"{c.agreement}/{len(c)}"],
                 ["mean KL(kvcache || method)", dash, f"{max(c.mean_kl, 0.0):.4f} nats"],  # -0.0000: rounding
                 ["identical prefix of the outputs", dash,
                  f"{quality.common_prefix(reference.tokens, run.tokens)}/{len(reference.tokens)} tokens"]]
    notes = [note] if note else []
    if nothing:
        notes.append(f"NOTE: nothing was compressed: all {run.cached_tokens} tokens fit in the uncompressed sinks "
                     f"({sinks}) and window ({window}, growing to {most_held(window, flush)} before a flush of "
                     f"{flush}); "
                     "the bytes differ only by allocation and storage. Use a longer prompt, or --sinks 0 --window 0 "
                     "--flush 1" + (f" with a prompt of at least {run.least_flush} tokens (this cache compresses "
                                    f"whole blocks of {run.least_flush})." if (run.least_flush or 1) > 1 else "."))
    notes.append("measured: growth of mx.get_active_memory from the empty cache to the filled one (it also counts "
                 "constants a method allocates once, such as rotations and codebooks)")
    return rows, notes


def run_and_report(model, tokenizer, ids: list[int], options: dict, max_tokens: int, reference,
                   sampling: dict | None = None) -> None:
    """Generate with the cache ``options`` (streaming the text), then print the summary table against
    ``reference`` (the reference run, or None) and its notes. Shared by ``kvq generate`` and ``kvq demo``."""
    run = run_cache(model, tokenizer, ids, options, max_tokens, reference=reference, on_text=stream_to_stdout,
                    sampling=sampling)
    rows, notes = summary_rows(model, run, reference)
    print("\n\n" + render_table(rows))
    print("\n".join(notes))


def render_table(rows: list[list[str]]) -> str:
    """Plain-text table; the first row is the header, underlined."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def stream_to_stdout(text: str) -> None:
    """Print a piece of generated text at once."""
    print(text, end="", flush=True)


def add_cache_arguments(p: argparse.ArgumentParser) -> None:
    """The model and cache options shared by ``kvq generate`` and ``kvq serve`` (read by :func:`cache_options`)."""
    p.add_argument("--model", default=None, help="mlx-lm folder, .gguf file or Hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--method", default="affine",
                   help="method for keys and values (see 'kvq list'; default affine), or a kvq eval method string "
                        "such as turboquant:4, affine:k8v4, qjl+affine:4. fp16 here is kvq's 16-bit cache (kvq-fp16 "
                        "in kvq eval's strings, where fp16 names the reference, kvcache, that --compare takes)")
    p.add_argument("--bits", type=_bits, default=None,
                   help="shorthand for --param bits=B; a number with a fraction (3.5) is a bits budget per layer "
                        "(turboquant)")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE", help="method parameter, repeatable")
    p.add_argument("--key-method", default=None, help="method for the keys only (e.g. qjl)")
    p.add_argument("--value-method", default=None, help="method for the values only")
    p.add_argument("--key-param", action="append", default=[], metavar="NAME=VALUE", help="keys' parameter")
    p.add_argument("--value-param", action="append", default=[], metavar="NAME=VALUE", help="values' parameter")
    # defaults None: cache_options tells them from values given (a method string's own may not be contradicted)
    p.add_argument("--sinks", type=int, default=None,
                   help=f"first tokens kept uncompressed (default {DEFAULT_SINKS}; a sliding-window layer keeps the "
                        "model's own, mlx-lm's keep: 0 for gemma-3's)")
    p.add_argument("--window", type=int, default=None,
                   help=f"recent tokens kept uncompressed (default {DEFAULT_WINDOW})")
    p.add_argument("--flush", type=int, default=None, metavar="N",
                   help=f"tokens leave the window in blocks of N (default {DEFAULT_FLUSH}): a decode step is then an "
                        "append, and quantizing runs once every N steps; 1 compresses every step")
    p.add_argument("--kernels", choices=KERNELS, default="auto",
                   help="fused GPU kernels: auto (where available and faster; default), require (fail if none "
                        "serves decode attention on this device), off (pure MLX only)")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvq generate`` argument parser."""
    p = argparse.ArgumentParser(prog="kvq generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cache_arguments(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", default=None, help="the prompt text")
    source.add_argument("--prompt-file", default=None, help="read the prompt from a file ('-': standard input)")
    p.add_argument("--max-tokens", type=int, default=100, help="most tokens to generate (default 100)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling threshold (default 0: off)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (the same for every cache)")
    p.add_argument("--compare", choices=["kvcache", "fp16"], default=None,
                   help="also generate with the reference, mlx-lm's KVCache in the model's dtype (fp16: its older "
                        "name); report agreement and KL(kvcache || method)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the chat template (default: when the tokenizer has one)")
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: pipeline parallel (each rank its own layers), not tensor parallel")
    return p


def main(argv: list[str]) -> int:
    """Run ``kvq generate``; returns 0.

    :raises ValueError: unknown model or method, bad parameters, a head_dim the method does not support, an
        unreadable or empty prompt (the dispatcher prints it as one line and exits 1).
    :raises TypeError: an unknown parameter name.
    """
    from .. import distributed
    from ..cache import make_config, make_prompt_cache
    from ..evaluation.spec import model_dtype, reference_label

    args = build_parser().parse_args(argv)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1; got {args.max_tokens}")
    options = cache_options(args)
    make_config(**options)  # bad methods and parameters fail before the model is loaded
    if args.temp < 0 or not 0 <= args.top_p <= 1:
        raise ValueError(f"--temp must be >= 0 and --top-p in [0, 1]; got {args.temp} and {args.top_p}")
    sampling = {"temp": args.temp, "top_p": args.top_p, "seed": args.seed}
    text = read_prompt(args)
    model, tokenizer = distributed.load(args.model, pipeline=args.pipeline)  # this rank's shard under mlx.launch
    ids = prompt_ids(tokenizer, text, args.chat)
    make_prompt_cache(model, **options)  # an unsupported head_dim or KV-head split fails before output
    with distributed.rank0_stdout():  # every rank computes, rank 0 prints
        reference = None
        if args.compare:
            print(f"--- {reference_label(model_dtype(model))} ---", flush=True)
            reference = run_cache(model, tokenizer, ids, REFERENCE, args.max_tokens, record=True,
                                  on_text=stream_to_stdout, sampling=sampling)
            print()
        print(f"--- {cache_label(options)} ---", flush=True)
        run_and_report(model, tokenizer, ids, options, args.max_tokens, reference, sampling)
    return 0
