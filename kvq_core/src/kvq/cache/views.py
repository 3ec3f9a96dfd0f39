"""What a kvq cache hands a model in place of keys and values, and how mlx-lm's masks are read."""

from __future__ import annotations

import mlx.core as mx


class CompressedView:
    """Stand-in returned by ``update_and_fetch``: models pass it on to attention, which kvq intercepts.

    It carries the logical ``shape`` ``(B, H_kv, T, D)`` and ``dtype`` for code that inspects them, and the
    ``cache`` that made it: attention over these keys is that cache's (:mod:`kvq.cache.patch`), whichever cache
    the model names in the call (a KV-sharing layer of gemma4 attends an earlier layer's keys and names none;
    iquestloopcoder's second loop attends its first loop's keys naming its own).
    """

    __slots__ = ("shape", "dtype", "ndim", "cache")

    def __init__(self, shape: tuple[int, ...], dtype, cache=None) -> None:
        self.shape, self.dtype, self.cache = shape, dtype, cache
        self.ndim = len(shape)


def bool_mask(mask):
    """mlx-lm's mask as a boolean array (True = may attend), or ``None`` for ``None``/``"causal"`` (an additive
    mask: entries below half the dtype's most negative value are masked)."""
    if mask is None or isinstance(mask, str):
        return None
    if mask.dtype == mx.bool_:
        return mask
    return mask > mx.finfo(mask.dtype).min / 2  # additive mask: large negative = masked


def plain_mask(N: int, window_size: int | None = None):
    """mlx-lm's ``make_mask`` answer of a full-attention kvq cache (or a batch's packed rows of them): kvq enforces
    causality from positions, so ``None`` for one query and ``"causal"`` for more.

    :raises ValueError: a ``window_size`` (a sliding-window layer gets a :class:`kvq.cache.RotatingKVQCache`).
    """
    if window_size is not None:
        raise ValueError("a KVQCache serves full-attention layers, not a sliding window (window_size); "
                         "kvq.make_prompt_cache gives sliding-window layers a RotatingKVQCache. Were these caches "
                         "made for another model (a prompt-cache file of another model)?")
    return None if N == 1 else "causal"


def is_kvq_cache(cache) -> bool:
    """Whether ``cache`` is one of kvq's caches (a layer's, or a batch of them), whose attention is its own
    (:mod:`kvq.cache.patch`): their classes set ``KVQ_CACHE``."""
    return getattr(type(cache), "KVQ_CACHE", False) is True
