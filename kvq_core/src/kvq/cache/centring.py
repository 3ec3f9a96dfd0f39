"""Centred keys (:mod:`kvq.cache.guard`): a layer whose keys carry large constant offsets stores ``k - mu`` and
attention adds ``scale * q . mu`` back to the compressed tokens' log-sum-exp.

Every score of a part lacks the same ``scale * q . mu``, so the part's softmax (its ``out``) is unchanged and only
its log-sum-exp moves: adding the mean's logits to it is exact. Fused kernels score the sinks and window centred
too (one subtraction in the window's dtype), which leaves the whole softmax unchanged.
"""

from __future__ import annotations

import mlx.core as mx


def centred(keys: mx.array, mean: mx.array | None) -> mx.array:
    """``keys`` ``[B, H, T, D]`` less a centred layer's key ``mean`` (float32 ``[B or 1, H, 1, D]``; computed in
    float32, returned in ``keys``' dtype); ``keys`` itself where ``mean`` is ``None`` (:mod:`kvq.cache.guard`)."""
    if mean is None:
        return keys
    return (keys.astype(mx.float32) - mean).astype(keys.dtype)


def mean_logits(mean: mx.array, queries: mx.array, scale: float) -> mx.array:
    """``scale * q . mu`` ``[B, H_q, T_q]`` float32 for ``queries [B, H_q, T_q, D]`` and a key ``mean`` (float32
    ``[B or 1, H_kv, 1, D]``): what the compressed tokens' scores lack when they are scored from centred keys (GQA:
    each query head reads its KV head's mean)."""
    B, Hq, Tq, D = queries.shape
    Hkv = mean.shape[1]
    q = queries.astype(mx.float32).reshape(B, Hkv, Hq // Hkv, Tq, D)
    mean = mx.broadcast_to(mean, (B, Hkv, 1, D))[:, :, None]  # [B, H_kv, 1, 1, D]
    return (scale * mx.sum(q * mean, axis=-1)).reshape(B, Hq, Tq)


class KeyMean:
    """A layer's (or a batch's rows') key mean: float32 ``[B or 1, H_kv, 1, D_k]`` (zeros for rows of a batch that
    are not centred), or ``None`` for a layer that is not centred; with its cast to the uncompressed tokens' dtype,
    made once per change (the decode hot path subtracts it every step).

    :param mean: the mean, or ``None``.
    """

    def __init__(self, mean: mx.array | None = None) -> None:
        self.mean = mean
        self.cast = None

    def set(self, mean: mx.array | None) -> None:
        """Replace the mean (``None``: not centred)."""
        self.mean, self.cast = mean, None

    def centred(self, keys: mx.array) -> mx.array:
        """``keys`` less the mean in float32, in their own dtype (:func:`centred`): what is quantized."""
        return centred(keys, self.mean)

    def centred_dense(self, keys: mx.array | None) -> mx.array | None:
        """Uncompressed ``keys`` (sinks, window; ``None`` passes through) less the mean in their own dtype, for
        attention that scores them together with the centred compressed keys (one subtraction; the mean cast once)."""
        if self.mean is None or keys is None:
            return keys
        if self.cast is None or self.cast.dtype != keys.dtype:
            self.cast = self.mean.astype(keys.dtype)
        return keys - self.cast

    def uncentred(self, keys: mx.array) -> mx.array:
        """Decoded compressed ``keys`` with the mean added back (in float32, returned in ``keys``' dtype): the keys
        as the model gave them; ``keys`` itself where the layer is not centred."""
        if self.mean is None:
            return keys
        return (keys.astype(mx.float32) + self.mean).astype(keys.dtype)

    def uncentre(self, part: tuple, queries: mx.array, scale: float) -> tuple:
        """A compressed part's ``(out, lse)`` with the mean's logits (:func:`mean_logits`) added to its log-sum-exp;
        the part itself where the layer is not centred."""
        if self.mean is None:
            return part
        out, lse = part
        return out, lse + mean_logits(self.mean, queries, scale)
