"""The affine baseline: exact parity with mx.quantize, published relative MSE, honest bits accounting."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import reference_attention

import kvq
from kvq.attention import dense_attend

# ../shared/REFERENCE_VALUES.md, "Affine min-max (mlx-lm QuantizedKVCache, KIVI)": relative MSE on N(0,1) rows
REL_MSE = {(2, 32): 0.154, (2, 64): 0.202, (2, 128): 0.250,
           (3, 32): 0.0281, (3, 64): 0.0369, (3, 128): 0.0457,
           (4, 32): 0.0061, (4, 64): 0.0080, (4, 128): 0.0099,
           (8, 32): 2.1e-5, (8, 64): 2.8e-5, (8, 128): 3.4e-5}


def _relative_mse(x, x_hat):
    return float(((x_hat - x) ** 2).sum() / (x**2).sum())


def _plan(bits=4, group_size=64, shape=(2, 4, 256, 128)):
    return kvq.select("affine", shape, params=kvq.make_params("affine", bits=bits, group_size=group_size))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_round_trip_matches_mx_quantize_exactly(bits, group_size):
    x = mx.random.normal((2, 4, 64, 128)).astype(mx.float16)
    plan = _plan(bits, group_size)
    enc = plan.quantize(x, plan.params)
    codes, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    assert mx.array_equal(enc.data["codes"], codes) and mx.array_equal(enc.data["scales"], scales)
    assert mx.array_equal(enc.data["biases"], biases)
    expected = mx.dequantize(codes, scales, biases, group_size=group_size, bits=bits)
    assert mx.array_equal(plan.dequantize(enc, mx.float16), expected)


@pytest.mark.parametrize("bits, group_size", sorted(REL_MSE))
def test_reference_table_is_textbook_min_max(bits, group_size):
    """The table is the textbook min-max quantizer (scale = (max - min) / (2^b - 1), zero point = min)."""
    x = np.random.default_rng(bits * 1000 + group_size).standard_normal((20000, group_size))
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    step = (hi - lo) / (2**bits - 1)
    x_hat = lo + np.round((x - lo) / step) * step
    assert _relative_mse(x, x_hat) == pytest.approx(REL_MSE[(bits, group_size)], rel=0.05)


@pytest.mark.parametrize("bits, group_size", sorted(REL_MSE))
def test_relative_mse_against_reference(bits, group_size):
    """mx.quantize (mlx-lm's numerics) is not the textbook quantizer: it snaps the grid so that the group's
    larger-magnitude edge is exact. At 3, 4 and 8 bits that costs up to ~8% (plus fp16 rounding at 8 bits);
    at 2 bits it beats the table by 15-28%. Both directions are asserted, so a change of numerics fails."""
    x = mx.random.normal((1, 1, 16384, 128)).astype(mx.float16)
    plan = _plan(bits, group_size)
    x_hat = plan.dequantize(plan.quantize(x, plan.params), mx.float32)
    rel = _relative_mse(x.astype(mx.float32), x_hat)
    ref = REL_MSE[(bits, group_size)]
    if bits == 2:
        assert 0.65 * ref < rel < 0.9 * ref
    else:
        assert rel == pytest.approx(ref, rel=0.12)


@pytest.mark.parametrize("bits, group_size, expected", [(4, 64, 4.5), (4, 32, 5.0), (2, 128, 2.25), (8, 64, 8.5)])
def test_bits_accounting_includes_scales_and_biases(bits, group_size, expected):
    acc = kvq.make_params("affine", bits=bits, group_size=group_size).accounting(128)
    assert acc.bits_per_coordinate == expected
    assert acc.per_token["scales"] == acc.per_token["biases"] == 16 * 128 // group_size
    # and the arrays really hold that many bytes
    plan = _plan(bits, group_size)
    enc = plan.quantize(mx.random.normal((2, 4, 256, 128)).astype(mx.float16), plan.params)
    assert enc.nbytes == acc.bytes_for(2, 4, 256)


def test_constant_group_gives_finite_exact_values():
    x = mx.full((1, 1, 4, 64), 3.0, mx.float16)
    plan = _plan(4, 64, (1, 1, 4, 64))
    x_hat = plan.dequantize(plan.quantize(x, plan.params), mx.float32)
    assert mx.all(mx.isfinite(x_hat)).item() and mx.allclose(x_hat, mx.array(3.0)).item()


@pytest.mark.parametrize("mask_kind", ["none", "causal"])
def test_attend_equals_attention_over_dequantized(mask_kind):
    B, Hq, Hkv, Tq, T, D = 1, 8, 2, 5, 300, 64
    q = mx.random.normal((B, Hq, Tq, D))
    k, v = (mx.random.normal((B, Hkv, T, D)).astype(mx.float16) for _ in range(2))
    plan = _plan(4, 32, (B, Hkv, T, D))
    ke, ve = plan.quantize(k, plan.params), plan.quantize(v, plan.params)
    mask = None if mask_kind == "none" else (mx.arange(T - Tq, T)[:, None] >= mx.arange(T)[None])
    out, lse = plan.attend(q, ke, ve, D**-0.5, mask)
    k_hat, v_hat = plan.dequantize(ke, mx.float32), plan.dequantize(ve, mx.float32)
    ref_out, ref_lse = dense_attend(q, k_hat, v_hat, D**-0.5, mask, block_size=T)
    ref, textbook_lse = reference_attention(q, k_hat, v_hat, D**-0.5, mask)
    assert mx.allclose(out, ref, rtol=1e-3, atol=1e-4).item()
    assert mx.allclose(lse, textbook_lse, rtol=1e-4, atol=1e-4).item()
    assert mx.allclose(ref_out, ref, rtol=1e-4, atol=1e-5).item()


@pytest.mark.parametrize("bad, error, match", [
    (mx.zeros((2, 64, 64)), ValueError, r"x must have rank 4 \(\[B, H, T, D\]\)"),
    (mx.zeros((1, 1, 4, 64), mx.int32), TypeError, r"x must have dtype float16, bfloat16 or float32"),
    (mx.zeros((1, 1, 4, 96)), ValueError, r"head_dim 96 is not supported"),
])
def test_quantize_rejects_bad_input(bad, error, match):
    plan = _plan()
    with pytest.raises(error, match=match):
        plan.quantize(bad, plan.params)
