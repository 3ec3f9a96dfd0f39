"""Sign bits packed 8 per byte, little-endian: bit ``i`` of byte ``j`` is the sign of coordinate ``8 j + i``.

The layout is the one of :func:`kvq.packing.pack` with ``bits=1``: read as little-endian uint32 words, the
bytes of a row whose length is a multiple of 32 are exactly ``kvq.packing.pack(bits, 1)``, which is also the
layout ``mx.quantize(..., bits=1)`` uses, so ``mx.quantized_matmul`` can read the bits in place.
Sign convention: ``sign(0) = +1`` (bit 1 for ``x >= 0``).
"""

from __future__ import annotations

import mlx.core as mx

_SHIFTS = mx.arange(8, dtype=mx.uint32)


def pack_signs(x: mx.array) -> mx.array:
    """``x >= 0`` packed 8 per byte: float ``[..., m]`` -> uint8 ``[..., m / 8]``.

    :raises ValueError: ``m`` not a multiple of 8.
    """
    *lead, m = x.shape
    if m % 8:
        raise ValueError(f"pack_signs: the last axis ({m}) must be a multiple of 8")
    bits = (x >= 0).astype(mx.uint32).reshape(*lead, m // 8, 8)
    # bit ranges are disjoint, so the sum is the OR
    return mx.sum(mx.left_shift(bits, _SHIFTS), axis=-1).astype(mx.uint8)


def unpack_bits(packed: mx.array) -> mx.array:
    """uint8 ``[..., m / 8]`` -> uint8 bits ``[..., m]`` in {0, 1}."""
    *lead, n = packed.shape
    bits = mx.right_shift(packed.astype(mx.uint32)[..., None], _SHIFTS) & 1
    return bits.reshape(*lead, 8 * n).astype(mx.uint8)


def unpack_signs(packed: mx.array, dtype=mx.float32) -> mx.array:
    """uint8 ``[..., m / 8]`` -> ``±1`` of ``dtype`` ``[..., m]`` (the inverse of :func:`pack_signs`)."""
    return unpack_bits(packed).astype(dtype) * 2 - 1

