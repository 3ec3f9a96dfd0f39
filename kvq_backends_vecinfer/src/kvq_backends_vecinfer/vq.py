"""VecInfer's numerics in pure MLX: the key/value transform, product-VQ encode/decode, and lookup-table scores.

Yao et al., VecInfer (arXiv 2510.06175): keys are divided per channel by smoothing factors ``s`` and rotated by the
orthonormal Hadamard matrix ``H``: ``y = H (k / s)``; values are only rotated: ``y = H v``. ``y`` is split into
``M = D / sub_dim`` sub-vectors, each stored as the index of its nearest centroid ``c``. Decoding inverts the
transform: ``k̃ = s ⊙ Hᵀ ŷ``. Scores need no decoding: ``q · k̃ = (H (s ⊙ q)) · ŷ = Σ_m q'_m · c[code_m]``,
a sum of ``M`` entries of the per-query table ``T[m, j] = q'_m · c_j`` (product quantization's asymmetric
distance, Jégou et al. 2011).

Arrays: ``x`` ``[B, H_kv, T, D]``; codes uint32 ``[B, H_kv, T, M]`` (packed by :mod:`kvq.packing` along the last
axis); codebook float32 ``[G, K, sub_dim]`` with ``G`` = 1 (shared) or ``H_kv`` (per head).

Non-finite input (kvq's policy, :class:`kvq.contract.Quantizes`): VecInfer stores nothing per token but codes, so
one code pattern is reserved: every sub-vector code ``K - 1`` (:func:`reserved_words`) marks a vector that had a NaN
or ±inf coordinate, and decodes to NaN (:func:`reserved`). A finite vector whose nearest codes are exactly that
pattern (probability about ``K^-M``: 2^-128 at the defaults) stores its first sub-vector's second-nearest centroid
instead. No bits are added, and every other vector is stored as before.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
from kvq import packing

from . import hadamard
from .kmeans import ASSIGN_BUDGET_BYTES, nearest, rows_per_block


def _heads_axis(smoothing: mx.array) -> mx.array:
    """``[H, D]`` -> ``[1, H, 1, D]``, to broadcast over ``[B, H, T, D]``."""
    return smoothing[None, :, None, :]


def transform(x: mx.array, smoothing: mx.array | None) -> mx.array:
    """``y = H (x / s)`` (keys) or ``H x`` (``smoothing`` None): any float ``[B, H, T, D]`` -> float32."""
    x = x.astype(mx.float32)
    if smoothing is not None:
        x = x / _heads_axis(smoothing)
    return hadamard.forward(x)


def inverse_transform(y: mx.array, smoothing: mx.array | None) -> mx.array:
    """``s ⊙ Hᵀ y`` (or ``Hᵀ y``): float32 ``[B, H, ..., D]`` with the KV-head axis at 1 -> float32."""
    x = hadamard.inverse(y)
    if smoothing is None:
        return x
    return x * smoothing.reshape(1, smoothing.shape[0], *([1] * (y.ndim - 3)), smoothing.shape[1])


def transform_queries(q: mx.array, smoothing: mx.array | None) -> mx.array:
    """``q' = H (s ⊙ q)`` for grouped queries float32 ``[B, H_kv, n_rep, T_q, D]``, so that ``q' · y = q · k``."""
    if smoothing is not None:
        q = q * smoothing[None, :, None, None, :]
    return hadamard.forward(q)


def sub_vectors(y: mx.array, sub_dim: int) -> mx.array:
    """``[..., D]`` -> ``[..., D / sub_dim, sub_dim]``."""
    return y.reshape(*y.shape[:-1], y.shape[-1] // sub_dim, sub_dim)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """:func:`kvq.packing.pack`, also for blocks with no tokens: uint32 ``[..., ceil(M * bits / 32)]``."""
    if codes.size == 0:
        return mx.zeros(codes.shape[:-1] + (packing.packed_words(codes.shape[-1], bits),), mx.uint32)
    return packing.pack(codes, bits)


def encode(x: mx.array, codebook: mx.array, smoothing: mx.array | None, sub_dim: int, bits: int,
           budget: int = ASSIGN_BUDGET_BYTES) -> mx.array:
    """Packed codes of ``x`` ``[B, H, T, D]``: uint32 ``[B, H, T, ceil(M * bits / 32)]``.

    Tokens are encoded in blocks whose ``[G, n, K]`` distances fit ``budget`` bytes, each evaluated before the next
    when there are several, so peak memory does not grow with ``T``.
    """
    B, H, T, D = x.shape
    G, K, _ = codebook.shape
    M = D // sub_dim
    step = max(1, rows_per_block(G, K, budget) * G // (B * H * M))  # tokens per block
    blocks = []
    for start in range(0, T, step):
        y = sub_vectors(transform(x[:, :, start:start + step], smoothing), sub_dim)  # [B, H, t, M, S]
        t = y.shape[2]
        points = y.swapaxes(0, 1).reshape(H, -1, sub_dim) if G > 1 else y.reshape(1, -1, sub_dim)
        codes, _ = nearest(points, codebook, budget)
        codes = codes.reshape(H, B, t, M).swapaxes(0, 1) if G > 1 else codes.reshape(B, H, t, M)
        codes = _reserve(codes, y[..., 0, :], codebook, mx.all(mx.isfinite(x[:, :, start:start + step]), axis=-1),
                         budget)
        blocks.append(pack_codes(codes, bits))
        if T > step:
            mx.eval(blocks[-1])
    if not blocks:
        return mx.zeros((B, H, 0, packing.packed_words(M, bits)), mx.uint32)
    return blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=2)


def _reserve(codes: mx.array, first: mx.array, codebook: mx.array, finite: mx.array, budget: int) -> mx.array:
    """Apply the reserved pattern (module docstring) to codes uint32 ``[B, H, t, M]``: all ``K - 1`` where
    ``finite`` (bool ``[B, H, t]``) is False; where a finite vector's codes are all ``K - 1``, its first code
    becomes the nearest centroid but ``K - 1`` of its first sub-vector ``first`` float32 ``[B, H, t, S]``."""
    B, H, t, _ = codes.shape
    G, K, S = codebook.shape
    points = first.swapaxes(0, 1).reshape(H, -1, S) if G > 1 else first.reshape(1, -1, S)
    second, _ = nearest(points, codebook[:, : K - 1], budget)
    second = second.reshape(H, B, t).swapaxes(0, 1) if G > 1 else second.reshape(B, H, t)
    clash = mx.all(codes == K - 1, axis=-1)
    codes = mx.concatenate([mx.where(clash, second, codes[..., 0])[..., None], codes[..., 1:]], axis=-1)
    return mx.where(finite[..., None], codes, K - 1)


@lru_cache(maxsize=64)
def reserved_words(count: int, bits: int) -> mx.array:
    """The reserved pattern, packed: uint32 ``[ceil(count * bits / 32)]``, every one of ``count`` codes
    ``2**bits - 1`` (a partial last word keeps its unused high bits 0, as :func:`kvq.packing.pack` writes)."""
    words = packing.pack(mx.full((count,), 2**bits - 1, mx.uint32), bits)
    mx.eval(words)
    return words


def reserved(packed: mx.array, count: int, bits: int) -> mx.array:
    """bool ``[B, H, T]``: which vectors of packed codes uint32 ``[B, H, T, W]`` hold the reserved pattern (had a
    non-finite coordinate: they decode to NaN). Lazy, no host synchronisation."""
    return mx.all(packed == reserved_words(count, bits), axis=-1)


def unpack_codes(packed: mx.array, bits: int, count: int) -> mx.array:
    """uint32 ``[B, H, T, W]`` -> codes uint32 ``[B, H, T, count]`` (blocks with no tokens included)."""
    if packed.size == 0:
        return mx.zeros(packed.shape[:-1] + (count,), mx.uint32)
    return packing.unpack(packed, bits, count)


def decode_rotated(codes: mx.array, codebook: mx.array) -> mx.array:
    """``ŷ``: centroids of ``codes`` uint32 ``[B, H, T, M]`` joined: float32 ``[B, H, T, M * sub_dim]``."""
    B, H, T, M = codes.shape
    G, K, S = codebook.shape
    index = codes if G == 1 else codes + (mx.arange(H, dtype=mx.uint32) * K)[None, :, None, None]
    return mx.take(codebook.reshape(G * K, S), index, axis=0).reshape(B, H, T, M * S)


def lookup_table(q: mx.array, codebook: mx.array) -> mx.array:
    """``T[..., m, j] = q'_m · c_j`` for transformed queries float32 ``[B, H_kv, n_rep, T_q, D]``.

    :return: float32 ``[B, H_kv, n_rep, T_q, M, K]``.
    """
    per_head = codebook.swapaxes(-1, -2)[None, :, None, None]  # [1, G, 1, 1, S, K]
    return sub_vectors(q, codebook.shape[-1]) @ per_head


def table_scores(table: mx.array, codes: mx.array, budget: int = ASSIGN_BUDGET_BYTES) -> mx.array:
    """``Σ_m T[..., m, code_m]`` for every key: float32 ``[B, H_kv, n_rep, T_q, n]``.

    :param table: ``[B, H_kv, n_rep, T_q, M, K]`` from :func:`lookup_table`.
    :param codes: uint32 ``[B, H_kv, n, M]`` of ``n`` keys. Keys are gathered in chunks whose ``[..., n', M]``
        gathered entries fit ``budget`` bytes.
    """
    B, H, R, Tq, M, K = table.shape
    n = codes.shape[2]
    flat = table.reshape(B, H, R, Tq, M * K)
    offsets = mx.arange(M, dtype=mx.uint32) * K  # entry (m, j) sits at m * K + j
    step = max(1, budget // (4 * B * H * R * Tq * M))
    parts = []
    for start in range(0, n, step):
        index = (codes[:, :, start:start + step] + offsets).reshape(B, H, 1, 1, -1)
        gathered = mx.take_along_axis(flat, index, axis=-1)  # [B, H, R, Tq, n' * M]
        parts.append(gathered.reshape(B, H, R, Tq, -1, M).sum(axis=-1))
    if not parts:
        return mx.zeros((B, H, R, Tq, 0), mx.float32)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
