"""A prefill chunk's attention on a GPU: MLX's fused attention over a transient decoded copy (issue #23).

:meth:`kvq.cache.KVQCache.attend` sends a chunk of many query rows here on a GPU. The compressed tokens of the layer
are decoded to the queries' dtype (the method's ``dequantize``, a fused kernel where one serves), joined with the
sinks and the chunk's uncompressed tokens, and attended in one ``mx.fast.scaled_dot_product_attention`` call with
an additive mask that gives every query row what a token-by-token run would have shown it
(:func:`chunk_mask`). The decoded copy is freed once the call has run: :class:`InFlight` keeps only a bounded
number of bytes of such copies queued on the device, so the cache never holds an fp16 copy of its tokens.

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

import mlx.core as mx


def chunk_mask(bounds: list[int], start_q: int, r0: int, r1: int, n_sinks: int, n_compressed: int, first: int,
               end: int, dtype: mx.Dtype, user_mask: mx.array | None = None,
               user_cols: mx.array | None = None) -> mx.array:
    """Additive mask (``0`` visible, ``finfo(dtype).min`` hidden) of query rows ``r0 .. r1`` of a chunk over the
    key columns ``[sinks | compressed | dense]`` (the first ``end`` of them).

    Query row ``r`` (position ``start_q + r``) sees the sinks before it, the first ``bounds[r]`` compressed tokens,
    and the dense columns (positions ``first, first + 1, ...``) from position ``n_sinks + bounds[r]`` up to its
    own. ``bounds`` never decreases, so the columns every row of the slice sees (the sinks, the first
    ``bounds[r0]`` compressed tokens) are written as zeros and only the rest is computed.

    :param bounds: per chunk row, the compressed tokens it sees (:meth:`KVQCache._visible`).
    :param user_mask: mlx-lm's mask as booleans (batch padding), ``[..., T_q, all columns]``, with ``user_cols``
        the position of each key column; ``None``: causality only.
    :return: ``[r1 - r0, end]`` (``[..., r1 - r0, end]`` with ``user_mask``) in ``dtype``.
    """
    dense_start = n_sinks + n_compressed
    always = 0
    if user_mask is None and start_q + r0 >= n_sinks:  # every row is past the sinks
        always = n_sinks + min(bounds[r0], n_compressed)
    col = mx.arange(always, end)[None]
    position = mx.where(col < n_sinks, col, mx.where(col < dense_start, col, first + col - dense_start))
    row_pos = mx.arange(start_q + r0, start_q + r1)[:, None]
    bound = mx.array(bounds[r0:r1])[:, None]
    visible = mx.where(col < n_sinks, position <= row_pos,
                       mx.where(col < dense_start, col - n_sinks < bound,
                                (position >= n_sinks + bound) & (position <= row_pos)))
    if user_mask is not None:
        rows_mask = user_mask[..., r0:r1, :] if user_mask.shape[-2] > 1 else user_mask
        visible = visible & mx.take(rows_mask, user_cols[:end], axis=-1)
    mask = mx.where(visible, mx.array(0, dtype), mx.array(mx.finfo(dtype).min, dtype))
    if always:
        mask = mx.concatenate([mx.zeros((r1 - r0, always), dtype), mask], axis=1)
    return mask


def rows_per_call(queries: mx.array, num_keys: int, mask_bytes: int, scores_bytes: int) -> int:
    """Query rows per attention call: bounded by ``mask_bytes`` of additive mask where MLX's fused attention
    serves (float16 or bfloat16 queries, head_dim at most 128), by ``scores_bytes`` of float32 scores where MLX
    materialises them. At least 16."""
    B, Hq, _, D = queries.shape
    if queries.dtype in (mx.float16, mx.bfloat16) and D <= 128:
        return max(16, mask_bytes // (num_keys * queries.dtype.size * B))
    return max(16, scores_bytes // (num_keys * Hq * B * 4))


class InFlight:
    """Layers' chunk attentions queued on the device with :func:`mlx.core.async_eval`, each with the bytes of
    transient buffers (decoded copy, mask) it holds until it has run.

    Evaluating every layer's attention at once (``mx.eval``) leaves the device idle while Python builds the next
    layer (on an H200 that cost a quarter of the prefill time at 32K); leaving them all lazy lets every layer's
    decoded copy exist at once (the peak of fp16's cache). This queues each layer and waits for the oldest only
    while more than ``budget`` bytes are queued, so the device always has the current layer and the memory above
    the cache stays below ``budget`` plus one layer's transient bytes.
    """

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[mx.array, int]] = collections.deque()
        self._bytes = 0

    def push(self, out: mx.array, nbytes: int, budget: int) -> None:
        """Queue ``out`` (a chunk attention holding ``nbytes`` of transients) and wait for older ones while more
        than ``budget`` bytes are queued."""
        marker = out[:1, :1, :1, :1].sum()  # done when out is; holds nothing of out once evaluated
        mx.async_eval(out, marker)
        self._queue.append((marker, nbytes))
        self._bytes += nbytes
        while self._bytes > budget and len(self._queue) > 1:
            oldest, size = self._queue.popleft()
            mx.eval(oldest)  # returns when that layer's attention has run and its transients are freed
            self._bytes -= size


#: The one queue of every kvq cache in the process (layers run one after another).
IN_FLIGHT = InFlight()
