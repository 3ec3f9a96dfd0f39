"""Attention-output error per layer, and the hook that sits in front of the model's attention.

The reference run (fp16) records, at window 0, every layer's queries of the scored tokens and, afterwards, the
keys and values its cache holds. Each method is then measured layer by layer on exactly those inputs: a fresh
single-layer cache of the method is filled with the same keys and values in the same chunks as the model run
(context in prefill chunks, then the scored tokens), the recorded queries attend through the normal path, and
the output is compared with dense float32 attention over the reference keys and values:
``‖out - ref‖_F / ‖ref‖_F`` over all query heads and scored positions. Errors do not compound across layers.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

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

    It records queries per cache when :attr:`recording` is a dict, serves ``mlx-affine`` caches with
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
            self.recording[id(cache)] = queries
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


class LayerReference:
    """Window 0 of the reference run, per layer: keys, values, the scored tokens' queries, and exact outputs.

    :param kv: per layer ``(keys, values)``, float32 ``[1, H_kv, context + scored, D]``.
    :param queries: per layer ``[1, H_q, scored, D]`` (after RoPE, as the attention received them).
    :param scales: per layer attention scale.
    """

    def __init__(self, kv, queries, scales, context: int, chunk: int) -> None:
        self.kv, self.queries, self.scales = kv, queries, scales
        self.context, self.chunk = context, chunk
        self.outputs = [mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask="causal")
                        for q, (k, v), s in zip(queries, kv, scales)]
        mx.eval(self.outputs)

    def errors(self, spec: MethodSpec, attend, sinks: int, window: int) -> list[float]:
        """Relative attention-output error of ``spec`` at every layer (see the module docstring)."""
        return [self._layer_error(i, spec, attend, sinks, window) for i in range(len(self.kv))]

    def _layer_error(self, layer, spec, attend, sinks, window) -> float:
        keys, values = self.kv[layer]
        cache = make_layer_cache(spec, sinks, window, layer)
        for start in range(0, self.context, self.chunk):  # the prefill chunks of the model run
            stop = min(start + self.chunk, self.context)
            cache.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
            mx.eval(state_arrays([cache]))
        k, v = cache.update_and_fetch(keys[:, :, self.context :], values[:, :, self.context :])
        # a copy: mlx-lm's quantized attention scales its queries argument in place
        queries = mx.array(self.queries[layer])
        out = attend(queries, k, v, cache=cache, scale=self.scales[layer], mask="causal")
        ref = self.outputs[layer]
        error = mx.sqrt(((out.astype(mx.float32) - ref) ** 2).sum() / (ref**2).sum())
        return error.item()
