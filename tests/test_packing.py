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
