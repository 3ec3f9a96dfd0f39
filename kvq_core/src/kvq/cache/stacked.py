"""A batch's rows' prefill chunk stacked into one attention call on a GPU (issue #51).

mlx-lm's ``BatchGenerator`` (and so ``mlx_lm.server``) prefills its prompts as one batch of
:class:`kvq.cache.KVQCache` rows. Attended row by row, each row and layer built, encoded and queued its own decode,
mask and attention call: at 10-15 us of host time per graph node on an H100, the host set a batch's prefill pace.
Here a batch's rows whose parts have the same structure (:func:`signature`: ``[sinks | compressed | dense]``, one
method's codes) are stacked along the batch axis (:func:`stack`) and attended as one call of
:func:`kvq.cache.prefill.attend_dequantized`: each side's codes decoded once, one mask, one attention, one queue.

Rows need not hold the same numbers of tokens. Prompts of different lengths (right padding: each row stores only
its real tokens) give each row parts of its own sizes and intervals; every part is then padded to the group's longest
(the padding repeats the row's last column, codes or dense tokens, so it decodes to numbers as finite as the row's
own) and each batch row keeps its own intervals (:class:`kvq.cache.parts.Part`'s ``[B, T_q]`` form), clipped to its
own columns: no row sees another row's padding, and each sees exactly what it sees alone (its attention differs
from its own only by the order of float additions over the extra, hidden columns; bit for bit where no row is
padded). Rows whose parts agree in sizes and intervals keep one ``[T_q, keys]`` mask for the batch.

Groups (:func:`groups`) bound what stacking costs: a group's decoded copy stays within :data:`STACKED_ROWS_BYTES`,
and a row joins a group only if it holds at least :data:`MIN_FILL` of the group's longest row's columns (padding a
short row to a long one costs the device more than its own call costs the host). A row in no group of two or more
attends alone.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np

from ..encoded import Encoded
from .parts import Part
from .prefill import _chunk_key

#: Bytes of decoded keys and values one call over a batch's stacked rows may hold (padding included): more rows are
#: attended in groups, so with :class:`kvq.cache.prefill.InFlight`'s two layers a batch's chunk keeps at most about
#: twice this above the cache (8 rows of 2,048 tokens at Llama-3-8B's shape: about 70 MB, one group; 8 rows of 32K:
#: 1.07 GB, groups of 3).
STACKED_ROWS_BYTES = 1 << 29
#: A row joins a group only if its columns are at least this share of the group's longest row's (the rest of its
#: stacked columns are padding the device attends and masks).
MIN_FILL = 0.5


def signature(parts: list) -> tuple | None:
    """What must be equal for two rows' parts (one :class:`kvq.cache.parts.Part` list each, ``B = 1``) to stack:
    per part whether it holds codes, the codes' parameters, head_dim and fields, or the dense tokens' heads, head_dims
    and dtypes (rows with nothing compressed, short prompts, stack among themselves). ``None`` where the parts do not
    stack at all: more than one compressed part, or a part whose columns are not contiguous from index 0 (a
    ring's)."""
    out = []
    for part in parts:
        if not isinstance(part.index, (int, np.integer)) or part.index != 0:
            return None
        if part.compressed:
            out.append(tuple((e.params, e.head_dim, frozenset(e.data)) for e in (part.keys, part.values)))
        else:
            k, v = part.keys, part.values
            out.append((k.shape[1], k.shape[3], v.shape[3], k.dtype, v.dtype))
    return tuple(out) if sum(part.compressed for part in parts) <= 1 else None


def decoded_bytes(rows: list, dtype: mx.Dtype) -> int:
    """Bytes of the decoded keys and values of ``rows`` (part lists of one :func:`signature`) stacked in ``dtype``,
    each part padded to its widest row's (:func:`kvq.cache.prefill.columns`)."""
    widths = [max(parts[i].size for parts in rows) for i in range(len(rows[0]))]
    return len(rows) * sum(widths) * _column_bytes(rows[0], dtype)


def _column_bytes(parts: list, dtype: mx.Dtype) -> int:
    """Bytes of one decoded column (a key and a value of every KV head) of ``parts`` in ``dtype``."""
    part = next(p for p in parts if not p.compressed)  # a dense part (a chunk has one) gives heads and head_dims
    return part.keys.shape[1] * (part.keys.shape[3] + part.values.shape[3]) * dtype.size


def groups(rows: list, dtype: mx.Dtype) -> list[list[int]]:
    """The batch rows to stack together: ``rows`` one part list per batch row (``None``: a row not offered), grouped
    by :func:`signature`; within one, from the row of most columns down, a row joins the open group while it holds at
    least :data:`MIN_FILL` of the group's first row's columns and the group's decoded copy stays within
    :data:`STACKED_ROWS_BYTES` (:func:`decoded_bytes`, kept as the group grows: one pass over the rows). Returns
    groups of two or more rows, each its indices in ascending order."""
    by_signature: list[tuple[tuple, list[int]]] = []
    for i, parts in enumerate(rows):
        key = None if parts is None else signature(parts)
        if key is None:
            continue
        for known, members in by_signature:
            if known == key:
                members.append(i)
                break
        else:
            by_signature.append((key, [i]))
    out = []
    for _, members in by_signature:
        sizes = {i: [part.size for part in rows[i]] for i in members}
        members = sorted(members, key=lambda i: -sum(sizes[i]))  # stable: equal rows keep the batch's order
        column_bytes = _column_bytes(rows[members[0]], dtype)
        group, widths = [], []
        for i in members:
            joined = [max(w, n) for w, n in zip(widths, sizes[i])]
            if group and (sum(sizes[i]) < MIN_FILL * sum(sizes[group[0]])
                          or (len(group) + 1) * sum(joined) * column_bytes > STACKED_ROWS_BYTES):
                if len(group) > 1:
                    out.append(sorted(group))
                group = []
            group, widths = group + [i], (joined if group else sizes[i])
        if len(group) > 1:
            out.append(sorted(group))
    return out


def stack(queries: mx.array, rows: list, transforms: list) -> tuple:
    """Rows' chunk as one batch for :func:`kvq.cache.prefill.attend_dequantized`: ``(queries, parts)`` for rows of
    one :func:`signature` (``rows``: one :class:`kvq.cache.parts.Part` list per batch row, ``B = 1`` each, for
    ``T_q`` query rows). Codes are stacked along the batch (each side is decoded once for every row), dense parts too,
    each row's keys transformed as its layer stores them (:meth:`kvq.cache.centring.KeyTransform.centred_dense`) and
    each row's queries scaled as its layer scores (:meth:`~kvq.cache.centring.KeyTransform.queries`): the parts then
    need no transform of their own. Each part is as wide as its widest row's, the others padded with their last
    column repeated; where the rows' parts differ in sizes or intervals, each batch row keeps its own (``[B, T_q]``),
    clipped to its own columns.

    :param queries: ``[B, H_q, T_q, D]``, row ``b``'s queries at ``b``. :param transforms: each row's
        :class:`kvq.cache.centring.KeyTransform`.
    :return: ``queries [B, H_q, T_q, D]`` and the stacked parts (``column`` ``None``: no mlx-lm mask).
    """
    count = queries.shape[2]
    key = _chunk_key(rows[0], count)  # equal keys: the same intervals, one mask for the batch
    same = all(_chunk_key(parts, count) == key for parts in rows[1:])
    stacked = []
    for i, part in enumerate(rows[0]):
        width = max(parts[i].size for parts in rows)
        if part.compressed:
            keys, values = (_stack_encoded([getattr(parts[i], side) for parts in rows], width)
                            for side in ("keys", "values"))
        else:
            keys = mx.concatenate([_pad(t.centred_dense(parts[i].keys), width) for parts, t in zip(rows, transforms)],
                                  axis=0)
            values = mx.concatenate([_pad(parts[i].values, width) for parts in rows], axis=0)
        lo, hi = (part.lo, part.hi) if same else _row_intervals([parts[i] for parts in rows], count)
        stacked.append(attrs.evolve(part, keys=keys, values=values, lo=lo, hi=hi, column=None))
    if any(t.scale is not None for t in transforms):
        queries = mx.concatenate([t.queries(q) for q, t in zip(mx.split(queries, len(rows), axis=0), transforms)],
                                 axis=0)
    return queries, stacked


def _row_intervals(parts: list, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)`` int64 ``[B, count]``: each batch row's intervals of its part (``parts[b]``), every row's clipped
    to its own columns (a part every row sees whole: ``[0, size)``)."""
    # (the parts' columns are indexed from 0, which signature requires: an index is then a column)
    lo = np.zeros((len(parts), count), np.int64)
    hi = np.zeros((len(parts), count), np.int64)
    for b, part in enumerate(parts):
        lo[b] = 0 if part.lo is None else np.clip(part.lo, 0, part.size)
        hi[b] = part.size if part.hi is None else np.clip(part.hi, 0, part.size)
    return lo, hi


def _pad(array: mx.array, width: int) -> mx.array:
    """``array [B, H, T, ...]`` to ``width`` tokens, its last token repeated (``array`` itself where it is that
    wide)."""
    T = array.shape[2]
    if T == width:
        return array
    last = array[:, :, T - 1 : T]
    # (three graph nodes, a view of the last token broadcast and one copy; mx.pad's "edge" mode builds about nine)
    return mx.concatenate([array, mx.broadcast_to(last, (*last.shape[:2], width - T, *last.shape[3:]))], axis=2)


def _stack_encoded(blocks: list, width: int) -> Encoded:
    """Blocks of codes of one method's parameters (``[1, H, T, ...]`` fields each) as one ``[B, H, width, ...]``
    block, each padded with its last token's codes."""
    first = blocks[0]
    return Encoded(first.params, {name: mx.concatenate([_pad(b.data[name], width) for b in blocks], axis=0)
                                  for name in first.data}, first.head_dim)
