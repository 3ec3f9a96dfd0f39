"""Pure-MLX references of kvq_metal's generic kernels: what :func:`kvq_metal.attend.decode_attend` computes,
written with plain MLX ops and no method in mind (each method's kernel implementation is also checked against its
own pure-MLX implementation before first use). Slow and memory-hungry (it decodes every token): for tests.
"""

from __future__ import annotations

import mlx.core as mx

from kvq import packing
from kvq.attention import DenseTokens, dense_attend, merge_parts

from .attend import Side


def decode_side(side: Side, head_dim: int) -> mx.array:
    """float32 ``[B, H_kv, T, head_dim]``: ``x_j = table[code_j] * scale_g + bias_g`` (``g = j // side.group``),
    the code of a second stream appended below the first (``(code << bits2) | code2``)."""
    codes = packing.unpack(side.codes, side.bits, head_dim)
    if side.codes2 is not None:
        codes = mx.left_shift(codes, side.bits2) | packing.unpack(side.codes2, side.bits2, head_dim)
    B, H, T, D = codes.shape
    x = side.table[codes].reshape(B, H, T, D // side.group, side.group)
    x = x * side.scales.astype(mx.float32).reshape(B, H, T, -1, 1)
    if side.biases is not None:
        x = x + side.biases.astype(mx.float32).reshape(B, H, T, -1, 1)
    return x.reshape(B, H, T, D)


def decode_attend(queries: mx.array, scale: float, keys: Side, values: Side, *, signs: mx.array | None = None,
                  out_dim: int | None = None, dense: DenseTokens | None = None) -> tuple[mx.array, mx.array]:
    """Reference of :func:`kvq_metal.attend.decode_attend` (same arguments and result): decode both sides, pad the
    queries to the codes' dimension ``D``, rotate them into the codes' domain ``H diag(signs) / sqrt(D)`` when
    ``signs`` is given, attend in float32 (:func:`kvq.attention.dense_attend`), rotate the output back, keep
    ``out_dim`` coordinates, and merge the ``dense`` sinks and window by log-sum-exp
    (:func:`kvq.attention.merge_parts`).

    :return: ``(out [B, H_q, T_q, out_dim] float32, lse [B, H_q, T_q] float32)``.
    """
    D = keys.codes.shape[3] * 32 // keys.bits
    q = queries.astype(mx.float32)
    q = mx.pad(q, [(0, 0)] * 3 + [(0, D - q.shape[3])])
    if signs is not None:
        q = mx.hadamard_transform(q * signs)
    out, lse = dense_attend(q, decode_side(keys, D), decode_side(values, D), scale)
    if signs is not None:
        out = mx.hadamard_transform(out) * signs
    parts = [(out[..., : out_dim or D], lse)]
    if dense is not None:
        if dense.sink_keys is not None:
            parts.append(dense_attend(queries, dense.sink_keys, dense.sink_values, scale))
        parts.append(dense_attend(queries, dense.window_keys, dense.window_values, scale))
    return merge_parts(parts) if len(parts) > 1 else parts[0]
