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


def _bits_of_bytes(packed: mx.array) -> mx.array:
    """uint8 ``[..., n]`` -> uint32 bits ``[..., 8 n]``, little-endian within each byte."""
    bits = mx.right_shift(packed.astype(mx.uint32)[..., None], mx.arange(8, dtype=mx.uint32)) & 1
    return bits.reshape(*packed.shape[:-1], 8 * packed.shape[-1])


def _stream_codes(stream) -> mx.array:
    """uint32 ``[B, H, T, dim // vec]``: the codes of a :class:`kvq_metal.streams.Stream` (words or bytes)."""
    count = stream.dim // stream.vec
    if stream.codes.dtype != mx.uint8:
        return packing.unpack(stream.codes, stream.bits, count)
    lead = stream.codes.shape[:-1]
    bits = _bits_of_bytes(stream.codes)[..., : count * stream.bits].reshape(*lead, count, stream.bits)
    return mx.sum(mx.left_shift(bits, mx.arange(stream.bits, dtype=mx.uint32)), axis=-1)


def decode_stream(stream) -> tuple[mx.array, mx.array]:
    """``(x float32 [B, H, T, dim], reserved bool [B, H, T])``: a stream's coordinates as the streams kernel
    decodes them (``table[head][code][j % vec] * scale_g + bias_g``), and which tokens hold the reserved pattern
    (all false unless ``stream.reserved``)."""
    codes = _stream_codes(stream)
    B, H, T, n = codes.shape
    table = stream.table.reshape(stream.table.shape[0], 1 << stream.bits, stream.vec)
    if table.shape[0] > 1:
        x = table[mx.arange(H).reshape(1, H, 1, 1), codes]
    else:
        x = table[0][codes]
    g = stream.group_size
    x = x.reshape(B, H, T, stream.dim // g, g)
    if stream.scales:
        x = x * stream.scales[0].astype(mx.float32).reshape(B, H, T, -1, 1)
    if stream.biases is not None:
        x = x + stream.biases.astype(mx.float32).reshape(B, H, T, -1, 1)
    x = x.reshape(B, H, T, stream.dim)
    if len(stream.scales) > 1:
        x = x * stream.scales[1].astype(mx.float32)[..., None]
    reserved = mx.all(codes == (1 << stream.bits) - 1, axis=-1) if stream.reserved else mx.zeros((B, H, T), mx.bool_)
    return x, reserved


def decode_attend_streams(queries: mx.array, call) -> tuple[mx.array, mx.array]:
    """Reference of :func:`kvq_metal.streams.decode_attend_streams` (same arguments and result): decode every
    stream to float32, score ``Σ q'[offset:offset + dim] · x`` plus the outlier estimate, softmax over the tokens
    (NaN for reserved tokens), weigh the value streams side by side.

    :return: ``(out [B, H_kv, R, DO] float32, lse [B, H_kv, R] float32)``.
    """
    q = queries.astype(mx.float32)
    B, H, R, _ = q.shape
    scores, dead = None, None
    for s in call.keys:
        x, reserved = decode_stream(s)
        part = q[..., s.offset : s.offset + s.dim] @ x.swapaxes(-1, -2)
        scores = part if scores is None else scores + part
        dead = reserved if dead is None else dead | reserved
    o = call.outliers
    if o is not None:
        T, k = o.indices.shape[2], o.indices.shape[3]
        signs = _bits_of_bytes(o.signs).astype(mx.float32) * 2 - 1
        estimate = (signs @ o.sketch) * o.norms.astype(mx.float32)[..., None]  # [B, H, T, k]
        idx = (o.indices.astype(mx.int32) + o.offset).reshape(B, H, 1, T * k)
        q_out = mx.take_along_axis(q, mx.broadcast_to(idx, (B, H, R, T * k)), axis=-1).reshape(B, H, R, T, k)
        scores = scores + mx.sum(q_out * estimate[:, :, None], axis=-1)
    scores = mx.where(dead[:, :, None], float("nan"), scores)
    top = mx.max(scores, axis=-1, keepdims=True)
    p = mx.exp(scores - top)
    total = mx.sum(p, axis=-1, keepdims=True)
    decoded = [decode_stream(s) for s in call.values]
    x = mx.concatenate([d[0] for d in decoded], axis=-1)
    p = mx.where(decoded[0][1][:, :, None], float("nan"), p)
    out = (p / total) @ x
    return out, (top + mx.log(total))[..., 0]
