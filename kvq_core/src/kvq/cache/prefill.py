"""A prefill chunk's attention on a GPU: fused attention over a transient decoded copy (issues #23, #51).

The attention engine (:mod:`kvq.cache.engine`) sends a chunk of many query rows here on a GPU. The compressed
tokens of the layer are decoded to the queries' dtype (the method's ``dequantize``, a fused kernel where one
serves), joined with the sinks and the chunk's uncompressed tokens (decoded straight into the joined columns where
the implementation can: :func:`columns`), and attended in one
``mx.fast.scaled_dot_product_attention`` call with an additive mask made from the parts' per-row intervals
(:func:`interval_mask`): every query row sees what a token-by-token run would have shown it. Where a kernel
implementation of the key method attends columns itself (:class:`kvq.contract.AttendsColumns`: kvq_metal's
tensor-core prefill kernel on CUDA, once its knob is on), it gets the intervals instead (:func:`column_intervals`)
and no mask is made (one set of intervals for the batch: stacked rows of different lengths,
:mod:`kvq.cache.stacked`, take the mask). The decoded copy is freed once the call has run: :class:`InFlight` keeps
at most two layers' copies on the device, so the cache never holds an fp16 copy of its tokens.

Two facts about MLX 0.32's attention on CUDA shape this module (measured on an H200, ``benchmarks/prefill_parts.py``):
a boolean mask is expanded by MLX to ``[B, H_q, T_q, keys]`` before the fused kernel (8x slower than causal
attention at 32K keys, 4.5 GB per layer), while an additive mask in the queries' dtype reaches cuDNN as a
broadcast bias (1.84-1.92x causal at 8K-128K held tokens, and still 1.5x for a mask of one row broadcast over all
rows: cuDNN's kernel with a bias costs that, not the mask's bytes; ``benchmarks/prefill_masks.py``); and float32
queries or head_dim above 128 have no fused kernel (MLX materialises ``rows x keys x H_q`` float32 scores), so those
calls are cut into slices of rows.
"""

from __future__ import annotations

import collections
import threading
import time

import mlx.core as mx
import numpy as np

from .choice import columns_attention, dequantize, dequantize_into


#: Bytes of one call's additive mask (query rows x keys, in the queries' dtype) in :func:`attend_dequantized`; a larger
#: chunk is attended in slices of rows.
PREFILL_MASK_BYTES = 1 << 30
#: Bytes of attention scores one call may materialise where MLX has no fused attention for the chunk (float32, or
#: head_dim above 128, on CUDA: MLX computes rows x keys x query heads scores, float32 for the softmax).
PREFILL_SCORES_BYTES = 1 << 29


#: Bytes of the masks one forward pass keeps to share (:func:`shared_interval_mask`): beyond them the least recently
#: used are dropped (made again if asked for again), never the one just made. A batch whose rows attend in groups
#: (:mod:`kvq.cache.stacked`, or alone) asks for one mask per group: 8 rows of 2,048 tokens make one of about 75 MB.
SHARED_MASK_BYTES = 1 << 28


class _Shared(threading.local):
    """What the layers of the current forward pass shared (:func:`shared_interval_mask`, :func:`shared_intervals`),
    per thread: ``chunks`` by :func:`_chunk_key`, the most recently used last, each ``{"intervals": its
    :func:`column_intervals` on the device or None, "masks": its whole-chunk masks by (end, dtype)}``; ``None``
    while there are none."""

    chunks: collections.OrderedDict | None = None


_SHARED = _Shared()


def after_chunk() -> None:
    """Called by every single-token attention of a kvq cache (a decode step), and by every kvq cache's
    ``make_mask``, which mlx-lm's models call once per forward pass before their layers run
    (``create_attention_mask``): drops the last pass's shared arrays the first time (:func:`release_shared_mask`;
    their calls are queued, which keeps what they read); otherwise one attribute read."""
    if _SHARED.chunks is not None:
        release_shared_mask()


def release_shared_mask() -> None:
    """Drop what the layers of the last pass shared (:func:`shared_interval_mask`): the next pass does
    (:func:`after_chunk`), and ``kvq bench``'s measurements between rows."""
    _SHARED.chunks = None


def _chunk_key(parts: list, rows: int) -> tuple:
    """What a chunk's intervals (and so its masks, given the columns and dtype) are a function of: its rows and each
    part's size, index and rows' intervals (arrays as bytes: equal tuples, equal intervals)."""
    def ints(x):
        return (x.shape, x.tobytes()) if isinstance(x, np.ndarray) else x

    return rows, tuple((p.size, ints(p.index), ints(p.lo), ints(p.hi)) for p in parts)


def _shared(parts: list, rows: int) -> dict:
    """The shared arrays of the chunk of ``parts`` (``rows`` rows), made empty where there are none, marked as the
    most recently used."""
    key = _chunk_key(parts, rows)
    if _SHARED.chunks is None:
        _SHARED.chunks = collections.OrderedDict()
    entry = _SHARED.chunks.get(key)
    if entry is None:
        entry = _SHARED.chunks[key] = {"intervals": None, "masks": {}}
    _SHARED.chunks.move_to_end(key)
    return entry


def shared_interval_mask(parts: list, rows: int, end: int, dtype: mx.Dtype) -> mx.array:
    """:func:`interval_mask` of all ``rows`` of a chunk (no mask of mlx-lm's), made once per forward pass and shared
    by the layers that ask for the same one: every layer of a model whose caches hold the same numbers of tokens sees
    its chunk's rows through the same intervals, so the second layer on reuses the first one's array (the device
    makes it once, the host builds it once: ``benchmarks/results/prefill/2026-12-07-h100-*`` found the host setting
    a prefill's pace at 8K). A batch whose rows attend in groups reuses each group's. The masks are kept, for the
    thread that made them, until the next forward pass or decode step (:func:`after_chunk`) or
    :func:`release_shared_mask`, within :data:`SHARED_MASK_BYTES` (the least recently used dropped first, never the
    one just made); they replace the layers' transient masks :class:`InFlight` allowed before."""
    entry = _shared(parts, rows)
    mask = entry["masks"].get((end, dtype))
    if mask is None:
        mask = entry["masks"][end, dtype] = interval_mask(parts, 0, rows, end, dtype)
        held = sum(m.nbytes for e in _SHARED.chunks.values() for m in e["masks"].values())
        for key in [k for k, e in _SHARED.chunks.items() if e is not entry]:  # oldest first
            if held <= SHARED_MASK_BYTES:
                break
            held -= sum(m.nbytes for m in _SHARED.chunks.pop(key)["masks"].values())
    return mask


def shared_intervals(parts: list, rows: int) -> mx.array:
    """:func:`column_intervals` of all ``rows`` of a chunk on the device (int32 ``[rows, len(parts), 2]``), made once
    per forward pass and shared as :func:`shared_interval_mask` is."""
    entry = _shared(parts, rows)
    if entry["intervals"] is None:
        entry["intervals"] = mx.array(column_intervals(parts, 0, rows))
    return entry["intervals"]


def interval_mask(parts: list, r0: int, r1: int, end: int, dtype: mx.Dtype, user_mask: mx.array | None = None,
                  user_cols: mx.array | None = None) -> mx.array:
    """Additive mask (``0`` visible, ``finfo(dtype).min`` hidden) of query rows ``r0 .. r1`` over the first ``end``
    columns of ``parts`` laid side by side (contiguous parts: :class:`kvq.cache.parts.Part`), from the parts'
    intervals (:func:`kvq.cache.parts.visible`, in the columns' form of :func:`column_intervals`).

    Built from each row's interval per part by one function compiled with ``mx.compile`` (shapeless; with
    ``user_mask`` only the intervals' test is compiled, then joined with it; where MLX cannot compile on the CPU the
    same ops run one by one). Built as separate MLX ops (comparisons in int64, their union, the select, joined to
    the zeros of the columns every row sees), the mask took 0.3-0.6 ms of GPU time per layer and chunk of 2,048 rows
    at 8K-32K held tokens on an H100, 12-42% of what the chunk's attention costs above fp16's
    (``benchmarks/results/prefill/2026-12-06-h100-chunk-kernels``).

    :param user_mask: mlx-lm's mask as booleans (batch padding), ``[..., T_q, all columns]``, with ``user_cols`` the
        position of each key column; ``None``: the intervals alone.
    :return: ``[r1 - r0, end]`` (``[..., r1 - r0, end]`` with ``user_mask``; ``[B, 1, r1 - r0, end]`` for parts with
        per-batch-row intervals, a batch's stacked rows of different lengths: :mod:`kvq.cache.stacked`) in ``dtype``.
    :raises ValueError: per-batch-row intervals with a ``user_mask``.
    """
    intervals = column_intervals(parts, r0, r1)
    if intervals.ndim == 4 and user_mask is not None:
        raise ValueError("user_mask: parts with per-batch-row intervals take no mask of mlx-lm's")
    batch = intervals.shape[:-3]  # () or (B,)
    if end == 0:  # (a shapeless compiled function would broadcast the empty columns against the bounds' one)
        lead = (batch[0], 1) if batch else () if user_mask is None else user_mask.shape[:-2]
        return mx.zeros((*lead, r1 - r0, 0), dtype)
    flat = intervals.reshape(-1, *intervals.shape[-2:])  # [B * rows, parts, 2]: one compiled form for both
    bounds = [mx.array(np.ascontiguousarray(flat[:, p, i : i + 1])) for p in range(len(parts)) for i in (0, 1)]
    columns = mx.arange(end, dtype=mx.int32)
    hidden = mx.array(mx.finfo(dtype).min, dtype)
    if user_mask is None:
        mask = _interval_mask(columns, mx.array(0, dtype), hidden, *bounds)
        return mask if not batch else mask.reshape(batch[0], 1, r1 - r0, end)
    rows_mask = user_mask[..., r0:r1, :] if user_mask.shape[-2] > 1 else user_mask
    shown = _interval_shown(columns, *bounds) & mx.take(rows_mask, user_cols[:end], axis=-1)
    return mx.where(shown, mx.array(0, dtype), hidden)


def _shown(columns: mx.array, *bounds: mx.array) -> mx.array:
    """Whether each row sees each column: ``columns`` int32 ``[n]``, ``bounds`` ``lo, hi`` int32 ``[rows, 1]`` per
    part (:func:`column_intervals`); bool ``[rows, n]``."""
    shown = None
    for lo, hi in zip(bounds[::2], bounds[1::2]):
        inside = (columns >= lo) & (columns < hi)
        shown = inside if shown is None else shown | inside
    return shown


_interval_shown = mx.compile(_shown, shapeless=True)
_interval_mask = mx.compile(lambda columns, visible, hidden, *bounds: mx.where(_shown(columns, *bounds), visible,
                                                                               hidden), shapeless=True)


def column_intervals(parts: list, r0: int, r1: int) -> np.ndarray:
    """Each of rows ``r0 .. r1``'s visible columns of ``parts`` laid side by side, as one ``[lo, hi)`` interval per
    part: int32 ``[r1 - r0, len(parts), 2]`` (an empty interval where a row sees none of a part); ``[B, r1 - r0,
    len(parts), 2]`` where a part has per-batch-row intervals (``[B, T_q]``: a batch's stacked rows,
    :mod:`kvq.cache.stacked`). The same rule as :func:`interval_mask` (:func:`kvq.cache.parts.visible` per part), in
    the form a kernel that computes visibility itself reads (:func:`kvq_metal.prefill.prefill_attend`'s
    ``intervals``).

    :param parts: contiguous :class:`kvq.cache.parts.Part` objects (an int ``index``), in order.
    """
    out = np.zeros((*_row_batch(parts), r1 - r0, len(parts), 2), np.int32)
    first = 0
    for p, part in enumerate(parts):
        if part.lo is None:
            out[..., p, :] = (first, first + part.size)
        else:
            out[..., p, 0] = first + np.clip(part.lo[..., r0:r1] - part.index, 0, part.size)
            out[..., p, 1] = first + np.clip(part.hi[..., r0:r1] - part.index, 0, part.size)
        first += part.size
    return out


def _row_batch(parts: list) -> tuple:
    """``(B,)`` where a part's intervals are per batch row (``[B, T_q]``: a batch's stacked rows of different
    lengths), else ``()``."""
    return next((p.lo.shape[:1] for p in parts if p.lo is not None and p.lo.ndim == 2), ())


def attend_dequantized(queries: mx.array, scale: float, parts: list, config, transform, user_mask=None,
                       sink_logits=None) -> mx.array:
    """A chunk's attention over ``parts`` (:class:`kvq.cache.parts.Part`: contiguous, in order; the compressed one
    decoded to the queries' dtype): in one call of a kernel implementation's attention over columns where one
    serves (:class:`kvq.contract.AttendsColumns`, given :func:`column_intervals`; no mask array; not for parts whose
    intervals are per batch row, a batch's stacked rows of different lengths, nor with ``user_mask``), else in
    ``mx.fast.scaled_dot_product_attention`` with the additive mask of :func:`interval_mask`, one call per chunk
    unless :func:`rows_per_call` cuts it. Each slice of rows reads only the columns up to the last one its rows may
    see. The decoded copy is transient: the call is queued on the device
    (:data:`IN_FLIGHT`) and the copy freed once it has run; the cache keeps only the codes. Memory above the cache:
    two layers' ``T * H_kv * (D_k + D_v) * 2`` bytes of decoded keys and values (twice that where the parts are
    concatenated, :func:`columns`; for a batch's stacked rows, a group's:
    :data:`kvq.cache.stacked.STACKED_ROWS_BYTES`) and ``T_q * T * 2`` bytes of mask (16-bit queries; times the
    batch where each batch row has its own intervals), for ``T`` tokens held.

    A centred or scaled layer attends its keys as stored throughout (as the fused decode kernel does), with scaled
    queries: every score lacks the same ``scale * q . mu``, which the softmax does not see, and 16-bit centred keys
    keep the bits that 16-bit keys with offsets in the hundreds lose. Learned sink logits would see the shift: then
    the mean and scales go back on the keys.

    :param config, transform: the layer's configuration and :class:`kvq.cache.centring.KeyTransform`.
    :param user_mask: mlx-lm's mask as booleans over the parts' ``column`` positions, or ``None``.
    :return: ``[B, H_q, T_q, D_v]`` in the queries' dtype.
    """
    Tq, dtype = queries.shape[2], queries.dtype
    centre = transform.active and sink_logits is None
    keys, values, user_cols = columns(parts, config, transform, dtype, centre, user_mask is not None)
    if centre:
        queries = transform.queries(queries)
    per_batch_row = user_mask is not None or bool(_row_batch(parts))
    # a kernel reads one set of intervals for the batch: no mask of mlx-lm's, no rows of their own
    hooks = [] if per_batch_row else columns_attention(config)
    intervals = shared_intervals(parts, Tq) if hooks else None
    for hook in hooks:  # a kernel that reads the intervals itself makes no mask (issue #51)
        out = hook(queries, keys, values, intervals, scale, sink_logits)
        if out is not None:
            IN_FLIGHT.push(out)
            return out
    sinks = None if sink_logits is None else sink_logits.astype(dtype)
    rows = rows_per_call(queries, keys.shape[2], PREFILL_MASK_BYTES, PREFILL_SCORES_BYTES, per_batch_row)
    outs = []
    for r0 in range(0, Tq, rows):
        r1 = min(Tq, r0 + rows)
        end = last_column(parts, r0, r1)
        if user_mask is None and r1 - r0 == Tq:  # the whole chunk in one call: the layers share its mask
            mask = shared_interval_mask(parts, Tq, end, dtype)
        else:  # a mask of its own: the pass's shared ones (up to SHARED_MASK_BYTES) are not kept beside it
            release_shared_mask()
            mask = interval_mask(parts, r0, r1, end, dtype, user_mask, user_cols)
        outs.append(mx.fast.scaled_dot_product_attention(queries[:, :, r0:r1], keys[:, :, :end], values[:, :, :end],
                                                         scale=scale, mask=mask, sinks=sinks))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    IN_FLIGHT.push(out)
    return out


def columns(parts: list, config, transform, dtype: mx.Dtype, centre: bool, user: bool = False) -> tuple:
    """The key and value columns of ``parts`` side by side in ``dtype``, ``[B, H_kv, columns, D]`` each (the
    compressed part decoded by the implementation :func:`kvq.select` picks: a fused kernel where one serves); with
    ``centre``, keys as the layer stores them (less its mean, divided by its scales), else as the model gave them. With
    ``user``, also each column's position on mlx-lm's mask (the parts' ``column``), else ``None``.

    Where the decoding implementation offers :class:`kvq.contract.DequantizesInto`, the compressed part is decoded
    straight into the joined arrays and the other parts written around it in place (:func:`_joined_in_place`);
    else each part is decoded or cast on its own and the parts concatenated. The same columns either way, within one
    rounding of ``dtype`` where a kernel decodes what pure MLX would have."""
    user_cols = mx.concatenate([p.column + mx.arange(p.size) for p in parts]) if user else None
    joined = _joined_in_place(parts, config, transform, dtype, centre)
    if joined is not None:
        return (*joined, user_cols)
    parts_k, parts_v = [], []
    for part in parts:
        if part.compressed:
            keys = dequantize(config, config.key_params, part.keys, dtype)
            keys = keys if centre else transform.uncentred(keys)
            values = dequantize(config, config.value_params, part.values, dtype)
        else:
            keys, values = _dense_columns(part, transform, dtype, centre)
        parts_k.append(keys)
        parts_v.append(values)
    return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2), user_cols


def _dense_columns(part, transform, dtype: mx.Dtype, centre: bool) -> tuple:
    """An uncompressed part's keys (centred where ``centre``) and values in ``dtype``."""
    keys = transform.centred_dense(part.keys) if centre else part.keys
    return keys.astype(dtype), part.values.astype(dtype)


def _joined_in_place(parts: list, config, transform, dtype: mx.Dtype, centre: bool) -> tuple | None:
    """:func:`columns`' keys and values with the one compressed part decoded into arrays that leave room for the
    parts around it (:func:`kvq.cache.choice.dequantize_into`), which are then written in place (MLX slice
    assignment on an array nothing else holds reuses its buffer). ``None`` where this does not serve: no
    compressed part or more than one, decoded keys that must be uncentred, or a side whose implementation lacks
    the hook."""
    compressed = [i for i, part in enumerate(parts) if part.compressed]
    if len(compressed) != 1 or (transform.active and not centre):
        return None
    (c,) = compressed
    before, after = sum(p.size for p in parts[:c]), sum(p.size for p in parts[c + 1:])
    keys = dequantize_into(config, config.key_params, parts[c].keys, dtype, before, after)
    values = None if keys is None else dequantize_into(config, config.value_params, parts[c].values, dtype,
                                                          before, after)
    if values is None:
        return None
    first = 0
    for i, part in enumerate(parts):
        if i != c:
            keys[:, :, first : first + part.size], values[:, :, first : first + part.size] = \
                _dense_columns(part, transform, dtype, centre)
        first += part.size
    return keys, values


def last_column(parts: list, r0: int, r1: int) -> int:
    """One past the last column of ``parts`` (side by side) that any of rows ``r0 .. r1`` sees (the last part's
    interval of the slice's last row, of any batch row where each has its own: every row sees its own token, in the
    last part)."""
    first = sum(p.size for p in parts[:-1])
    last = parts[-1]
    if last.lo is None:
        return first + last.size
    return first + int(np.clip(last.hi[..., r1 - 1] - last.index, 0, last.size).max())


def rows_per_call(queries: mx.array, num_keys: int, mask_bytes: int, scores_bytes: int,
                  per_batch_row: bool = True) -> int:
    """Query rows per attention call: bounded by ``mask_bytes`` of additive mask where MLX's fused attention
    serves (float16 or bfloat16 queries, head_dim at most 128), by ``scores_bytes`` of float32 scores where MLX
    materialises them. At least 16. ``per_batch_row``: the mask has a row per batch row (mlx-lm's mask of a padded
    batch, a batch's stacked rows of different lengths); else it is one ``[rows, keys]`` array broadcast over the
    batch (the intervals alone: stacked rows that agree, :mod:`kvq.cache.stacked`), whose bytes do not grow with
    it."""
    B, Hq, _, D = queries.shape
    if queries.dtype in (mx.float16, mx.bfloat16) and D <= 128:
        return max(16, mask_bytes // (num_keys * queries.dtype.size * (B if per_batch_row else 1)))
    return max(16, scores_bytes // (num_keys * Hq * B * 4))


class InFlight:
    """The layers' chunk attentions queued on the device with :func:`mlx.core.async_eval`: each layer's is queued
    and the one before it waited for, so the device runs layer ``n`` while the host builds layer ``n + 1``, and at
    most two layers' transient buffers (decoded copy, mask) exist at once.

    Evaluating each layer's attention before building the next (``mx.eval``) leaves the device idle while Python
    builds (on an H200 that cost a quarter of the prefill time at 32K); leaving them all lazy lets every layer's
    decoded copy exist at once (the peak of fp16's cache). Until 2026-12-06 up to 512 MB of layers were queued:
    deeper than the overlap needs, and on a small model above what kvq saves (4 layers of 8 KV heads, fp16 KV of
    268 MB at 8K: kvq's prefill peak 417-552 MB against 412 MB for mlx-lm's KVCache on an H100,
    ``tests/test_cache_memory.py``). A deeper queue only helps where the host's build of a layer sometimes takes
    longer than the device's run of one.

    :attr:`waited` adds up the seconds the host spends waiting in :meth:`push` (``kvq bench prefill`` reports it):
    near zero, the device had run each layer before the host had built the next, so the host set the pace.
    """

    def __init__(self) -> None:
        self._last: mx.array | None = None
        #: Seconds spent in :meth:`push` waiting for the layer queued before (``time.perf_counter``), since creation.
        self.waited = 0.0

    def push(self, out: mx.array) -> None:
        """Queue ``out`` (a layer's chunk attention) and wait for the one queued before it."""
        marker = out[:1, :1, :1, :1].sum()  # done when out is; holds nothing of out once evaluated
        mx.async_eval(out, marker)
        last, self._last = self._last, marker
        if last is not None:
            tic = time.perf_counter()
            mx.eval(last)  # returns when that layer's attention has run and its transients are freed
            self.waited += time.perf_counter() - tic


#: The one queue of every kvq cache in the process (layers run one after another).
IN_FLIGHT = InFlight()
