"""What a query row sees, stated once: a cache's tokens as parts, each with per-row intervals.

Every kvq cache (plain, rotating, a batch's packed rows) describes its tokens as parts, in order ``[sinks |
compressed | dense]`` (a part of no tokens is left out), and per query row the interval of each part the row sees
(:class:`Part`): row ``r`` sees the columns whose index ``i`` lies in ``[lo[r], hi[r])`` (:func:`visible`, the one
predicate). Where the intervals come from is each cache's own schedule (:mod:`kvq.cache.schedule`: a chunk's rows see
what a token-by-token run showed them; :func:`causal` for the cache as it is; a rotating cache's rows see their
sliding window). The attention engine (:mod:`kvq.cache.engine`) attends them, the GPU chunk path
(:mod:`kvq.cache.prefill`) makes its additive mask from them.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np


@attrs.frozen
class Part:
    """One part of a cache's tokens and what each query row sees of it.

    :param keys, values: ``[B, H_kv, n, D]`` arrays (a dense part: sinks, window, a chunk's uncompressed tokens) or
        :class:`kvq.Encoded` (a compressed part).
    :param compressed: whether ``keys``/``values`` are codes.
    :param index: the index of each column: an int ``i0`` (columns ``i0, i0 + 1, ...``) or an int array ``[n]`` (a
        ring's slots, any order).
    :param lo, hi: int arrays ``[T_q]`` (or ``[B, T_q]``: per batch row and query row): row ``r`` sees the columns
        whose index is in ``[lo[r], hi[r])``; both ``None``: every row sees every column.
    :param column: where the part's first column sits on the last axis of mlx-lm's mask (the user mask of a padded
        batch; contiguous parts only), or ``None``.
    """

    keys: object
    values: object
    compressed: bool
    index: int | np.ndarray = 0
    lo: np.ndarray | None = None
    hi: np.ndarray | None = None
    column: int | None = None

    @property
    def size(self) -> int:
        """Columns (tokens) in the part."""
        return self.keys.num_tokens if self.compressed else self.keys.shape[2]


def causal(n: int, start: int, positions: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(lo, hi)`` of a part of ``n`` tokens at positions ``start .. start + n - 1`` (indices ``0 .. n - 1``) for
    query rows at ``positions`` (non-decreasing): each row sees the tokens at or before its own position; ``(None,
    None)`` where every row sees every token."""
    if start + n - 1 <= positions[0]:
        return None, None
    return np.zeros_like(positions), np.clip(positions - start + 1, 0, n)


def rows_mask(index, n: int, lo: np.ndarray, hi: np.ndarray):
    """Which of ``n`` columns with indices ``index`` (an int: contiguous from it; an int array ``[n]`` covering a
    contiguous range in any order) each query row sees: row ``r`` those with ``lo[r] <= i < hi[r]``.

    :return: ``(any, mask)``: ``any`` False when no row sees any column; ``mask`` ``None`` when every row sees every
        column, else bool ``[T_q, n]`` (``[B, 1, T_q, n]`` for ``[B, T_q]`` intervals; True = visible).
    """
    contiguous = isinstance(index, (int, np.integer))
    low, high = (int(index), int(index) + n - 1) if contiguous else (int(index.min()), int(index.max()))
    if not np.any(np.maximum(lo, low) < np.minimum(hi, high + 1)):
        return False, None
    if lo.max() <= low and hi.min() > high:
        return True, None
    return True, visible(mx.arange(low, high + 1) if contiguous else mx.array(index), lo, hi)


def visible(column: mx.array, lo: np.ndarray, hi: np.ndarray) -> mx.array:
    """The visibility rule: whether query row ``r`` sees the column of index ``i``, ``lo[r] <= i < hi[r]``.

    :param column: int ``[n]``, each column's index. :param lo, hi: int ``[T_q]``, or ``[B, T_q]`` (per batch row).
    :return: bool ``[T_q, n]``, or ``[B, 1, T_q, n]`` for per-batch-row intervals (True = visible).
    """
    if lo.ndim == 1:
        return (column[None] >= mx.array(lo)[:, None]) & (column[None] < mx.array(hi)[:, None])
    lo, hi = mx.array(lo)[:, None, :, None], mx.array(hi)[:, None, :, None]
    return (column >= lo) & (column < hi)
