"""Centred and scaled keys (:mod:`kvq.cache.guard`): a layer stores ``(k - mu) / s`` for its compressed tokens and
attends them with ``q * s``, adding ``scale * q . mu`` back to the compressed tokens' log-sum-exp.

``mu`` is a per-channel key mean (a layer whose keys carry large constant offsets), ``s`` per-channel powers of two
(a layer whose key channels hold very unequal energy): ``(q * s) . ((k - mu) / s) = q . k - q . mu`` exactly. Every
score of a part lacks the same ``scale * q . mu``, so the part's softmax (its ``out``) is unchanged and only its
log-sum-exp moves: adding the mean's logits to it is exact. Fused kernels score the sinks and window centred and
scaled too (a subtraction in the window's dtype, then a product by a power of two, which is exact), with the queries
scaled: the scores of the uncompressed tokens are those of the keys as given, less the mean's logits.
"""

from __future__ import annotations

import mlx.core as mx


def centred(keys: mx.array, mean: mx.array | None, inverse: mx.array | None = None) -> mx.array:
    """``(keys - mean) * inverse`` for ``keys`` ``[B, H, T, D]`` (``mean``, ``inverse``: float32 ``[B or 1, H, 1, D]``
    or ``None``; computed in float32, returned in ``keys``' dtype); ``keys`` itself where both are ``None``."""
    if mean is None and inverse is None:
        return keys
    x = keys.astype(mx.float32)
    if mean is not None:
        x = x - mean
    if inverse is not None:
        x = x * inverse
    return x.astype(keys.dtype)


def mean_logits(mean: mx.array, queries: mx.array, scale: float) -> mx.array:
    """``scale * q . mu`` ``[B, H_q, T_q]`` float32 for ``queries [B, H_q, T_q, D]`` and a key ``mean`` (float32
    ``[B or 1, H_kv, 1, D]``): what the compressed tokens' scores lack when they are scored from centred keys (GQA:
    each query head reads its KV head's mean)."""
    B, Hq, Tq, D = queries.shape
    Hkv = mean.shape[1]
    q = queries.astype(mx.float32).reshape(B, Hkv, Hq // Hkv, Tq, D)
    mean = mx.broadcast_to(mean, (B, Hkv, 1, D))[:, :, None]  # [B, H_kv, 1, 1, D]
    return (scale * mx.sum(q * mean, axis=-1)).reshape(B, Hq, Tq)


class KeyTransform:
    """A layer's (or a batch's rows') key transform: the key ``mean`` subtracted and the channel ``scale`` divided out
    before compression, each float32 ``[B or 1, H_kv, 1, D_k]`` or ``None`` (a batch's packed rows hold zeros and
    ones for the rows without); with their casts to the uncompressed tokens' and the queries' dtypes, made once per
    change (the decode hot path applies them every step).

    ``scale`` holds powers of two (:func:`kvq.cache.guard.key_scales`), so dividing by it and multiplying queries by
    it round nothing short of float16's subnormals and overflow (scales stay within a few powers of two of 1): scores
    of uncompressed tokens are exactly as without it.

    :param mean: the mean, or ``None``.
    :param scale: the channel scales, or ``None``.
    """

    def __init__(self, mean: mx.array | None = None, scale: mx.array | None = None) -> None:
        self.set(mean, scale)

    def set(self, mean: mx.array | None, scale: mx.array | None = None) -> None:
        """Replace the mean and the scales (``None``: not centred, not scaled)."""
        self.mean, self.scale = mean, scale
        self.inverse = None if scale is None else 1.0 / scale
        self.casts = {}

    @property
    def active(self) -> bool:
        """Whether compressed keys are stored transformed (centred, scaled or both)."""
        return self.mean is not None or self.scale is not None

    def _cast(self, name: str, array: mx.array, dtype: mx.Dtype) -> mx.array:
        key = (name, str(dtype))  # strings: a cache with its transform must deep-copy, and mx.Dtype does not
        if key not in self.casts:
            self.casts[key] = array.astype(dtype)
        return self.casts[key]

    def centred(self, keys: mx.array) -> mx.array:
        """``(keys - mean) / scale`` computed in float32, in ``keys``' dtype (:func:`centred`): what is quantized."""
        return centred(keys, self.mean, self.inverse)

    def centred_dense(self, keys: mx.array | None) -> mx.array | None:
        """Uncompressed ``keys`` (sinks, window; ``None`` passes through) transformed in their own dtype, for attention
        that scores them together with the compressed keys as stored, from :meth:`queries` (a subtraction, then an
        exact product by powers of two; the arrays cast once)."""
        if keys is None or not self.active:
            return keys
        if self.mean is not None:
            keys = keys - self._cast("mean", self.mean, keys.dtype)
        if self.inverse is not None:
            keys = keys * self._cast("inverse", self.inverse, keys.dtype)
        return keys

    def queries(self, queries: mx.array) -> mx.array:
        """``queries [B, H_q, T_q, D]`` times the scale of their KV head (GQA), in their dtype (exact: powers of two):
        the queries that score keys stored divided by it; ``queries`` themselves where the layer is not scaled."""
        if self.scale is None:
            return queries
        B, Hq, Tq, D = queries.shape
        key = ("queries", str(queries.dtype), Hq)
        if key not in self.casts:
            Hkv = self.scale.shape[1]
            self.casts[key] = mx.repeat(self.scale, Hq // Hkv, axis=1).astype(queries.dtype)
        return queries * self.casts[key]

    def uncentred(self, keys: mx.array) -> mx.array:
        """Decoded compressed ``keys`` with the scale multiplied and the mean added back (in float32, returned in
        ``keys``' dtype): the keys as the model gave them; ``keys`` itself where the layer is neither."""
        if not self.active:
            return keys
        x = keys.astype(mx.float32)
        if self.scale is not None:
            x = x * self.scale
        if self.mean is not None:
            x = x + self.mean
        return x.astype(keys.dtype)

    def uncentre(self, part: tuple, queries: mx.array, scale: float) -> tuple:
        """A compressed part's ``(out, lse)``, scored from :meth:`queries` against the keys as stored, with the
        mean's logits (:func:`mean_logits` of the ``queries`` as given) added to its log-sum-exp; the part itself
        where the layer is not centred."""
        if self.mean is None:
            return part
        out, lse = part
        return out, lse + mean_logits(self.mean, queries, scale)


#: What a batch row that is not centred (not scaled) holds in its batch's stacked means (scales): nothing changes.
NEUTRAL = {"mean": 0.0, "scale": 1.0}


def neutral(name: str, rows: int, shape: tuple) -> mx.array:
    """float32 ``[rows, H_kv, 1, D_k]`` of :data:`NEUTRAL` means or scales (``name``), ``shape`` a row's
    ``(H_kv, D_k)``: what rows that are not centred (scaled) hold beside rows that are."""
    H, D = shape
    return mx.full((rows, H, 1, D), NEUTRAL[name], mx.float32)


def stacked(arrays: list, name: str, shape: tuple) -> mx.array | None:
    """Rows' means or scales (``name``: ``"mean"`` or ``"scale"``), each float32 ``[1, H_kv, 1, D_k]`` or ``None``,
    as one float32 ``[rows, H_kv, 1, D_k]`` with :func:`neutral` values for the rows without (``shape``: a row's
    ``(H_kv, D_k)``); ``None`` where no row has one."""
    if all(a is None for a in arrays):
        return None
    fill = neutral(name, 1, shape)
    return mx.concatenate([fill if a is None else a for a in arrays], axis=0)
