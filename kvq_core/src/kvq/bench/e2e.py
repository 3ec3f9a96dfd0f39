"""``kvq bench e2e``: decode speed and memory of whole-model generation against context length, per cache.

For each context length and each method string (:mod:`kvq.evaluation.spec`; ``kvcache``, the reference, is
mlx-lm's own ``KVCache`` in the model's dtype (``fp16`` is its older name), ``mlx-affine:N`` its
``QuantizedKVCache``, ``kvq-fp16`` kvq's 16-bit store), in one process:

1. fill: every layer's cache is brought to ``context`` tokens, in one of three ways (:data:`FILLS`):
   ``random`` calls ``cache.update_and_fetch`` with random normal keys and values in chunks (prefill memory stays
   small; speed does not depend on the values), ``replay`` does the same with the keys and values of one real
   prefill of the text (mlx-lm's KVCache, once per context), ``prefill`` runs the model over the text with the
   method's own cache (chunks of :data:`kvq.bench.fill.PREFILL_CHUNK`; prefill tokens/s are reported);
2. memory: the caches' ``nbytes`` and the growth of ``mx.get_active_memory()`` from before the caches existed;
3. decode: greedy steps (the argmax token fed back), pipelined like mlx-lm's ``generate_step`` (the next step
   is queued with ``mx.async_eval`` while this one runs): ``warmup`` untimed, then ``steps`` timed; mean, median,
   p10 and p90 milliseconds per token, tokens/s (1 / mean: a kvq cache compresses its window once every ``flush``
   steps, and those steps count; ``steps`` a multiple of ``flush`` times whole periods), and the peak of
   ``mx.get_peak_memory()`` over the
   decode.

With ``rounds`` > 1 (``--rounds``) the caches of one context take turns instead: every cache is filled first
and all are held at once, then each decodes ``steps`` timed steps per round, in the order of the methods in odd
rounds and the reverse order in even ones, for ``rounds`` rounds; a row's latencies are all its rounds' steps. On a
shared GPU machine the host's and the device's speed drift over minutes (fp16's own median at 32K came out 5.35
and 6.11 ms in two runs of one H200 sitting), so one-after-the-other rows compare a method with fp16 measured
minutes apart; interleaved rounds give every cache the same slow and fast periods.

A row whose method fails (an MLX back end without an implementation for a shape, out of memory) records the
error and the run goes on.
"""

from __future__ import annotations

import time
from typing import Callable

import attrs
import mlx.core as mx
from tqdm import tqdm

from ..defaults import DEFAULT_FLUSH, DEFAULT_SINKS, DEFAULT_WINDOW
from ..evaluation.spec import (MethodSpec, bits_per_coordinate, checked_with_reference, model_dtype, parse_method,
                               split_methods)
from ..cache.prompt import prefill_prompt
from .fill import PREFILL_CHUNK, RandomKV, ReplayKV, decode, fill, host_summary, latency_summary
from .measure import error_text, release
from .rows import REFERENCE

#: How caches are brought to the context length.
FILLS = ("random", "replay", "prefill")
#: Method strings measured when ``--methods`` is not given (those whose methods are installed).
DEFAULT_METHODS = (REFERENCE, "mlx-affine:4", "mlx-affine:8", "affine:4", "turboquant:4", "turboquant:k4v3",
                   "turboquant:3", "turboquant_prod:4", "qjl+turboquant:4")
#: Bits of the uncompressed sinks and window of a kvq cache (kept in 16 bits even for float32 models).
DENSE_BITS = 16


@attrs.frozen
class E2ESettings:
    """What one ``kvq bench e2e`` run measures.

    :param contexts: context lengths in tokens (each > 0), measured in this order.
    :param steps: timed decode steps per row (>= 1); :param warmup: untimed steps before them (>= 0; the CLI's
        default on a GPU, ``flush + 1``, leaves the first window flush, when quantize kernels compile for the
        block shape, untimed).
    :param chunk: tokens per ``update_and_fetch`` call when filling (``random``/``replay``).
    :param fill: one of :data:`FILLS`.
    :param sinks, window: kvq caches' uncompressed first and last tokens (a method string may override them).
    :param kernels: kvq caches' kernel preference: ``"auto"``, ``"require"`` or ``"off"``.
    :param flush: kvq caches' window flush block (:data:`kvq.cache.DEFAULT_FLUSH`, as ``kvq generate``).
    :param seed: seed of the random keys and values.
    :param progress: show a tqdm bar on stderr.
    :param batch: sequences decoded together (>= 1; above 1 only with the ``random`` fill): every cache holds
        ``batch`` rows of ``context`` tokens (different random keys and values per row) and each step decodes one
        token per row, so tokens/s counts ``batch`` tokens per step (the aggregate a server sees).
    :param rounds: 1 (default): each cache is filled, decoded and freed before the next; above 1: the caches of a
        context are held at once and decode ``steps`` timed steps each per round, taking turns (see the module's
        docstring); the first round of a cache has ``warmup`` untimed steps, later rounds 1 (the step that starts
        the pipeline again). ``steps`` should then be a multiple of every kvq cache's flush, so each round times
        the same number of flushes.
    """

    contexts: tuple[int, ...]
    steps: int = 32
    warmup: int = 1
    chunk: int = 4096
    fill: str = attrs.field(default="random", validator=attrs.validators.in_(FILLS))
    sinks: int = DEFAULT_SINKS
    window: int = DEFAULT_WINDOW
    kernels: str = "auto"
    seed: int = 0
    progress: bool = True
    flush: int = DEFAULT_FLUSH
    batch: int = 1
    rounds: int = 1

    def __attrs_post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"--batch must be >= 1; got {self.batch}")
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1; got {self.rounds}")
        if self.batch > 1 and self.fill != "random":
            raise ValueError(f"--batch {self.batch} needs --fill random (replay and prefill fill one sequence); "
                             f"got --fill {self.fill}")


def parse_methods(text: str | None, head_dim: int | None = None, sinks: int = DEFAULT_SINKS,
                  window: int = DEFAULT_WINDOW, installed: set[str] | None = None,
                  defaults: tuple[str, ...] = DEFAULT_METHODS) -> list[MethodSpec]:
    """``--methods`` (``None``: the installed ``defaults``), validated; the reference first, added if missing.

    :param installed: installed method names (for the defaults; default: the registry's).
    :param defaults: the method strings measured without ``--methods`` (default :data:`DEFAULT_METHODS`).
    :raises ValueError: a string that does not parse, an unknown method or parameter, a head_dim a method
        rejects, a duplicate (the message names the method string).
    """
    if text is None:
        from ..plugins import registry

        installed = set(registry().methods) if installed is None else installed
        text = ",".join(m for m in defaults if _names(m) <= installed | {"mlx-affine"})
    specs = [parse_method(part) for part in split_methods(text)]
    return checked_with_reference(specs, head_dim, sinks, window, REFERENCE)


def _names(text: str) -> set[str]:
    return {side.split(":")[0].split("[")[0] for side in text.split("+")} - {REFERENCE}


def cache_kind(spec: MethodSpec) -> str:
    """``"mlx-lm KVCache"``, ``"mlx-lm QuantizedKVCache"`` or ``"kvq KVQCache"``."""
    if spec.label == REFERENCE:
        return "mlx-lm KVCache"
    return "mlx-lm QuantizedKVCache" if spec.is_mlx else "kvq KVQCache"


def make_cache(model, spec: MethodSpec, settings: E2ESettings) -> list:
    """One cache per layer of ``model`` for ``spec`` (see :func:`cache_kind`). The reference gets the caches
    mlx-lm makes for the model (``KVCache``; ``RotatingKVCache`` on sliding-window layers, which mlx-lm bounds);
    mlx-affine a ``QuantizedKVCache`` where that is a ``KVCache`` and mlx-lm's own cache elsewhere (mlx-lm cannot
    quantize a ``RotatingKVCache``)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from ..cache.patch import mlx_lm_caches

    if spec.label == REFERENCE:
        return mlx_lm_caches(model)
    if spec.is_mlx:
        bits, group_size = spec.mlx_settings()
        return [QuantizedKVCache(group_size=group_size, bits=bits) if type(c) is KVCache else c
                for c in mlx_lm_caches(model)]
    from ..cache import make_prompt_cache

    return make_prompt_cache(model, **spec.cache_kwargs(settings.sinks, settings.window, settings.flush),
                             kernels=settings.kernels)


def bits(spec: MethodSpec, head_dim: int, dtype: mx.Dtype) -> tuple[float, float]:
    """``(keys, values)`` bits per coordinate of compressed tokens: the dtype's width for mlx-lm's KVCache,
    ``bits + 2 * width / group_size`` for its QuantizedKVCache (scales and biases in the model's dtype), the
    methods' accounting for kvq caches (sinks and window excluded)."""
    width = dtype.size * 8
    if spec.label == REFERENCE:
        return float(width), float(width)
    if spec.is_mlx:
        b, group_size = spec.mlx_settings()
        return (b + 2 * width / group_size,) * 2
    return bits_per_coordinate(spec, head_dim)


def attend_implementation(cache, model, settings: E2ESettings) -> str | None:
    """``"turboquant:mlx"``: the implementation that serves one-token decode attention over the compressed
    tokens of a kvq cache (as :func:`kvq.cache.choice.attend_fn` selects it), or ``None`` for other caches."""
    from ..cache.choice import attend_kernels, own_attend

    config = getattr(cache, "config", None)
    if config is None or not hasattr(cache, "compressed_keys"):
        return None
    kp, vp = config.key_params, config.value_params
    if not own_attend(config):
        return f"{kp.method}+{vp.method}:mlx (block protocol)"
    label = kp.method if kp.method == vp.method else f"{kp.method}+{vp.method}"
    from ..selection import select

    args = model.args
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    shape = (1, args.num_key_value_heads, max(cache.compressed_keys.length, 1), head_dim)
    try:
        plan = select(kp.method, shape, dtype=model_dtype(model), op="attend", params=kp, num_queries=1,
                      num_q_heads=args.num_attention_heads, kernels=attend_kernels(settings.kernels, 1))
    except ValueError as exc:  # the row is still measured; only this label is unknown
        return f"unknown ({exc})"
    choice = plan.choices.get("attend")
    return None if choice is None else f"{label}:{choice.backend}"


class E2EBench:
    """Measures rows (one per context and method string) on one model.

    :param model: an mlx-lm llama-family model (``model.layers[i].self_attn``, ``model.args``).
    :param settings: :class:`E2ESettings`.
    :param text_ids: token ids of a text, at least ``max(contexts) + 1`` long (the ``replay`` and ``prefill``
        fills, and the first decode token); ``None`` for ``random``.
    :raises ValueError: a fill that needs ``text_ids`` without them, or too few of them.
    """

    def __init__(self, model, settings: E2ESettings, text_ids: list[int] | None = None) -> None:
        self.model, self.settings = model, settings
        args = model.args
        self.head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
        self.kv_heads, self.dtype = args.num_key_value_heads, model_dtype(model)
        if settings.fill != "random" and (text_ids is None or len(text_ids) <= max(settings.contexts)):
            raise ValueError(f"fill {settings.fill!r} needs a text of more than {max(settings.contexts)} tokens")
        self.text = None if text_ids is None else mx.array(text_ids)

    def run(self, specs: list[MethodSpec], on_row: Callable[[dict], None] | None = None) -> list[dict]:
        """Every context (in settings order) times every spec (the reference first); ``on_row(row)`` after each row (with
        ``rounds`` > 1, after the last round of the context)."""
        s, rows = self.settings, []
        bar = tqdm(total=len(s.contexts) * len(specs), desc="kvq bench e2e", unit="row",
                   disable=not s.progress, dynamic_ncols=True)
        with bar:
            for context in s.contexts:
                bar.set_postfix_str(f"{context} tokens: {s.fill} source")
                source, info = self._source(context)
                measured = (self._measure_interleaved(specs, context, source, bar) if s.rounds > 1 else
                            (self._measure(spec, context, source, bar) for spec in specs))
                reference = None
                for spec, row in zip(specs, measured):
                    row.update(info)
                    reference = reference or (row if spec.label == REFERENCE and not row["error"] else None)
                    add_ratios(row, reference)
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
                    bar.update(1)
                del source
                release()
        return rows

    def _source(self, context: int):
        s = self.settings
        if s.fill == "random":
            return RandomKV(self.kv_heads, self.head_dim, self.dtype, s.seed, s.batch), {}
        if s.fill == "prefill":
            return None, {}
        tic = time.perf_counter()
        source = ReplayKV(self.model, self.text[:context])
        return source, {"replay_prefill_seconds": time.perf_counter() - tic}

    def _measure(self, spec: MethodSpec, context: int, source, bar) -> dict:
        bar.set_postfix_str(f"{context} tokens: {spec.label}")
        row = self._describe(spec, context)
        try:
            caches, filled, before = self._fill(spec, context, source)
            row.update(filled)
            bar.set_postfix_str(f"{context} tokens: {spec.label} decode")
            mx.reset_peak_memory()
            host, build, s = [], [], self.settings
            seconds, untimed = decode(self.model, caches, self._first(context), s.steps, s.warmup, host, s.batch,
                                      build)
            peak = mx.get_peak_memory()
            row.update(self._decoded(caches, seconds, untimed, host, build, peak, peak - before))
        except Exception as exc:  # noqa: BLE001 - one failing method must not end the run: the row says why
            row["error"] = error_text(exc)
            bar.write(f"kvq bench e2e: {spec.label} at {context} tokens failed: {row['error']}")
        release()
        return row

    def _measure_interleaved(self, specs, context: int, source, bar) -> list[dict]:
        """Every spec's row at ``context`` with ``rounds`` > 1: all caches filled and held, then decoded in turns
        (the module's docstring). A cache's decode peak is its rounds' highest ``mx.get_peak_memory()`` less what
        else was resident at the start of that round (the model and the other caches: the active memory then, less
        this cache's growth at its fill), so it reads as in one-after-the-other rows."""
        s = self.settings
        rows, live = [], []
        for spec in specs:
            bar.set_postfix_str(f"{context} tokens: {spec.label} fill")
            row = self._describe(spec, context)
            try:
                caches, filled, _ = self._fill(spec, context, source)
                row.update(filled)
                live.append((row, caches, {"seconds": [], "untimed": [], "host": [], "build": [], "peak": 0,
                                           "growth": 0}))
            except Exception as exc:  # noqa: BLE001 - the row says why; the others are measured
                row["error"] = error_text(exc)
                bar.write(f"kvq bench e2e: {spec.label} at {context} tokens failed: {row['error']}")
                release()
            rows.append(row)
        for turn in range(s.rounds):
            for row, caches, acc in (live if turn % 2 == 0 else live[::-1]):
                if row["error"]:
                    continue
                bar.set_postfix_str(f"{context} tokens: {row['method']} round {turn + 1}/{s.rounds}")
                try:
                    others = mx.get_active_memory() - row["active_memory_growth"]
                    mx.reset_peak_memory()
                    seconds, untimed = decode(self.model, caches, self._first(context), s.steps,
                                              s.warmup if turn == 0 else 1, acc["host"], s.batch, acc["build"])
                    peak = mx.get_peak_memory()
                    acc["seconds"] += seconds
                    acc["untimed"] += untimed
                    if peak - others > acc["growth"]:
                        acc["peak"], acc["growth"] = peak, peak - others
                except Exception as exc:  # noqa: BLE001 - as in one-after-the-other rows
                    row["error"] = error_text(exc)
                    caches.clear()  # its memory goes; the other caches go on
                    bar.write(f"kvq bench e2e: {row['method']} at {context} tokens failed: {row['error']}")
                    release()
        for row, caches, acc in live:
            if not row["error"]:
                row.update(self._decoded(caches, acc["seconds"], acc["untimed"], acc["host"], acc["build"],
                                         acc["peak"], acc["growth"]))
            caches.clear()
        del live
        release()
        return rows

    def _first(self, context: int) -> int:
        """The token the decode starts from: the text's next token, or 1 for random fills."""
        return int(self.text[context]) if self.text is not None else 1

    def _fill(self, spec, context, source) -> tuple[list, dict, int]:
        """``(caches, fields, before)``: ``spec``'s caches brought to ``context`` tokens, the row's fill and memory
        fields, and the active memory (bytes) before the caches were made."""
        s = self.settings
        release()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        tic = time.perf_counter()
        caches = make_cache(self.model, spec, s)
        if source is None:
            prefill_prompt(self.model, caches, self.text[:context], step=PREFILL_CHUNK)
        else:
            fill(caches, source, context, s.chunk)
        fill_seconds = time.perf_counter() - tic
        memory = {"kv_bytes": sum(c.nbytes for c in caches), "active_memory_growth": mx.get_active_memory() - before,
                  "fill_peak_memory_growth": mx.get_peak_memory() - before}
        stored = 2 * len(caches) * s.batch * self.kv_heads * context * self.head_dim
        return caches, {"fill_seconds": fill_seconds,
                        **({"prefill_tokens_per_second": context / fill_seconds} if source is None else {}),
                        **memory, "resident_bits_per_coordinate": 8 * memory["kv_bytes"] / stored}, before

    def _decoded(self, caches, seconds, untimed, host, build, peak, growth) -> dict:
        """A row's decode fields from its timed steps ``seconds``, untimed ones, host times (whole, and the build
        before ``mx.async_eval``: :func:`kvq.bench.fill.decode`) and decode peak."""
        s = self.settings
        return {"peak_memory": peak, "peak_memory_growth": growth,
                "attend_implementation": attend_implementation(caches[0], self.model, s),
                **latency_summary(seconds, s.batch), "host_ms": host_summary(host),
                "build_ms": host_summary(build),
                "warmup_ms": [round(t * 1e3, 4) for t in untimed], "error": None}

    def _describe(self, spec: MethodSpec, context: int) -> dict:
        s = self.settings
        sinks, window = spec.sinks_window(s.sinks, s.window)
        if spec.label == REFERENCE:
            sinks = window = 0
        key_bits, value_bits = bits(spec, self.head_dim, self.dtype)
        mean = (key_bits + value_bits) / 2
        dense = min(sinks + window, context)
        return {"context": context, "batch": s.batch, "method": spec.label, "cache": cache_kind(spec),
                "key_method": spec.key_method, "value_method": spec.value_method,
                "key_params": spec.key_params, "value_params": spec.value_params, "sinks": sinks, "window": window,
                "kv_dtype": str(self.dtype).removeprefix("mlx.core."), "bits_per_coordinate": mean,
                "key_bits_per_coordinate": key_bits, "value_bits_per_coordinate": value_bits,
                "effective_bits_per_coordinate": ((context - dense) * mean + dense * DENSE_BITS) / context,
                "error": None}


def add_ratios(row: dict, reference: dict | None) -> None:
    """Add ``kv_bytes_ratio``, ``memory_ratio`` and ``speed_vs_fp16`` (method / fp16 at the same context;
    ``None`` when either row failed)."""
    ok = reference is not None and not row["error"]
    row["kv_bytes_ratio"] = row["kv_bytes"] / reference["kv_bytes"] if ok else None
    row["memory_ratio"] = row["active_memory_growth"] / max(reference["active_memory_growth"], 1) if ok else None
    row["speed_vs_fp16"] = row["tokens_per_second"] / reference["tokens_per_second"] if ok else None
