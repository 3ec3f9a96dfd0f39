"""Attention-output error per layer, and the hook that sits in front of the model's attention.

The reference run (kvcache) records, at window 0, every layer's queries of the scored tokens and every key and value
its caches were given (:class:`InputRecorder`), as kvq's 16-bit buffers hold them. Each method is then measured
layer by layer on exactly those inputs: a fresh single-layer cache of the method is filled with the same keys and
values in the same chunks as the model run (context in prefill chunks, then the scored tokens), the recorded
queries attend through the normal path, and the output is compared with dense float32 attention over the
reference keys and values: ``‖out - ref‖_F / ‖ref‖_F`` over all query heads and scored positions. Errors do not
compound across layers. A sliding-window layer (mlx-lm's ``RotatingKVCache(max_size, keep)``: kvq's
:class:`~kvq.cache.RotatingKVQCache`) is replayed into a rotating cache of the same size and compared with
attention over what mlx-lm's rotating cache shows each query (:func:`window_mask`).
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

from .perplexity import state_arrays
from .spec import MethodSpec, make_layer_cache


def dequantized_attention(queries, keys, values, cache, scale, mask):
    """mlx-lm's quantized attention as dequantize + float attention: the same products, computed with BLAS.

    MLX's CPU ``quantized_matmul`` is about 5x slower than decoding to the scales' dtype and multiplying; the
    stored codes, scales and biases are mlx-lm's own (float32 scales in a float32 model, so the products match).
    """
    k = mx.dequantize(*keys, group_size=cache.group_size, bits=cache.bits)
    v = mx.dequantize(*values, group_size=cache.group_size, bits=cache.bits)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


class AttentionHook:
    """Stands in for ``scaled_dot_product_attention`` in the model's module while the evaluation runs.

    It records ``(queries, scale, sinks)`` per cache (learned sink logits ``[H_q]`` or ``None``) when
    :attr:`recording` is a dict, serves ``mlx-affine`` caches with
    :func:`dequantized_attention` when ``dequantize_mlx``, and otherwise calls the function it replaced (kvq's
    patched one, which serves kvq caches). Use as a context manager; leaving it restores the module.
    """

    def __init__(self, model, dequantize_mlx: bool) -> None:
        from ..cache import patch

        patch.patch()  # kvq's routing first, so that this hook wraps it
        self.module = sys.modules[type(model.layers[0].self_attn).__module__]
        self.dequantize_mlx = dequantize_mlx
        self.recording: dict[int, mx.array] | None = None
        self.previous = None

    def __enter__(self) -> "AttentionHook":
        self.previous = self.module.scaled_dot_product_attention
        self.module.scaled_dot_product_attention = self
        return self

    def __exit__(self, *exc) -> None:
        if self.module.scaled_dot_product_attention is self:
            self.module.scaled_dot_product_attention = self.previous

    def __call__(self, queries, keys, values, cache, scale, mask, sinks=None):
        if self.recording is not None:
            self.recording[id(cache)] = (queries, scale, sinks)
        if self.dequantize_mlx and isinstance(cache, QuantizedKVCache) and sinks is None:
            return dequantized_attention(queries, keys, values, cache, scale, mask)
        return self.previous(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def dense_kv(cache) -> tuple[mx.array, mx.array]:
    """Every key and value a kvq cache holds, in token order, decoded to float32 ``[B, H_kv, T, D]`` (a centred
    layer's compressed keys with their mean added back: :meth:`kvq.cache.KVQCache.decoded`)."""
    compressed = cache.decoded(mx.float32) if cache.compressed_keys.length else (None, None)
    keys, values = [], []
    for k, v in ((cache.sink_keys, cache.sink_values), compressed, (cache.window_keys, cache.window_values)):
        if k is not None:
            keys.append(k.astype(mx.float32))
            values.append(v.astype(mx.float32))
    return mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)


def as_stored(x: mx.array) -> mx.array:
    """``x`` as kvq's 16-bit buffers hold it (float32 inputs rounded to float16: :mod:`kvq.cache.store`), in
    float32."""
    return (x.astype(mx.float16) if x.dtype == mx.float32 else x).astype(mx.float32)


class InputRecorder:
    """Records the keys and values each cache of a model run is given (``update_and_fetch``'s arguments), whatever
    the cache keeps: a rotating cache holds only its window, the reference needs every token.

    :param caches: the run's caches (one per layer); each gets an ``update_and_fetch`` of its own that records and
        calls the class's. :meth:`kv` gives what was recorded; :meth:`detach` restores the caches.
    """

    def __init__(self, caches: list) -> None:
        self.caches = caches
        self.chunks: list[list[tuple[mx.array, mx.array]]] = [[] for _ in caches]
        for cache, chunks in zip(caches, self.chunks):
            original = cache.update_and_fetch

            def update(keys, values, _original=original, _chunks=chunks):
                _chunks.append((keys, values))
                return _original(keys, values)

            cache.update_and_fetch = update

    def given(self) -> list[tuple[mx.array, mx.array]]:
        """Per layer, every key and value given so far, in token order, as given: ``[B, H_kv, T, D]``."""
        return [tuple(mx.concatenate([c[i] for c in chunks], axis=2) for i in (0, 1)) for chunks in self.chunks]

    def kv(self) -> list[tuple[mx.array, mx.array]]:
        """:meth:`given` as kvq's 16-bit buffers hold it (:func:`as_stored`): float32 ``[B, H_kv, T, D]``."""
        return [(as_stored(k), as_stored(v)) for k, v in self.given()]

    def detach(self) -> None:
        for cache in self.caches:
            del cache.update_and_fetch


def sliding_windows(caches: list) -> list[tuple[int, int] | None]:
    """Per layer of a run, ``(max_size, keep)`` of a sliding-window layer (a :class:`~kvq.cache.RotatingKVQCache`,
    or mlx-lm's ``RotatingKVCache`` in the reference run), ``None`` for a layer that sees every token."""
    from ..cache import RotatingKVQCache

    rotating = (RotatingKVQCache, RotatingKVCache)
    return [(c.max_size, c.keep) if isinstance(c, rotating) else None for c in caches]


def window_mask(num_queries: int, num_keys: int, max_size: int, keep: int) -> mx.array:
    """Which keys each of the last ``num_queries`` of ``num_keys`` tokens sees through mlx-lm's
    ``RotatingKVCache(max_size, keep)`` in token-by-token decode: the first ``keep`` tokens and the newest
    ``max_size - keep`` up to itself. Boolean ``[num_queries, num_keys]``."""
    positions = mx.arange(num_keys - num_queries, num_keys)[:, None]
    keys = mx.arange(num_keys)[None]
    return (keys <= positions) & ((keys < keep) | (keys > positions - (max_size - keep)))


class LayerReference:
    """Window 0 of the reference run, per layer: keys, values, the scored tokens' queries, and exact outputs.

    :param kv: per layer ``(keys, values)``, float32 ``[1, H_kv, context + scored, D]``.
    :param queries: per layer ``[1, H_q, scored, D]`` (after RoPE, as the attention received them).
    :param scales: per layer attention scale.
    :param windows: per layer ``(max_size, keep)`` of a sliding-window layer, or ``None`` (:func:`sliding_windows`);
        default: no layer slides.
    :param sinks: per layer learned attention-sink logits ``[H_q]`` (gpt-oss) or ``None``; default: none.
    :param still: per layer the key channels RoPE keeps still, as the model run's caches had them
        (:func:`kvq.cache.still.layer_still_channels`), given to each replayed cache; default: unknown.
    """

    def __init__(self, kv, queries, scales, context: int, chunk: int, windows=None, sinks=None, still=None) -> None:
        self.kv, self.queries, self.scales = kv, queries, scales
        self.context, self.chunk = context, chunk
        self.windows = list(windows) if windows is not None else [None] * len(kv)
        self.sinks = list(sinks) if sinks is not None else [None] * len(kv)
        self.still = list(still) if still is not None else [None] * len(kv)
        self.outputs = [
            mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask=self._mask(q, k, w),
                                                 sinks=None if z is None else z.astype(mx.float32))
            for q, (k, v), s, w, z in zip(queries, kv, scales, self.windows, self.sinks)]
        mx.eval(self.outputs)

    @staticmethod
    def _mask(queries, keys, window):
        if window is None:
            return "causal"
        return window_mask(queries.shape[2], keys.shape[2], *window)

    def errors(self, spec: MethodSpec, attend, sinks: int, window: int) -> list[float]:
        """Relative attention-output error of ``spec`` at every layer (see the module docstring)."""
        return [self._layer_error(i, spec, attend, sinks, window) for i in range(len(self.kv))]

    def _layer_error(self, layer, spec, attend, sinks, window) -> float:
        keys, values = self.kv[layer]
        cache = make_layer_cache(spec, sinks, window, layer, sliding=self.windows[layer], still=self.still[layer])
        for start in range(0, self.context, self.chunk):  # the prefill chunks of the model run
            stop = min(start + self.chunk, self.context)
            cache.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
            mx.eval(state_arrays([cache]))
        mask = "causal"  # kvq's rotating cache applies its window from positions
        if isinstance(cache, RotatingKVCache):  # mlx-lm's (an mlx-affine row's sliding layer): its own chunk mask
            mask = cache.make_mask(keys.shape[2] - self.context, window_size=cache.max_size, return_array=True)
        k, v = cache.update_and_fetch(keys[:, :, self.context :], values[:, :, self.context :])
        # a copy: mlx-lm's quantized attention scales its queries argument in place
        queries = mx.array(self.queries[layer])
        out = attend(queries, k, v, cache=cache, scale=self.scales[layer], mask=mask, sinks=self.sinks[layer])
        ref = self.outputs[layer]
        error = mx.sqrt(((out.astype(mx.float32) - ref) ** 2).sum() / (ref**2).sum())
        return error.item()
