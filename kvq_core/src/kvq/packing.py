"""Dense bit packing in pure MLX: b-bit codes cost exactly b bits (codes may straddle uint32 words).

32 codes of b bits fill exactly b words, so codes are handled in groups of 32: word ``j`` of a group is the
OR (here: the sum, since the bit ranges are disjoint) of every code's bits that fall in ``[32j, 32j + 32)``.
The shift tables are static per ``bits`` and cached.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

MAX_BITS = 16


def _check(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an int in 1..{MAX_BITS}; got {bits!r}")


def packed_words(count: int, bits: int) -> int:
    """uint32 words that ``count`` codes of ``bits`` bits occupy: ``ceil(count * bits / 32)``."""
    return -(-count * bits // 32)


def _check_words(words: int, count: int, bits: int) -> None:
    """:raises ValueError: ``words`` uint32 words are too few for ``count`` codes of ``bits`` bits."""
    if words < packed_words(count, bits):
        raise ValueError(f"packed has {words} words; {count} codes of {bits} bits need {packed_words(count, bits)}")


@lru_cache(maxsize=None)
def _pack_tables(bits: int):
    offsets = np.arange(32) * bits  # bit offset of each code in its group
    word_start = np.arange(bits)[:, None] * 32  # [bits, 1]
    rel = offsets[None, :] - word_start  # where code i starts relative to word j
    overlaps = (rel > -bits) & (rel < 32)
    left = np.where(overlaps & (rel >= 0), rel, 0).astype(np.uint32)
    right = np.where(overlaps & (rel < 0), -rel, 0).astype(np.uint32)
    return mx.array(left), mx.array(right), mx.array(overlaps)


@lru_cache(maxsize=None)
def _unpack_tables(bits: int):
    offsets = np.arange(32) * bits
    lo_word, shift = offsets // 32, offsets % 32
    hi_word = np.minimum(lo_word + 1, bits - 1)
    straddles = shift + bits > 32
    hi_shift = np.where(straddles, 32 - shift, 0).astype(np.uint32)
    return (mx.array(lo_word), mx.array(hi_word), mx.array(shift.astype(np.uint32)), mx.array(hi_shift),
            mx.array(straddles))


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack ``codes [..., N]`` (unsigned ints below ``2**bits``) into uint32 ``[..., ceil(N*bits/32)]``.

    :raises ValueError: ``bits`` outside 1..16. Codes are not range-checked here (hot path); values at or
        above ``2**bits`` are masked to their low bits.
    """
    _check(bits)
    *lead, N = codes.shape
    c = codes.astype(mx.uint32) & ((1 << bits) - 1)
    if N == 0 or 0 in lead:
        return mx.zeros((*lead, packed_words(N, bits)), mx.uint32)
    if 32 % bits == 0:  # codes never straddle words: one shift per lane
        per_word = 32 // bits
        pad = (-N) % per_word
        if pad:
            c = mx.pad(c, [(0, 0)] * len(lead) + [(0, pad)])
        shifts = mx.arange(per_word, dtype=mx.uint32) * bits
        return _sum_u32(mx.left_shift(c.reshape(*lead, -1, per_word), shifts))
    pad = (-N) % 32
    if pad:
        c = mx.pad(c, [(0, 0)] * len(lead) + [(0, pad)])
    c = c.reshape(*lead, -1, 1, 32)  # [..., G, 1, 32]
    left, right, overlaps = _pack_tables(bits)
    parts = mx.where(overlaps, mx.right_shift(mx.left_shift(c, left), right), 0)
    words = _sum_u32(parts)
    words = words.reshape(*lead, -1)
    return words[..., : packed_words(N, bits)]


def _sum_u32(parts: mx.array) -> mx.array:
    # bit ranges are disjoint, so the sum equals the OR and cannot overflow
    return mx.sum(parts.astype(mx.uint32), axis=-1).astype(mx.uint32)


def unpack(packed: mx.array, bits: int, count: int) -> mx.array:
    """Inverse of :func:`pack`: uint32 ``[..., W]`` -> uint32 codes ``[..., count]``.

    :raises ValueError: ``bits`` outside 1..16, or ``W`` too small for ``count`` codes.
    """
    _check(bits)
    *lead, W = packed.shape
    _check_words(W, count, bits)
    if count == 0 or 0 in lead:
        return mx.zeros((*lead, count), mx.uint32)
    if 32 % bits == 0:
        per_word = 32 // bits
        words = packed[..., : -(-count // per_word)]
        shifts = mx.arange(per_word, dtype=mx.uint32) * bits
        codes = mx.right_shift(words[..., None], shifts) & ((1 << bits) - 1)
        return codes.reshape(*lead, -1)[..., :count]
    groups = -(-count // 32)
    pad = groups * bits - W
    w = mx.pad(packed, [(0, 0)] * len(lead) + [(0, pad)]) if pad > 0 else packed[..., : groups * bits]
    w = w.reshape(*lead, groups, bits)
    lo_word, hi_word, shift, hi_shift, straddles = _unpack_tables(bits)
    lo = mx.right_shift(mx.take(w, lo_word, axis=-1), shift)
    hi = mx.where(straddles, mx.left_shift(mx.take(w, hi_word, axis=-1), hi_shift), 0).astype(mx.uint32)
    codes = (lo | hi) & ((1 << bits) - 1)
    return codes.reshape(*lead, groups * 32)[..., :count]


#: Bits of packed stream read per table index by :class:`Lookup`, per code width: several codes per gather (16 bits:
#: 2-, 4- and 8-bit codes from the stream's 16-bit halves; 12 bits: 3- and 6-bit codes from 3-byte triples; 8 bits:
#: 1-bit codes from its bytes). Other widths decode code by code.
LOOKUP_INDEX_BITS = {1: 8, 2: 16, 3: 12, 4: 16, 6: 12, 8: 16}


class Lookup:
    """``table[codes]`` straight from the packed words, several codes per gather: what ``mx.take(table,
    unpack(packed, bits, count))`` gives, bit for bit, where that is slow.

    MLX's CPU gather costs about 6.5 ns an element against under 1 ns for an elementwise operation (2-core x86-64,
    MLX 0.32.4: a codebook lookup of 1.5M 4-bit codes took 10.1 ms plus 1.8 ms to unpack them, 3-bit codes 10.6
    plus 15.4 ms). This reads the packed stream in fields of :data:`LOOKUP_INDEX_BITS` bits, each holding ``k``
    whole codes (the packed layout of :func:`pack`: a little-endian bit stream, code ``i`` at bit ``i * bits`` of
    its group), and gathers rows of a ``[2**field_bits, k]`` table of the ``k`` values those codes decode to: ``k``
    values per gather (4-bit codes: 4.1 ms for the same 1.5M codes, nothing to unpack).

    :param table: float ``[2**bits]`` (numpy or MLX), the value of each code. :param bits: code width, 1..16.
    :raises ValueError: ``bits`` outside 1..16, or ``table`` not of ``2**bits`` values.
    """

    def __init__(self, table, bits: int) -> None:
        _check(bits)
        values = np.asarray(table, dtype=np.float32).reshape(-1)
        if values.size != 1 << bits:
            raise ValueError(f"table must hold 2**bits = {1 << bits} values for bits={bits}; got {values.size}")
        self.bits = bits
        self.table = mx.array(values)
        self.field_bits = LOOKUP_INDEX_BITS.get(bits)
        self.rows = None
        if self.field_bits is not None:
            k = self.field_bits // bits
            index = np.arange(1 << self.field_bits, dtype=np.uint32)[:, None]
            codes = (index >> (np.arange(k, dtype=np.uint32) * bits)) & ((1 << bits) - 1)
            self.rows = mx.array(values[codes])  # [2**field_bits, k]

    def __call__(self, packed: mx.array, count: int) -> mx.array:
        """The values of the first ``count`` codes of ``packed`` (uint32 ``[..., W]``, :func:`pack`'s layout):
        float32 ``[..., count]``, equal to ``mx.take(table, unpack(packed, bits, count))``.

        The fast path needs whole groups (``count`` a multiple of 32) and a width in :data:`LOOKUP_INDEX_BITS`;
        otherwise the codes are unpacked and gathered one by one.

        :raises ValueError: as :func:`unpack` (``W`` too small for ``count`` codes).
        """
        *lead, W = packed.shape
        bits = self.bits
        _check_words(W, count, bits)
        if self.rows is None or count % 32 or count == 0 or 0 in lead:
            return mx.take(self.table, unpack(packed, bits, count))
        words = packed[..., : count * bits // 32]
        if self.field_bits == 16:
            index = words.view(mx.uint16)
        elif self.field_bits == 8:
            index = words.view(mx.uint8)
        else:  # 12-bit fields: two in every 3 bytes
            b = words.view(mx.uint8).reshape(*lead, -1, 3).astype(mx.uint16)
            first = b[..., 0] | ((b[..., 1] & 0xF) << 8)
            second = (b[..., 1] >> 4) | (b[..., 2] << 4)
            index = mx.stack([first, second], axis=-1)
        return mx.take(self.rows, index.reshape(*lead, -1), axis=0).reshape(*lead, count)
