"""Attention over parts of a cache, with log-sum-exp merging (FlashAttention-style online softmax).

The cache splits a layer's tokens into parts (sinks, compressed blocks, residual window). Each part is
attended on its own, returning ``(out, lse)``; :func:`merge_parts` combines them exactly. Within a part,
:func:`blockwise_attend` walks the keys in blocks with an online softmax, so that neither an fp16 copy of
compressed keys nor the full ``[T_q, T]`` score matrix of a long prefill chunk is ever materialised.
GQA is handled by reshaping queries to ``[B, H_kv, n_rep, T_q, D]``; keys and values are never repeated.

Memory: a block spans at most :data:`SCORE_BUDGET_BYTES` of float32 scores and, where the caller says how many
bytes a token's float32 key and value take (``token_bytes``), at most :data:`VECTOR_BUDGET_BYTES` of them (at
least 256 keys either way). Attention over stored tokens (:func:`attend_encoded`), and any attention over more
than one block, starts its blocks on the device one at a time, each after the block started before it by any
call (:func:`run_block`), so the peak above the inputs is one block's working set (its decoded data, scores and
probabilities) plus the ``[B, H_q, T_q, D_v]`` accumulators, whatever the number of keys or layers.

Source: Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018); Dao et al.,
FlashAttention (2022).
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

from .contract import DenseTokens, FinishesValues, PreparesQueries, ScoresKeys, WeightsValues, optional_hook

#: Bytes of fp32 scores one block may hold; bounds prefill memory.
SCORE_BUDGET_BYTES = 16 * 2**20
#: Bytes of float32 keys and values one block may span (``4 · B · H_kv · (D_k + D_v)`` per token): the unit in
#: which each implementation states its per-block working set (decoded vectors, unpacked codes), so this bounds
#: decode memory, where the scores of one query row are small. At 32K tokens with 8 KV heads of head_dim 128
#: (8 KiB a token), blocks of 4096 tokens.
VECTOR_BUDGET_BYTES = 32 * 2**20
NEG_INF = float("-inf")
#: A marker of the block :func:`run_block` started last (done when that block is), or nothing.
_LAST_BLOCK: list[mx.array] = []


def block_size_for(batch: int, num_q_heads: int, num_queries: int, num_keys: int, token_bytes: int = 0) -> int:
    """Keys per block: a power of two (at least 256, at most ``num_keys``) such that one block of fp32 scores fits
    :data:`SCORE_BUDGET_BYTES` and, for ``token_bytes > 0`` (a token's float32 key and value over all batch rows
    and KV heads: :func:`token_bytes_of`), one block's vectors fit :data:`VECTOR_BUDGET_BYTES`."""
    per_key = 4 * batch * num_q_heads * max(num_queries, 1)
    size = SCORE_BUDGET_BYTES // per_key
    if token_bytes > 0:
        size = min(size, VECTOR_BUDGET_BYTES // token_bytes)
    size = max(256, size)
    return min(max(num_keys, 1), 1 << (size.bit_length() - 1))


def token_bytes_of(batch: int, num_kv_heads: int, key_dim: int, value_dim: int) -> int:
    """Bytes of one token's float32 key and value over all batch rows and KV heads: ``4 · B · H_kv · (D_k +
    D_v)``, the ``token_bytes`` of :func:`block_size_for` and :func:`blockwise_attend`."""
    return 4 * batch * num_kv_heads * (key_dim + value_dim)


def check_query_dim(queries: mx.array, head_dim: int) -> None:
    """:raises ValueError: ``queries`` whose last axis is not the keys' ``head_dim`` (named here rather than as a
    matrix product's shape error from inside a block)."""
    if queries.shape[-1] != head_dim:
        raise ValueError(f"queries: head_dim {queries.shape[-1]} does not match the keys' {head_dim}")


def split_heads(queries: mx.array, num_kv_heads: int) -> mx.array:
    """``[B, H_q, T_q, D]`` -> ``[B, H_kv, n_rep, T_q, D]`` (GQA grouping, no copy of keys needed).

    :raises ValueError: ``H_q`` not a multiple of ``num_kv_heads``.
    """
    B, Hq, Tq, D = queries.shape
    if Hq % num_kv_heads:
        raise ValueError(f"queries: H_q={Hq} must be a multiple of the keys' H_kv={num_kv_heads}")
    return queries.reshape(B, num_kv_heads, Hq // num_kv_heads, Tq, D)


def split_mask(mask: mx.array | None, num_kv_heads: int) -> mx.array | None:
    """A boolean mask broadcastable to ``[B, H_q, T_q, T]`` -> broadcastable to ``[B, H_kv, n_rep, T_q, T]``."""
    if mask is None:
        return None
    if mask.dtype != mx.bool_:
        raise TypeError(f"mask must be boolean (True = may attend); got {mask.dtype}")
    while mask.ndim < 4:
        mask = mask[None]
    B, H, Tq, T = mask.shape
    if H == 1:
        return mask[:, :, None]
    return mask.reshape(B, num_kv_heads, H // num_kv_heads, Tq, T)


def blockwise_attend(
    queries: mx.array,
    num_keys: int,
    num_kv_heads: int,
    scores_fn: Callable[[mx.array, int, int], mx.array],
    values_fn: Callable[[mx.array, int, int], mx.array],
    scale: float,
    mask: mx.array | None = None,
    block_size: int | None = None,
    prepare: Callable[[mx.array], mx.array] | None = None,
    finish: Callable[[mx.array], mx.array] | None = None,
    token_bytes: int = 0,
    one_at_a_time: bool = False,
) -> tuple[mx.array, mx.array]:
    """Online-softmax attention over ``num_keys`` keys served block by block.

    Memory: blocks of ``block_size`` keys (default :func:`block_size_for`, with ``token_bytes``), started one at a
    time (:func:`run_block`) where there is more than one or ``one_at_a_time`` is set; the peak above the inputs
    is then what ``scores_fn`` and ``values_fn`` hold for one block (their working set) plus its float32 scores
    and probabilities and the float32 ``[B, H_q, T_q, D_v]`` accumulators, independent of ``num_keys``.

    :param queries: ``[B, H_q, T_q, D]`` float.
    :param scores_fn: ``(q, start, stop) -> [B, H_kv, n_rep, T_q, stop - start]`` float32 scores, where ``q``
        is the scaled float32 query ``[B, H_kv, n_rep, T_q, D]``.
    :param values_fn: ``(p, start, stop) -> [B, H_kv, n_rep, T_q, D_v]`` float32: ``p @ V[start:stop]``
        for unnormalised probabilities ``p`` (float32, same layout as the scores).
    :param mask: boolean, broadcastable to ``[B, H_q, T_q, num_keys]`` (``True`` = may attend), or ``"causal"``
        (the queries are the last ``T_q`` of the ``num_keys`` positions).
    :param prepare: applied once to the scaled, grouped query before the loop (e.g. a rotation); ``scores_fn``
        then receives its result.
    :param finish: applied once to the normalised ``[B, H_kv, n_rep, T_q, D_v]`` output (e.g. the inverse
        rotation of values accumulated in a rotated domain).
    :param token_bytes: bytes of one token's float32 key and value (:func:`token_bytes_of`); bounds the default
        block size by :data:`VECTOR_BUDGET_BYTES` (0: scores alone bound it).
    :param one_at_a_time: start even a single block through :func:`run_block` (attention over stored tokens,
        whose blocks decode data: otherwise the device may hold every layer's block at once).
    :return: ``(out [B, H_q, T_q, D_v] float32, lse [B, H_q, T_q] float32)``; ``lse = -inf``, ``out = 0``
        for queries that see no key.
    """
    B, Hq, Tq, _ = queries.shape
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or a boolean array; got {mask!r}")
        # the queries are the last T_q positions of the num_keys keys (mlx-lm's convention)
        mask = mx.arange(num_keys - Tq, num_keys)[:, None] >= mx.arange(num_keys)[None]
    q = split_heads(queries.astype(mx.float32) * scale, num_kv_heads)
    q = prepare(q) if prepare is not None else q
    mask = split_mask(mask, num_kv_heads)
    block_size = block_size or block_size_for(B, Hq, Tq, num_keys, token_bytes)
    m = l = acc = None
    one_at_a_time = one_at_a_time or num_keys > block_size
    for start in range(0, num_keys, block_size):
        stop = min(start + block_size, num_keys)
        s = scores_fn(q, start, stop)
        if mask is not None:
            s = mx.where(mask[..., start:stop], s, NEG_INF)
        block_max = mx.max(s, axis=-1, keepdims=True)
        m_new = block_max if m is None else mx.maximum(m, block_max)
        # a row that has seen only masked keys keeps m = -inf; exponentiate against 0 there
        m_safe = mx.where(m_new == NEG_INF, 0.0, m_new)
        p = mx.exp(s - m_safe)
        pv = values_fn(p, start, stop)
        if m is None:
            l, acc = p.sum(axis=-1, keepdims=True), pv
        else:
            correction = mx.exp(m - m_safe)
            l = l * correction + p.sum(axis=-1, keepdims=True)
            acc = acc * correction + pv
        m = m_new
        if one_at_a_time:
            run_block((m, l, acc))
    if m is None:  # no keys at all
        return empty_part(queries, queries.shape[-1])
    seen = l > 0
    out = acc / mx.where(seen, l, 1.0)
    out = finish(out) if finish is not None else out
    lse = mx.where(seen, m + mx.log(mx.where(seen, l, 1.0)), NEG_INF)
    Dv = out.shape[-1]
    return out.reshape(B, Hq, Tq, Dv), lse.reshape(B, Hq, Tq)


def run_block(state: tuple[mx.array, ...]) -> None:
    """Start one block's running state ``state`` (its ``m, l, acc`` arrays) on the device, after waiting for the
    block started before it by any attention call (this call's previous block, or the previous layer's last).

    Left lazy, blocks do not depend on one another's decoding (only their accumulation does), so MLX schedules
    several together (on the CPU, turboquant over 16 blocks of 512 tokens held 4.7x one block's working set),
    and a GPU, which frees buffers only once the work that used them has run, can hold the working data of every
    block and layer it has been handed but not finished (on an H200 at 32K tokens, with the whole context in one
    block, decode peaked at 12.8 GB above a 1.2 GB ``turboquant_prod`` cache: several layers' worth). Here the
    device runs one block while Python builds the next, and no two blocks' working sets exist at once. The cost:
    one wait per block. Not for use under ``mx.compile`` or a function transform (it evaluates).

    :param state: the online-softmax state after the block: running max ``m`` and sum ``l`` (float32
        ``[B, H_kv, n_rep, T_q, 1]``) and accumulator ``acc`` (float32 ``[B, H_kv, n_rep, T_q, D_v]``).
    """
    # one element of each: done when all of them are, and holding nothing of them once evaluated
    marker = sum(a.reshape(-1)[:1] for a in state)
    if _LAST_BLOCK:
        mx.eval(_LAST_BLOCK.pop())  # started already: this only waits for it
    mx.async_eval(*state, marker)
    _LAST_BLOCK.append(marker)


def empty_part(queries: mx.array, value_dim: int) -> tuple[mx.array, mx.array]:
    """``(out, lse)`` of a part with no keys: zeros and ``-inf``."""
    B, Hq, Tq, _ = queries.shape
    return mx.zeros((B, Hq, Tq, value_dim), mx.float32), mx.full((B, Hq, Tq), NEG_INF, mx.float32)


def dense_attend(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | None = None,
    block_size: int | None = None,
    one_at_a_time: bool = False,
) -> tuple[mx.array, mx.array]:
    """:func:`blockwise_attend` over uncompressed keys ``[B, H_kv, T, D]`` and values ``[B, H_kv, T, D_v]``.

    Scores and accumulation are float32 whatever the input dtype (key norms of several hundred overflow
    fp16 products). Memory above the inputs: one block's float32 copies of its keys and values (at most 2 each,
    of a block of :data:`VECTOR_BUDGET_BYTES`, or 256 tokens) plus its scores; ``one_at_a_time`` as
    :func:`blockwise_attend` (a cache's window and sinks, a few tokens, leave it off).
    """
    B, Hkv, T = keys.shape[:3]

    def scores_fn(q, start, stop):
        k = keys[:, :, None, start:stop].astype(mx.float32)
        return q @ k.swapaxes(-1, -2)

    def values_fn(p, start, stop):
        return p @ values[:, :, None, start:stop].astype(mx.float32)

    return blockwise_attend(queries, T, Hkv, scores_fn, values_fn, scale, mask, block_size,
                            token_bytes=token_bytes_of(B, Hkv, keys.shape[-1], values.shape[-1]),
                            one_at_a_time=one_at_a_time)


def merge_parts(parts: Sequence[tuple[mx.array, mx.array]]) -> tuple[mx.array, mx.array]:
    """Exact softmax over the union of the parts' keys, from each part's ``(out, lse)``.

    :param parts: ``(out [B, H_q, T_q, D_v], lse [B, H_q, T_q])`` pairs, as returned by an ``attend``.
    :return: merged ``(out, lse)``; rows that no part attends give ``out = 0`` and ``lse = -inf``.
    """
    lses = mx.stack([lse for _, lse in parts])
    top = mx.max(lses, axis=0)
    top_safe = mx.where(top == NEG_INF, 0.0, top)
    weights = mx.exp(lses - top_safe)  # [P, B, H, Tq]
    total = weights.sum(axis=0)
    out = sum(w[..., None] * o for w, (o, _) in zip(weights, parts))
    seen = total > 0
    out = out / mx.where(seen, total, 1.0)[..., None]
    lse = mx.where(seen, top_safe + mx.log(mx.where(seen, total, 1.0)), NEG_INF)
    return out, lse


def sink_logits_part(sink_logits: mx.array, queries: mx.array, value_dim: int) -> tuple[mx.array, mx.array]:
    """Learned attention-sink logits (gpt-oss: one logit per query head that joins the softmax normaliser and has
    no value) as a part. Not the cache's sinks, which are its first tokens kept uncompressed.

    :param sink_logits: ``[H_q]`` logits (mlx-lm passes them to its attention as ``sinks=``).
    """
    B, Hq, Tq, _ = queries.shape
    lse = mx.broadcast_to(sink_logits.astype(mx.float32)[None, :, None], (B, Hq, Tq))
    return mx.zeros((B, Hq, Tq, value_dim), mx.float32), lse


def attend_encoded(
    queries: mx.array,
    keys,
    values,
    scale: float,
    mask: mx.array | None,
    key_impl,
    value_impl,
    block_size: int | None = None,
) -> tuple[mx.array, mx.array]:
    """Attention over :class:`kvq.Encoded` keys and values that may come from different methods.

    Each side uses its implementation's block protocol where it has one, and otherwise decodes one block at a
    time with ``kvq_dequantize`` (never the whole cache): on the keys' side ``prepare_queries`` (once) and
    ``scores`` (per block), on the values' side ``weighted_values`` (per block) and ``finish_values`` (once);
    :mod:`kvq.contract` specifies each (:class:`~kvq.contract.PreparesQueries`, :class:`~kvq.contract.ScoresKeys`,
    :class:`~kvq.contract.WeightsValues`, :class:`~kvq.contract.FinishesValues`).

    Memory: blocks of ``block_size`` tokens (default :func:`block_size_for` with :func:`token_bytes_of` the keys'
    and values' head_dims, so one block spans at most :data:`VECTOR_BUDGET_BYTES` of float32 keys and values, or
    256 tokens), started on the device one at a time, after any block an earlier call started (:func:`run_block`).
    The peak above the inputs is one block's working set, which each implementation states as a multiple of that
    block's float32 keys (``scores``) or values (``weighted_values``); ``kvq_dequantize``, used where a side has no
    block protocol, holds at least that side's float32 block. Plus its float32 scores and probabilities and the
    ``[B, H_q, T_q, D_v]`` accumulators; it grows with neither the number of tokens nor of layers.

    :param queries: ``[B, H_q, T_q, D]`` float. :param keys, values: :class:`kvq.Encoded` ``[B, H_kv, T, ...]``.
    :param mask: as :func:`blockwise_attend`. :param key_impl, value_impl: the implementation objects of the
        keys' and values' methods. :param block_size: tokens per block (``None``: as above).
    :return: ``(out [B, H_q, T_q, D_v], lse [B, H_q, T_q])``, float32, as the ``kvq_attend`` spec says.
    :raises ValueError: keys and values of different token counts, queries whose head_dim is not the keys'
        (or whose ``H_q`` is not a multiple of their ``H_kv``: :func:`split_heads`).
    """
    B, Hkv, T = keys.shape[:3]
    if values.num_tokens != T:
        raise ValueError(f"values: {values.num_tokens} tokens, but keys have {T}")
    check_query_dim(queries, keys.head_dim)
    prepare = optional_hook(key_impl, PreparesQueries)
    finish = optional_hook(value_impl, FinishesValues)
    scores, weighted_values = optional_hook(key_impl, ScoresKeys), optional_hook(value_impl, WeightsValues)
    if scores is not None:
        def scores_fn(q, start, stop):
            return scores(q, keys, start, stop)
    else:
        def scores_fn(q, start, stop):
            k = key_impl.kvq_dequantize(keys.tokens(start, stop), mx.float32)
            return q @ k[:, :, None].swapaxes(-1, -2)
    if weighted_values is not None:
        def values_fn(p, start, stop):
            return weighted_values(p, values, start, stop)
    else:
        def values_fn(p, start, stop):
            return p @ value_impl.kvq_dequantize(values.tokens(start, stop), mx.float32)[:, :, None]
    return blockwise_attend(
        queries, T, Hkv, scores_fn, values_fn, scale, mask, block_size,
        prepare=None if prepare is None else (lambda q: prepare(q, keys)),
        finish=None if finish is None else (lambda out: finish(out, values)),
        token_bytes=token_bytes_of(B, Hkv, keys.head_dim, values.head_dim), one_at_a_time=True,
    )
