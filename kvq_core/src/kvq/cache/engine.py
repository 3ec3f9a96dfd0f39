"""The attention engine: what a query row sees, stated once, and attention over it.

Every kvq cache (plain, rotating, a batch's packed rows) describes its tokens as parts with per-row intervals
(:class:`kvq.cache.parts.Part`: what a query row sees, stated there once); how they are attended is decided here,
once:

- :func:`attend`, any number of query rows, any device: each part attended on its own (a compressed part through
  the method's attention over its codes, :func:`kvq.cache.choice.attend_fn`; a dense part in slices of
  :data:`CHUNK_ROWS` rows that each read only the keys they may see), merged with log-sum-exp
  (:func:`kvq.attention.merge_parts`); or, for a prefill chunk on a GPU, MLX's fused attention over a transient
  decoded copy with an additive mask made from the same intervals (:func:`kvq.cache.prefill.attend_dequantized`),
  or a fused kernel that reads the intervals themselves (:class:`kvq.contract.AttendsColumns`; next: one that
  decodes the codes itself). :func:`attend_rows`: a batch's rows' chunks stacked into such calls
  (:mod:`kvq.cache.stacked`).
- :func:`bind_decode` / :func:`bind_ragged`: one query row per sequence, every held token visible, bound once per
  layer and replayed each decode step (the implementation's :class:`kvq.contract.BindsDense` /
  :class:`kvq.contract.BindsRaggedDense`).

No fp16 copy of the compressed tokens is kept: the pure-MLX parts read codes block by block, and the GPU chunk's
decoded copy is freed once its call has run.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..attention import DenseTokens, dense_attend, empty_part, merge_parts, sink_logits_part
from ..contract import AttendsDense, BindsDense, BindsRaggedDense, optional_hook
from .centring import KeyTransform
from .choice import attend_fn, attend_plan, own_attend
from .config import CacheConfig
from .parts import Part, rows_mask
from . import stacked
from .prefill import attend_dequantized

#: Query rows per slice of a dense part (each slice reads only the keys its rows may see).
CHUNK_ROWS = 256


def _user_columns(user_mask: mx.array, column: int, a: int, b: int, r0: int | None = None, r1: int | None = None):
    """Columns ``column + a .. column + b`` of mlx-lm's boolean mask (rows ``r0:r1`` where it has one per query)."""
    if r0 is not None and user_mask.shape[-2] > 1:
        user_mask = user_mask[..., r0:r1, :]
    return user_mask[..., column + a : column + b]


def _compressed(part: Part, queries, scale, config: CacheConfig, transform: KeyTransform, user_mask):
    """``(out, lse)`` of a compressed part (scored from the layer's scaled queries against its keys as stored, the
    mean's logits added back for a centred layer), or ``None`` where no row sees any of it."""
    mask = None
    if part.lo is not None:
        visible, mask = rows_mask(part.index, part.size, part.lo, part.hi)
        if not visible:
            return None
    if user_mask is not None:
        window = _user_columns(user_mask, part.column, 0, part.size)
        mask = window if mask is None else mask & window
    keys, values = part.keys, part.values
    stored = transform.queries(queries)
    return transform.uncentre(attend_fn(config, keys, stored)(stored, keys, values, scale, mask), queries, scale)


def _dense(part: Part, queries, scale, user_mask):
    """``(out, lse)`` of a dense part, or ``None`` where no row sees any of it. Rows are attended in slices of
    :data:`CHUNK_ROWS`, each over only the columns its rows may see (intervals non-decreasing in the row)."""
    keys, values = part.keys, part.values
    if part.lo is None:
        mask = None if user_mask is None else _user_columns(user_mask, part.column, 0, part.size)
        return dense_attend(queries, keys, values, scale, mask)
    T, Tq = keys.shape[2], queries.shape[2]
    lo, hi = np.clip(part.lo - part.index, 0, T), np.clip(part.hi - part.index, 0, T)
    if not np.any(hi > lo):
        return None
    outs, lses = [], []
    for r0 in range(0, Tq, CHUNK_ROWS):
        r1 = min(Tq, r0 + CHUNK_ROWS)
        rows, row_lo, row_hi = queries[:, :, r0:r1], lo[..., r0:r1], hi[..., r0:r1]
        a, b = int(row_lo.min()), int(row_hi.max())
        visible, mask = rows_mask(a, b - a, row_lo, row_hi) if b > a else (False, None)
        if visible and user_mask is not None:
            window = _user_columns(user_mask, part.column, a, b, r0, r1)
            mask = window if mask is None else mask & window
        if visible:
            out, lse = dense_attend(rows, keys[:, :, a:b], values[:, :, a:b], scale, mask)
        else:
            out, lse = empty_part(rows, values.shape[-1])
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return mx.concatenate(outs, axis=2), mx.concatenate(lses, axis=2)


def attend(queries: mx.array, scale: float, parts: list[Part], config: CacheConfig, transform: KeyTransform, *,
           user_mask: mx.array | None = None, sink_logits: mx.array | None = None,
           on_device: bool = False) -> mx.array:
    """Attention of ``queries [B, H_q, T_q, D]`` over ``parts``, each query row over what its intervals give it.

    :param config: the layer's :class:`~kvq.cache.config.CacheConfig` (which implementation attends the codes).
    :param transform: the layer's :class:`~kvq.cache.centring.KeyTransform` (a centred or scaled layer's compressed
        keys are stored less its mean and divided by its scales).
    :param user_mask: mlx-lm's mask as booleans (batch padding) ``[..., T_q, columns]``, whose columns the parts'
        ``column`` locate; ``None``: the intervals alone.
    :param sink_logits: learned attention-sink logits ``[H_q]`` (gpt-oss), joined to the softmax, or ``None``.
    :param on_device: attend through :func:`kvq.cache.prefill.attend_dequantized` (a prefill chunk on a GPU; the
        parts must be contiguous: sinks, one compressed part, one dense part).
    :return: ``[B, H_q, T_q, D_v]`` in the queries' dtype (rows that see no token: zeros).
    :raises ValueError: queries whose head_dim is not the keys' or whose ``H_q`` is not a multiple of ``H_kv``, a
        compressed part no installed implementation can attend (:func:`kvq.cache.choice.attend_fn`), or a
        ``user_mask`` with a part whose ``column`` is ``None``.
    """
    if user_mask is not None and any(part.column is None for part in parts):
        raise ValueError("user_mask: every part must say where its columns sit on mlx-lm's mask (Part.column); a "
                         "rotating cache or packed rows take no mask array")
    if on_device:
        return attend_dequantized(queries, scale, parts, config, transform, user_mask, sink_logits)
    results = []
    for part in parts:
        if part.compressed:
            result = _compressed(part, queries, scale, config, transform, user_mask)
        else:
            result = _dense(part, queries, scale, user_mask)
        if result is not None:
            results.append(result)
    if sink_logits is not None:
        results.append(sink_logits_part(sink_logits, queries, results[0][0].shape[-1]))
    out, _ = merge_parts(results)
    return out.astype(queries.dtype)


def attend_rows(queries: mx.array, scale: float, rows: list, config: CacheConfig,
                transforms: list) -> list[tuple[list[int], mx.array]]:
    """A prefill chunk of a batch's rows on a GPU in as few calls as stack: ``queries [B, H_q, T_q, D]``, row ``b``
    over its own parts ``rows[b]`` (a :class:`~kvq.cache.parts.Part` list of ``B = 1``, what :func:`attend` with
    ``on_device`` would take for that row alone; ``None``: a row not offered) with its layer's
    :class:`~kvq.cache.centring.KeyTransform` ``transforms[b]``, every offered row under ``config``. Rows whose parts
    stack are grouped (:func:`kvq.cache.stacked.groups`: one structure of parts, the decoded copy within
    :data:`kvq.cache.stacked.STACKED_ROWS_BYTES`, rows of similar lengths), stacked along the batch
    (:func:`kvq.cache.stacked.stack`) and attended as one (:func:`kvq.cache.prefill.attend_dequantized`: one decode
    per side, one masked attention, one queue), each row seeing what it sees alone.

    Why: mlx-lm's ``BatchGenerator`` prefills its prompts as one batch; attended row by row, each row and layer
    built, encoded and queued its own decode, mask and attention call (issue #51).

    :return: ``(indices, out)`` per group: the batch rows attended (ascending) and their outputs ``[len(indices),
        H_q, T_q, D_v]`` in that order. Rows in no group (an empty list where none stack) attend alone.
    """
    out = []
    for group in stacked.groups(rows, queries.dtype):
        if group == list(range(group[0], group[-1] + 1)):
            rows_q = queries if len(group) == queries.shape[0] else queries[group[0] : group[-1] + 1]
        else:
            rows_q = queries[mx.array(group)]
        stacked_q, parts = stacked.stack(rows_q, [rows[i] for i in group], [transforms[i] for i in group])
        out.append((group, attend_dequantized(stacked_q, scale, parts, config, KeyTransform())))
    return out


def bind_decode(config: CacheConfig, queries: mx.array, scale: float, keys, values, sink_keys, sink_values,
                window_keys, window_values):
    """The bound decode step over a layer's compressed ``keys``/``values`` (:class:`kvq.Encoded`), its sinks
    (already centred and scaled for such a layer, whose ``queries`` are scaled too) and its window: the chosen attend implementation's
    :class:`kvq.contract.BindsDense` step, else a call of its ``attend_dense`` per step, else ``None`` (the parts
    are attended instead: the same result). ``step(queries, window_keys, window_values) -> [B, H_q, 1, D_v]``."""
    if not own_attend(config):
        return None
    choice = attend_plan(config, keys, queries).choices.get("attend")
    if choice is None:
        return None
    bind = optional_hook(choice.implementation, BindsDense)
    if bind is not None:
        step = bind(queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values)
        if step is not None:
            return step
    attend_dense = optional_hook(choice.implementation, AttendsDense)
    if attend_dense is None:
        return None

    def step(q, wk, wv):
        result = attend_dense(q, keys, values, scale, DenseTokens(sink_keys, sink_values, wk, wv))
        return None if result is None else result[0].astype(q.dtype)

    return step


def bind_ragged(config: CacheConfig, queries: mx.array, scale: float, keys, values, sink_keys, sink_values,
                window_keys, window_values):
    """:func:`bind_decode` for a batch's packed rows (:class:`kvq.contract.BindsRaggedDense`): ``step(queries,
    window_keys, window_values, lengths) -> [B, H_q, 1, D_v]``, ``lengths`` int32 ``[B, 2]`` each row's compressed
    and window tokens; ``None`` where the implementation binds none."""
    if not own_attend(config):
        return None
    choice = attend_plan(config, keys, queries).choices.get("attend")
    bind = None if choice is None else optional_hook(choice.implementation, BindsRaggedDense)
    if bind is None:
        return None
    return bind(queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values)
