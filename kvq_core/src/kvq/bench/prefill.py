"""Prefill speed and peak memory against context, per cache: the measuring part of ``kvq bench prefill`` (#23).

Each row prefills one prompt of ``context`` tokens into fresh caches, in chunks of ``chunk`` tokens, each chunk's
cache state evaluated before the next (as ``mlx_lm.generate_step`` prefills: the logits are never computed), and
reports the seconds, prefill tokens/s, the peak memory above the level before the caches were made
(``mx.get_peak_memory`` after ``mx.reset_peak_memory``) and the caches' bytes afterwards. Every repetition measures
every method after kvcache (mlx-lm's KVCache), so each ratio compares rows of one repetition in one process.
"""

from __future__ import annotations

import time
from typing import Callable

import attrs
import mlx.core as mx

from ..defaults import DEFAULT_FLUSH, DEFAULT_SINKS, DEFAULT_WINDOW
from ..evaluation.spec import MethodSpec
from .e2e import cache_kind, make_cache
from .fill import cache_arrays
from .measure import error_text, release
from .rows import repeated_rows

#: Method strings measured when ``--methods`` is not given (those whose methods are installed).
DEFAULT_METHODS = ("kvcache", "mlx-affine:4", "affine:4", "turboquant:4", "turboquant:3")


@attrs.frozen
class PrefillSettings:
    """What one ``kvq bench prefill`` run measures.

    :param contexts: prompt lengths in tokens (each > 0), measured in this order.
    :param chunk: tokens per forward pass (mlx-lm's ``prefill_step_size``; its default 2048).
    :param reps: repetitions of every (context, method) row (>= 1; the first includes compiling kernels).
    :param sinks, window, flush, kernels: kvq caches' settings (:class:`kvq.cache.CacheConfig`).
    :param seed: seed of the random prompt (random-weight models).
    :param progress: show a tqdm bar on stderr.
    """

    contexts: tuple[int, ...]
    chunk: int = 2048
    reps: int = 2
    sinks: int = DEFAULT_SINKS
    window: int = DEFAULT_WINDOW
    flush: int = DEFAULT_FLUSH
    kernels: str = "auto"
    seed: int = 0
    progress: bool = True


def prompt(context: int, vocab_size: int, text_ids: list[int] | None, seed: int) -> mx.array:
    """``[context]`` token ids: the text repeated as often as needed, or random ids (``text_ids`` ``None``)."""
    if text_ids is None:
        return mx.random.randint(0, vocab_size, (context,), key=mx.random.key(seed * 1_000_003 + context))
    repeats = -(-context // len(text_ids))
    return mx.array((list(text_ids) * repeats)[:context])


def prefill_once(model, caches: list, ids: mx.array, chunk: int) -> dict:
    """Prefill the 1-D ``ids`` into ``caches`` and time it.

    :return: ``seconds`` (wall), ``peak_memory_growth`` (bytes above the level before) and where the wall time went
        (seconds; they add up to ``seconds`` but for the loop's own overhead): ``forward_seconds`` in the model's
        calls (building each chunk's graph; for kvq caches also queueing each layer's attention and
        ``queue_wait_seconds`` of waiting for the layer before, :class:`kvq.cache.prefill.InFlight`), and
        ``eval_seconds`` in each chunk's ``mx.eval`` of the cache state (the rest of the work, encoded and waited
        for). Host-bound: ``queue_wait_seconds + eval_seconds`` small against ``seconds``.
    """
    from ..cache.prefill import IN_FLIGHT

    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    waited, forward, evaluating = IN_FLIGHT.waited, 0.0, 0.0
    tic = time.perf_counter()
    for start in range(0, ids.size, chunk):
        t0 = time.perf_counter()
        model(ids[None, start : start + chunk], cache=caches)
        t1 = time.perf_counter()
        mx.eval([cache_arrays(c) for c in caches])
        forward, evaluating = forward + t1 - t0, evaluating + time.perf_counter() - t1
    mx.synchronize()
    return {"seconds": time.perf_counter() - tic, "peak_memory_growth": mx.get_peak_memory() - before,
            "forward_seconds": forward, "queue_wait_seconds": IN_FLIGHT.waited - waited, "eval_seconds": evaluating}


class PrefillBench:
    """Measures rows (one per context, repetition and method string) on one model.

    :param model: an mlx-lm model; :param settings: :class:`PrefillSettings`.
    :param vocab_size: for random prompts; :param text_ids: a real text's token ids (repeated to each context),
        or ``None`` for random prompts.
    """

    def __init__(self, model, settings: PrefillSettings, vocab_size: int, text_ids: list[int] | None = None) -> None:
        self.model, self.settings, self.vocab_size, self.text_ids = model, settings, vocab_size, text_ids

    def run(self, specs: list[MethodSpec], on_row: Callable[[dict], None] | None = None) -> list[dict]:
        """Every context, then every repetition, then every spec (the reference, kvcache, first); ``on_row(row)`` after each."""
        s = self.settings
        return repeated_rows(s.contexts, s.reps, specs,
                             lambda context: prompt(context, self.vocab_size, self.text_ids, s.seed), self._measure,
                             add_ratios, desc="kvq bench prefill", what=lambda context: f"{context} tokens",
                             progress=s.progress, on_row=on_row)

    def _measure(self, spec: MethodSpec, context: int, rep: int, ids: mx.array, bar) -> dict:
        row = {"context": context, "rep": rep, "method": spec.label, "cache": cache_kind(spec), "error": None}
        release()
        try:
            caches = make_cache(self.model, spec, self.settings)
            timed = prefill_once(self.model, caches, ids, self.settings.chunk)
            row.update(timed, tokens_per_second=context / timed["seconds"], kv_bytes=sum(c.nbytes for c in caches))
            del caches
        except Exception as exc:  # noqa: BLE001 - one failing method must not end the run: the row says why
            row["error"] = error_text(exc)
            bar.write(f"kvq bench prefill: {spec.label} at {context} tokens failed: {row['error']}")
        release()
        return row


def add_ratios(row: dict, reference: dict | None) -> None:
    """Add ``speed_vs_fp16``, ``peak_vs_fp16`` and ``kv_bytes_ratio`` (method / kvcache of the same context and
    repetition; ``None`` when either row failed)."""
    ok = reference is not None and not row["error"]
    row["speed_vs_fp16"] = row["tokens_per_second"] / reference["tokens_per_second"] if ok else None
    row["peak_vs_fp16"] = row["peak_memory_growth"] / max(reference["peak_memory_growth"], 1) if ok else None
    row["kv_bytes_ratio"] = row["kv_bytes"] / reference["kv_bytes"] if ok else None
