"""Dense bit packing: exact round trips, and b-bit codes cost b bits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvq
from kvq import packing


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 16), count=st.integers(1, 200), rows=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_round_trip(bits, count, rows, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=(rows, count), dtype=np.uint32)
    packed = packing.pack(mx.array(codes), bits)
    assert packed.dtype == mx.uint32 and packed.shape == (rows, packing.packed_words(count, bits))
    assert np.array_equal(np.array(packing.unpack(packed, bits, count)), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_codes_cost_exactly_their_bits(bits):
    packed = packing.pack(mx.zeros((4, 128), mx.uint32), bits)
    assert packed.nbytes * 8 == 4 * 128 * bits


def test_matches_mlx_quantize_layout_for_power_of_two_bits():
    # mx.quantize packs little-endian within uint32 words too: a cross-check with an independent packer
    x = mx.random.normal((4, 64)).astype(mx.float16)
    with mx.stream(mx.cpu):  # the layout is what is checked; GPU dequantize may round differently
        _check_layout(x)


def _check_layout(x):
    for bits in (2, 4, 8):
        words, scales, biases = mx.quantize(x, group_size=64, bits=bits)
        codes = packing.unpack(words, bits, 64)
        assert mx.array_equal(packing.pack(codes, bits), words)
        assert mx.allclose(codes.astype(mx.float16) * scales + biases,
                           mx.dequantize(words, scales, biases, group_size=64, bits=bits)).item()


def test_pack_is_selectable_for_every_method():
    plan = kvq.select("affine", (1, 1, 64, 64), op="pack")
    assert plan.choices["pack"].implementation.method == "*"
    codes = mx.array(np.arange(96) % 8, dtype=mx.uint32)
    assert mx.array_equal(plan.unpack(plan.pack(codes, 3), 3, 96), codes)


@pytest.mark.parametrize("bits", [0, 17, 2.5])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits must be an int in 1..16"):
        packing.pack(mx.zeros((1, 32), mx.uint32), bits)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 10), st.sampled_from([32, 64, 96, 128, 256, 40, 7]), st.integers(1, 9), st.integers(0, 9))
def test_lookup_equals_unpack_then_take(bits, count, rows, seed):
    """packing.Lookup gives table[unpack(packed)] bit for bit: whole groups through several codes per gather
    (widths 1, 2, 3, 4, 6, 8), anything else code by code; also on a slice of a larger store (strided rows)."""
    rng = np.random.default_rng(seed)
    table = rng.standard_normal(1 << bits).astype(np.float32)
    lookup = packing.Lookup(table, bits)
    codes = mx.array(rng.integers(0, 1 << bits, (1, 2, rows, count)).astype(np.uint32))
    packed = packing.pack(codes, bits)
    expected = mx.take(mx.array(table), codes)
    assert mx.array_equal(lookup(packed, count), expected).item()
    store = mx.concatenate([packed, packed], axis=2)[:, :, 1 : rows + 1]
    assert mx.array_equal(lookup(store, count), mx.take(mx.array(table), packing.unpack(store, bits, count))).item()
    wide = mx.concatenate([packed, mx.full(packed.shape[:-1] + (3,), 12345, mx.uint32)], axis=-1)  # spare words
    assert mx.array_equal(lookup(wide, count), expected).item()
    assert (lookup.rows is not None) == (bits in packing.LOOKUP_INDEX_BITS)


def test_lookup_rejects_bad_tables_and_short_codes():
    with pytest.raises(ValueError, match="table must hold 2\\*\\*bits = 16 values for bits=4; got 8"):
        packing.Lookup(np.zeros(8), 4)
    with pytest.raises(ValueError, match="bits must be an int in 1..16"):
        packing.Lookup(np.zeros(2), 0)
    with pytest.raises(ValueError, match="packed has 1 words; 64 codes of 4 bits need 8"):
        packing.Lookup(np.zeros(16), 4)(mx.zeros((2, 1), mx.uint32), 64)
