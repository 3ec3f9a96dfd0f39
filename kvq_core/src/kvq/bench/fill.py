"""Bringing caches to a context length and timing decode steps: the measuring parts of ``kvq bench e2e``."""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

#: Tokens per forward pass of a real prefill (as ``kvq eval``; on a 2-core CPU as fast as 2048, less memory).
PREFILL_CHUNK = 512


def cache_arrays(cache) -> list[mx.array]:
    """Every array of one layer's cache state (for ``mx.eval``)."""
    return [v for _, v in tree_flatten(cache.state) if isinstance(v, mx.array)]


class RandomKV:
    """Random normal keys and values ``[batch, H_kv, stop - start, D]`` in ``dtype``, the same for every method
    (one key per layer and chunk start; rows differ)."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: mx.Dtype, seed: int = 0, batch: int = 1) -> None:
        self.kv_heads, self.head_dim, self.dtype, self.seed, self.batch = kv_heads, head_dim, dtype, seed, batch

    def __call__(self, layer: int, start: int, stop: int) -> tuple[mx.array, mx.array]:
        key = mx.random.key(self.seed * 1_000_003 + layer * 65_537 + start)
        k_key, v_key = mx.random.split(key)
        shape = (self.batch, self.kv_heads, stop - start, self.head_dim)
        return mx.random.normal(shape, self.dtype, key=k_key), mx.random.normal(shape, self.dtype, key=v_key)


class ReplayKV:
    """The keys and values of one real prefill of ``ids`` with mlx-lm's caches for the model (sliding-window
    layers see their window, as in a real run), every token of every layer recorded as given to the caches
    (:class:`kvq.evaluation.attention_error.InputRecorder`: a rotating cache keeps only its window), served by token
    range."""

    def __init__(self, model, ids: mx.array) -> None:
        from ..cache.patch import mlx_lm_caches
        from ..cache.prompt import prefill_prompt
        from ..evaluation.attention_error import InputRecorder

        caches = mlx_lm_caches(model)
        recorder = InputRecorder(caches)
        prefill_prompt(model, caches, ids, step=PREFILL_CHUNK)
        recorder.detach()
        self.layers = recorder.given()
        mx.eval(self.layers)

    def __call__(self, layer: int, start: int, stop: int) -> tuple[mx.array, mx.array]:
        keys, values = self.layers[layer]
        # copies: a cache whose buffer is exactly this range would alias the reference's memory (an MLX slice
        # assignment covering a whole array shares its source), and its measured growth would be 0
        return mx.array(keys[:, :, start:stop]), mx.array(values[:, :, start:stop])


def fill(caches: list, source: Callable, context: int, chunk: int) -> None:
    """Bring every layer's cache to ``context`` tokens: ``update_and_fetch`` with ``source(layer, start, stop)``
    in chunks of ``chunk`` tokens, each layer evaluated before the next (little memory beyond the caches), and MLX's
    buffer cache emptied after each chunk, as mlx-lm's ``generate_step`` does after each prefill chunk and
    :func:`kvq.prefill_prompt` does. Without that, the decode steps measured after a fill waited for the device at
    every step at 32 sequences of 32K on an H100 (a 20 ms build of the next step against 2.5 ms), a harness artefact
    that mlx-lm's loops do not have (``benchmarks/results/host/README.md``)."""
    for start in range(0, context, chunk):
        stop = min(start + chunk, context)
        for layer, cache in enumerate(caches):
            cache.update_and_fetch(*source(layer, start, stop))
            if hasattr(cache, "release_chunk"):  # no attention follows: kvq's cache may drop the chunk's copy
                cache.release_chunk()
            mx.eval(cache_arrays(cache))
        mx.clear_cache()


def decode(model, caches: list, token: int, steps: int, warmup: int = 1,
           host: list | None = None, batch: int = 1, build: list | None = None) -> tuple[list[float], list[float]]:
    """Greedy decoding from ``token``, pipelined as mlx-lm's ``generate_step`` does it: the graph of the next step
    is built and queued (``mx.async_eval``) while the current one runs, so Python and graph building overlap the
    device's work, as in ``mlx_lm.generate`` and the server. One step more than ``warmup + steps`` runs (the one
    queued last; it is evaluated before returning, so the caches stay consistent).

    :param batch: rows decoded together (the caches hold that many sequences): each step feeds every row ``token``
        first, then its own argmax.
    :param host: if given, the seconds each timed step spent on the host building and queueing the next step's
        graph (``model(...)`` + ``mx.async_eval``) are appended to it. A step whose interval is about its host
        time was not necessarily bound by the host: on MLX's CUDA back end ``mx.async_eval`` can wait for the device
        (32 sequences of 32K on an H100: 4.5 ms of building, 19 ms in ``mx.async_eval``, a 23.7 ms step).
    :param build: if given, the part of each timed step's host time spent before ``mx.async_eval`` is called
        (Python and graph building: ``model(...)``) is appended to it; a step close to its build time was bound by
        the host.
    :return: ``(timed, warmup)``: the ``steps`` timed intervals between consecutive tokens becoming available,
        and the ``warmup`` untimed ones before them, in seconds.
    """
    def step(y):
        logits = model(y, cache=caches)
        return mx.argmax(logits[:, -1:, :], axis=-1)

    nxt = step(mx.full((batch, 1), token, dtype=mx.int32))
    mx.async_eval(nxt)
    times, built, built_only = [], [], []
    tic = time.perf_counter()
    for _ in range(warmup + steps):
        y, nxt = nxt, None
        nxt = step(y)
        built_only.append(time.perf_counter() - tic)
        mx.async_eval(nxt)
        built.append(time.perf_counter() - tic)
        y.tolist()  # the tokens reach Python, as mlx-lm's generate and BatchGenerator take them
        now = time.perf_counter()
        times.append(now - tic)
        tic = now
    mx.eval(nxt)
    if host is not None:
        host.extend(built[warmup:])
    if build is not None:
        build.extend(built_only[warmup:])
    return times[warmup:], times[:warmup]


def _milliseconds(seconds: list[float]) -> dict:
    """``seconds`` in milliseconds: median, p10, p90, mean, min, max and every value (``all``, in order)."""
    ms = np.array(seconds) * 1e3
    return {"median": float(np.median(ms)), "p10": float(np.percentile(ms, 10)), "p90": float(np.percentile(ms, 90)),
            "mean": float(ms.mean()), "min": float(ms.min()), "max": float(ms.max()),
            "all": [round(float(x), 4) for x in ms]}


def latency_summary(seconds: list[float], batch: int = 1) -> dict:
    """Per-step latency in milliseconds (median, p10, p90, mean, min, max, all) and tokens/s (``batch`` tokens
    per step: ``batch`` / mean).

    tokens/s is the count over the total time, as ``mlx_lm.generate`` reports it: a kvq cache compresses its
    window once every ``flush`` steps, and that step's cost belongs in the rate (the median would hide it)."""
    latency = _milliseconds(seconds)
    return {"latency_ms": latency, "tokens_per_second": batch * 1e3 / latency["mean"]}


def host_summary(seconds: list[float]) -> dict:
    """Host time per decode step (:func:`decode`'s ``host`` or ``build``) in milliseconds, as
    :func:`latency_summary` gives the steps' (``all`` in the order of ``latency_ms["all"]``). A step bound by the
    host has an interval close to its build time; its host time also holds ``mx.async_eval``, which on MLX's CUDA
    back end can wait for the device. Without any step, every value is ``None`` and ``all`` empty."""
    if not seconds:
        return {"median": None, "p10": None, "p90": None, "mean": None, "min": None, "max": None, "all": []}
    return _milliseconds(seconds)
