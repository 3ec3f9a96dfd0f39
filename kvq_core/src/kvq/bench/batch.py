"""Batched generation through mlx-lm's ``BatchGenerator`` (the path of ``mlx_lm.server`` and ``kvq serve``), per
cache: the measuring part of ``kvq bench batch`` (#22).

Each row inserts ``batch`` prompts of ``prompt`` random tokens into one ``BatchGenerator`` (greedy, no stop token,
``tokens`` new tokens each) and runs it to the end, as a server does under concurrent load: prefill of the prompts in
chunks, then batched decode with the generator's cache merges, filters and extracts. kvcache is mlx-lm's own caches
(the model unpatched); a kvq method patches the model (:func:`kvq.patch_model`), so the generator makes kvq caches
and batches them as :class:`kvq.cache.BatchKVQCache`. Reported: the seconds until every sequence has its first token
(prefill), the aggregate decode tokens/s after that (every sequence's tokens, over the time from the last first
token to the end), the decode steps' milliseconds (step ms: the decode seconds over the generator's decode steps;
host ms: each step's time on the host before its work is queued, and build ms its part before the queueing, below),
the caches' bytes after the middle decode step and the ceiling a step bound by memory bandwidth could reach over
kvcache (:func:`add_ratios`), the peak memory above the level before the
generator was made, and the tokens (identical prompts give the same count for every method: the run is checked to
have produced ``batch * tokens`` of them). Every repetition measures kvcache first, so each ratio compares rows of
one repetition in one process; ``warmup`` untimed repetitions of every row come first (they compile kernels), and
:func:`summarize` gives each (batch, method)'s median and range over the timed ones.

Host ms per step is measured as ``kvq bench e2e`` measures it (:func:`kvq.bench.fill.decode`): from the previous
step's tokens reaching Python to this step's graph being queued (``mx.async_eval`` returning). ``BatchGenerator``
does both inside ``GenerationBatch._step``, so while the generator runs, ``mlx_lm.generate``'s ``mx`` is a stand-in
(:class:`StepClock`) that notes when its ``mx.eval`` (the step's tokens) and ``mx.async_eval`` (the next step
queued) return, and when ``mx.async_eval`` is called; the time in between is the generator's bookkeeping, this
loop's, the model's graph building (build ms: up to the call) and MLX queueing it (on CUDA, encoding its graphs,
which can wait for the device: 32 sequences of 32K on an H100 spent 19 ms of a 23.7 ms step in ``mx.async_eval``
and 4.5 ms building, in ``kvq bench e2e``'s loop). A step whose interval is about its build time was bound by the
host; one about its host time with a short build waited for the device.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from typing import Callable

import attrs
import mlx.core as mx

from ..defaults import DEFAULT_FLUSH, DEFAULT_SINKS, DEFAULT_WINDOW
from ..evaluation.spec import MethodSpec
from .fill import host_summary
from .measure import error_text, release
from .output import uncompressed_note
from .rows import REFERENCE, repeated_rows, spread

#: Method strings measured when ``--methods`` is not given (those whose methods are installed).
DEFAULT_METHODS = ("kvcache", "affine:4", "turboquant:4", "turboquant:3")


@attrs.frozen
class BatchSettings:
    """What one ``kvq bench batch`` run measures.

    :param batches: sequences generated together (each >= 1), measured in this order.
    :param prompt: tokens of each (random) prompt (>= 1); with ``shortest``, of the longest.
    :param shortest: ``None`` (every prompt ``prompt`` tokens), or the shortest prompt's tokens (1 .. ``prompt``):
        a batch's prompts then have lengths evenly spaced from ``prompt`` down to it, as a server's requests differ
        (right-padded by the generator; kvq's rows store only their own tokens).
    :param tokens: new tokens per sequence (>= 2: one comes from the prefill, the rest are decoded).
    :param reps: timed repetitions of every (batch, method) row (>= 1); reports give their median and range.
    :param warmup: untimed repetitions of every row of a batch size before its timed ones (>= 0; they compile the
        kernels, and their rows are not kept).
    :param chunk: the generator's ``prefill_step_size`` (mlx-lm's default 2048).
    :param sinks, window, flush, kernels: kvq caches' settings (:class:`kvq.cache.CacheConfig`).
    :param seed: seed of the random prompts.
    :param progress: show a tqdm bar on stderr.
    """

    batches: tuple[int, ...]
    prompt: int
    tokens: int = 64
    reps: int = 3
    warmup: int = 1
    chunk: int = 2048
    sinks: int = DEFAULT_SINKS
    window: int = DEFAULT_WINDOW
    flush: int = DEFAULT_FLUSH
    kernels: str = "auto"
    seed: int = 0
    shortest: int | None = None
    progress: bool = True


def notes(settings: BatchSettings) -> list[str]:
    """What a reader of the results must know about ``settings``: a run whose sequences never grow past a kvq
    cache's sinks and window compresses nothing (its kvq rows then measure 16-bit caches)."""
    return uncompressed_note(f"prompts of {settings.prompt} tokens + {settings.tokens} new ones",
                             settings.prompt + settings.tokens, settings.sinks, settings.window, settings.flush,
                             "--prompt")


def prompts(batch: int, length: int, vocab_size: int, seed: int, shortest: int | None = None) -> list[list[int]]:
    """``batch`` lists of random token ids (the same for every method of a run): ``length`` each, or with
    ``shortest`` lengths evenly spaced from ``length`` (the first) down to ``shortest`` (the last; rounded)."""
    ids = mx.random.randint(0, vocab_size, (batch, length), key=mx.random.key(seed * 1_000_003 + batch)).tolist()
    if shortest is None or batch == 1:
        return ids
    return [row[: round(length - (length - shortest) * i / (batch - 1))] for i, row in enumerate(ids)]


class StepClock:
    """Stands in for ``mlx.core`` in one module (:func:`clocked`): every attribute is mlx.core's, but it notes when
    that module's ``mx.eval`` returns (a generator step's tokens have reached Python) and, at each ``mx.async_eval``
    after one, the seconds from then until the queueing returned (``host``, one entry per step) and until it was
    called (``build``).

    Only calls made through the module it stands in for are seen: the model's and kvq's own ``mx`` are untouched.
    """

    def __init__(self, real) -> None:
        self._real, self.ready, self.host, self.build = real, None, [], []

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def eval(self, *args) -> None:
        self._real.eval(*args)
        self.ready = time.perf_counter()

    def async_eval(self, *args) -> None:
        called = time.perf_counter()
        self._real.async_eval(*args)
        if self.ready is not None:
            self.build.append(called - self.ready)
            self.host.append(time.perf_counter() - self.ready)
            self.ready = None


@contextlib.contextmanager
def clocked(module_name: str = "mlx_lm.generate"):
    """Put a :class:`StepClock` in place of ``module_name``'s ``mx`` while the block runs (restored after it);
    yields the clock, or ``None`` where that module has no ``mx`` that is mlx.core (host time is then not
    measured)."""
    module = importlib.import_module(module_name)
    if getattr(module, "mx", None) is not mx:
        yield None
        return
    clock = StepClock(mx)
    module.mx = clock
    try:
        yield clock
    finally:
        module.mx = mx


def generate(model, prompts_: list[list[int]], tokens: int, chunk: int) -> dict:
    """Run one ``BatchGenerator`` over ``prompts_`` to the end (greedy, ``tokens`` each) and time it.

    :return: ``{"prefill_seconds", "decode_seconds", "decode_steps", "tokens", "decode_tokens_per_second",
        "step_ms", "host_ms", "build_ms", "cache_bytes", "peak_memory_growth"}``: prefill = from insertion until
        every sequence has its first token, decode = from then to the last token over ``decode_steps`` generator
        steps; decode tokens/s = the tokens after each sequence's first, over the decode seconds; step ms = decode
        milliseconds / decode steps; host ms and build ms = :func:`kvq.bench.fill.host_summary` of the decode steps'
        host times and of their builds (module docstring; every entry ``None`` where they could not be measured);
        cache bytes = the generator's ``prompt_cache_nbytes`` (every layer's cache of every sequence, as allocated)
        after the middle decode step, ``None`` where this mlx-lm has no such property.
    :raises RuntimeError: the generator stopped before ``tokens`` tokens per sequence.
    """
    from mlx_lm.generate import BatchGenerator

    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    with clocked() as clock:
        gen = BatchGenerator(model, stop_tokens=[], sampler=lambda x: mx.argmax(x, -1), prefill_step_size=chunk,
                             completion_batch_size=max(32, len(prompts_)))
        tic = time.perf_counter()
        uids = gen.insert(prompts_, [tokens] * len(prompts_))
        counts = {u: 0 for u in uids}
        first_all, steps, mark, cache_bytes = None, 0, 0, None
        try:
            for _ in range(10 * tokens * len(prompts_) + 100):  # bounded, whatever the generator does
                responses = gen.next_generated()
                if not responses:
                    break
                steps += first_all is not None
                if steps == tokens // 2 and cache_bytes is None:  # mid-decode: one sum over the layers' caches
                    cache_bytes = getattr(gen, "prompt_cache_nbytes", None)
                for r in responses:
                    counts[r.uid] += 1
                if first_all is None and all(counts.values()):
                    first_all, mark = time.perf_counter(), len(clock.host) if clock is not None else 0
        finally:
            gen.close()
        end = time.perf_counter()
    total = sum(counts.values())
    if total != tokens * len(prompts_) or first_all is None:
        raise RuntimeError(f"BatchGenerator gave {total} tokens for {len(prompts_)} sequences of {tokens}")
    decoded = total - len(prompts_)
    decode_seconds = end - first_all
    return {"prefill_seconds": first_all - tic, "decode_seconds": decode_seconds, "decode_steps": steps,
            "tokens": total, "decode_tokens_per_second": decoded / decode_seconds if decode_seconds > 0 else None,
            "step_ms": 1e3 * decode_seconds / steps if steps else None,
            "host_ms": host_summary(clock.host[mark:] if clock is not None else []),
            "build_ms": host_summary(clock.build[mark:] if clock is not None else []),
            "cache_bytes": cache_bytes, "peak_memory_growth": mx.get_peak_memory() - before}


class BatchBench:
    """Measures rows (one per batch size, repetition and method string) on one model.

    :param model: an mlx-lm model (not patched by kvq: each kvq row patches it and unpatches it afterwards).
    :param settings: :class:`BatchSettings`; :param vocab_size: for the random prompts.
    """

    def __init__(self, model, settings: BatchSettings, vocab_size: int) -> None:
        self.model, self.settings, self.vocab_size = model, settings, vocab_size
        self.weights_bytes = weights_bytes(model)

    def run(self, specs: list[MethodSpec], on_row: Callable[[dict], None] | None = None) -> list[dict]:
        """Every batch size, then its warm-up and timed repetitions, then every spec (the reference, kvcache,
        first); returns the timed rows, ``on_row(row)`` after each (warm-up rows are neither)."""
        s = self.settings
        return repeated_rows(s.batches, s.reps, specs,
                             lambda batch: prompts(batch, s.prompt, self.vocab_size, s.seed, s.shortest),
                             self._measure, add_ratios, desc="kvq bench batch", what=lambda batch: f"{batch} sequences",
                             progress=s.progress, on_row=on_row, warmup=s.warmup)

    def _measure(self, spec: MethodSpec, batch: int, rep: int | None, ids: list[list[int]], bar) -> dict:
        from ..cache import patch_model, unpatch_model

        s = self.settings
        row = {"batch": batch, "rep": rep, "method": spec.label,
               "cache": "mlx-lm KVCache" if spec.label == REFERENCE else "kvq BatchKVQCache", "error": None,
               "weights_bytes": self.weights_bytes}
        release()
        patched = spec.label != REFERENCE
        try:
            if patched:
                patch_model(self.model, **spec.cache_kwargs(s.sinks, s.window, s.flush), kernels=s.kernels)
            row.update(generate(self.model, ids, s.tokens, s.chunk))
        except Exception as exc:  # noqa: BLE001 - one failing method must not end the run: the row says why
            row["error"] = error_text(exc)
            when = "warm-up" if rep is None else f"rep {rep + 1}"
            bar.write(f"kvq bench batch: {spec.label} with {batch} sequences ({when}) failed: {row['error']}")
        finally:
            if patched:
                unpatch_model(self.model)
        release()
        return row


def weights_bytes(model) -> int:
    """Bytes of ``model``'s parameters that a decode step reads: every array of ``model.parameters()`` as stored
    (quantized weights: their packed bytes and scales), less the input embedding tables where the model has an
    output projection of its own (``lm_head``: a step then reads one embedding row per sequence, not the table;
    a model with tied embeddings reads the whole table as its output projection)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if hasattr(model, "lm_head"):
        tables = [m for _, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))]
        total -= sum(v.nbytes for m in tables for _, v in tree_flatten(m.parameters()))
    return total


def add_ratios(row: dict, reference: dict | None) -> None:
    """Add ``decode_vs_fp16``, ``prefill_vs_fp16`` (speed: the reference's seconds / this row's), ``peak_vs_fp16``
    and ``cache_vs_fp16`` (method / kvcache of the same batch and repetition; ``None`` when either row failed or,
    for the cache, lacks ``cache_bytes``) and ``ceiling_vs_fp16``: the decode speed-up a step bound by memory
    bandwidth could reach, (weights + the reference's cache bytes) / (weights + this row's), each step reading the
    weights (:func:`weights_bytes`) and every cache byte once (``None`` without both rows' ``cache_bytes``).
    Where the weights outweigh the caches it is near 1 whatever the cache's bits: 8 prompts of 2,048 on
    Llama-3-8B read 15 GB of weights beside 2.2 GB of 16-bit keys and values, so even a cache of no bytes could be
    at most 1.15x faster there."""
    ok = reference is not None and not row["error"]
    row["decode_vs_fp16"] = (row["decode_tokens_per_second"] / reference["decode_tokens_per_second"]
                             if ok and row["decode_tokens_per_second"] and reference["decode_tokens_per_second"]
                             else None)
    row["prefill_vs_fp16"] = reference["prefill_seconds"] / row["prefill_seconds"] if ok else None
    row["peak_vs_fp16"] = row["peak_memory_growth"] / max(reference["peak_memory_growth"], 1) if ok else None
    weights, mine, theirs = row.get("weights_bytes"), row.get("cache_bytes"), (reference or {}).get("cache_bytes")
    known = ok and weights is not None and bool(mine) and bool(theirs)
    row["cache_vs_fp16"] = mine / theirs if known else None
    row["ceiling_vs_fp16"] = (weights + theirs) / (weights + mine) if known else None


#: Per-repetition quantities :func:`summarize` gives the median and range of: summary key -> how a row gives it.
SUMMARY = {"prefill_seconds": lambda r: r.get("prefill_seconds"),
           "prefill_vs_fp16": lambda r: r.get("prefill_vs_fp16"),
           "decode_tokens_per_second": lambda r: r.get("decode_tokens_per_second"),
           "decode_vs_fp16": lambda r: r.get("decode_vs_fp16"),
           "step_ms": lambda r: r.get("step_ms"),
           "host_ms": lambda r: (r.get("host_ms") or {}).get("median"),
           "build_ms": lambda r: (r.get("build_ms") or {}).get("median"),
           "cache_bytes": lambda r: r.get("cache_bytes"),
           "cache_vs_fp16": lambda r: r.get("cache_vs_fp16"),
           "ceiling_vs_fp16": lambda r: r.get("ceiling_vs_fp16"),
           "peak_memory_growth": lambda r: r.get("peak_memory_growth"),
           "peak_vs_fp16": lambda r: r.get("peak_vs_fp16")}


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (batch, method), in the rows' order: ``batch``, ``method``, ``cache``, ``reps`` (its timed
    rows), ``errors`` (their error texts, in order) and, for every :data:`SUMMARY` key, :func:`kvq.bench.rows.spread`
    over the rows that succeeded (ratios: each repetition's own, against kvcache of that repetition; host ms: each
    repetition's median step)."""
    out = []
    for batch, method in dict.fromkeys((r["batch"], r["method"]) for r in rows):
        same = [r for r in rows if r["batch"] == batch and r["method"] == method]
        ok = [r for r in same if not r["error"]]
        entry = {"batch": batch, "method": method, "cache": same[0]["cache"], "reps": len(same),
                 "errors": [r["error"] for r in same if r["error"]]}
        for key, value in SUMMARY.items():
            entry[key] = spread([v for v in map(value, ok) if v is not None])
        out.append(entry)
    return out
