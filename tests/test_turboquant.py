"""TurboQuant (Zandieh et al., arXiv 2504.19874): codebooks, distortion, inner products, attention, accounting.

Published numbers are from ../shared/REFERENCE_VALUES.md, section "TurboQuant".
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import reference_attention, unit_vectors
from hypothesis import given, settings, strategies as st

import kvq
from kvq import packing
from kvq.attention import attend_encoded, dense_attend
from kvq_backends_turboquant import codebook as codebook_module, mse
from kvq_backends_turboquant.codebook import codebook, lloyd_max, load_or_compute
from kvq_backends_turboquant.impl import TurboQuantMLX
from kvq_backends_turboquant.rotation import power_of_two_dim, rotation

# REFERENCE_VALUES.md, TurboQuant: Lloyd-Max centroids × sqrt(d) at d = 128 (positive half)
CENTROIDS_128 = {1: [0.7996], 2: [0.4530, 1.5056], 3: [0.2460, 0.7547, 1.3378, 2.1325],
                 4: [0.1335, 0.3918, 0.6588, 0.9420, 1.2524, 1.6085, 2.0496, 2.6919]}
# REFERENCE_VALUES.md, TurboQuant: MSE variant, E‖x - x̃‖² for unit x, by (bits, d)
DISTORTION = {(1, 64): 0.3584, (1, 128): 0.3609, (1, 256): 0.3621,
              (2, 64): 0.1145, (2, 128): 0.1160, (2, 256): 0.1167,
              (3, 64): 0.0334, (3, 128): 0.0340, (3, 256): 0.0343,
              (4, 64): 0.0091, (4, 128): 0.0093, (4, 256): 0.0094}
# REFERENCE_VALUES.md, TurboQuant: inner-product shrink s of the MSE variant, and d · E(⟨y,x⟩ - ⟨y,x̃⟩)² of the
# Prod variant at d = 128, for bits 1..4
SHRINK = {1: 0.639, 2: 0.884, 3: 0.966, 4: 0.991}
PROD_ERROR_128 = {1: 1.563, 2: 0.564, 3: 0.181, 4: 0.053}
# Max (1960), "Quantizing for minimum distortion", table I: the 16-level Lloyd-Max quantizer of N(0, 1)
MAX_GAUSSIAN_16 = [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326]

METHODS = ("turboquant", "turboquant_prod")


pytestmark = pytest.mark.usefixtures("private_codebook_cache")


def _round_trip(method, x, dtype=mx.float32, **params):
    params = kvq.make_params(method, **params)
    plan = kvq.select(method, x.shape, params=params, dtype=x.dtype)
    encoded = plan.quantize(x, params)
    return encoded, plan.dequantize(encoded, dtype)


def _expected_distortion(params, head_dim):
    """E‖x - x̃‖² for unit x, from the codebooks' D_mse.

    The code groups mix by their share of the D_pad rotated coordinates; the QJL stage multiplies the residual's
    error by π/2 (QJL lemma 3.2 with m = D_pad rows: π/2 - 1/m). With padding only head_dim of the D_pad
    coordinates are kept. The Prod error is unbiased and spread evenly: a head_dim / D_pad share is kept. The MSE
    variant's error has a mean component ⟨e, y⟩ y = D_mse · y along y (centroid condition), which lies in the kept
    subspace, and the rest (D_mse - D_mse²) spreads over the D_pad - 1 directions orthogonal to y.
    """
    dim = params.rotated_dim(head_dim)
    per_group = [(n, codebook(dim, b).mse if b else 1.0) for _, n, b in params.groups(head_dim)]
    total = sum(n * e for n, e in per_group) / dim
    if params.method == "turboquant_prod":
        return math.pi / 2 * total * head_dim / dim
    return total**2 + (total - total**2) * (head_dim - 1) / max(dim - 1, 1)


# -- codebooks ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_centroids_against_reference(bits):
    """Our centroids solve the Lloyd-Max conditions to machine precision; the published table agrees to 0.006
    (× sqrt(d)) and its codebook has the same D_mse to 0.1%. (The table's 4-bit inner centroids, 0.1335 and
    0.3918, are not the fixed point: the exact 1-bit centroid is E|x| sqrt(d) = 0.79944, and independent
    per-cell quadrature gives 0.1279 and 0.3864; the objective is flat there, hence the equal D_mse.)"""
    d, ref = 128, np.array(CENTROIDS_128[bits])
    book = codebook(d, bits)
    ours = np.array(book.centroids)[2 ** (bits - 1):] * math.sqrt(d)
    assert np.max(np.abs(ours - ref)) < 0.006
    table = np.concatenate([-ref[::-1], ref]) / math.sqrt(d)
    mass, moment = codebook_module._cells(table, d)
    table_mse = 1 - d * np.sum(2 * table * moment - table**2 * mass)
    assert table_mse == pytest.approx(book.mse, rel=1e-3) and book.mse <= table_mse + 1e-12
    assert book.mse == pytest.approx(DISTORTION[(bits, d)], abs=6e-5)


def test_codebook_exact_one_bit_and_gaussian_limit():
    d = 128  # 1 bit: the centroid is E|x| = Γ(d/2) / (sqrt(π) Γ((d+1)/2))
    exact = math.exp(math.lgamma(d / 2) - math.lgamma((d + 1) / 2)) / math.sqrt(math.pi)
    assert lloyd_max(d, 1)[0][1] == pytest.approx(exact, rel=1e-9)
    centroids, _ = lloyd_max(2**20, 4)  # d → ∞: Max's Gaussian quantizer
    assert np.allclose(centroids[8:] * 2**10, MAX_GAUSSIAN_16, atol=2e-4)


def test_codebook_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path))
    assert codebook_module.cache_dir() == tmp_path / "codebooks"
    first = load_or_compute(32, 3)
    (path,) = (tmp_path / "codebooks").glob("*.json")
    monkeypatch.setattr(codebook_module, "lloyd_max", lambda *a: pytest.fail("recomputed a cached codebook"))
    assert np.array_equal(load_or_compute(32, 3)[0], first[0])
    path.write_text("{not json")
    monkeypatch.undo()
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path))
    assert np.array_equal(load_or_compute(32, 3)[0], first[0])  # a corrupt file is recomputed


def test_codebook_cache_is_under_kvqs_cache_folder(tmp_path, monkeypatch):
    """Codebooks live where kvq keeps everything else (kvq.paths.cache_root): ``~`` in KVQ_CACHE_DIR expanded, and
    the platformdirs folder when it is unset."""
    from kvq.paths import cache_root

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KVQ_CACHE_DIR", "~/kvq-cache")
    assert codebook_module.cache_dir() == tmp_path / "kvq-cache" / "codebooks"
    monkeypatch.delenv("KVQ_CACHE_DIR")
    assert codebook_module.cache_dir() == cache_root() / "codebooks"


# -- rotations ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hadamard", "qr"])
def test_rotation_is_orthogonal_and_seeded(kind):
    r = rotation(kind, 64, 7).dense()
    assert mx.allclose(r @ r.T, mx.eye(64), atol=1e-5).item()
    np.random.seed(123)
    mx.random.seed(123)
    rotation.cache_clear()  # rebuilt under other global seeds: same matrix (no global state)
    assert mx.array_equal(rotation(kind, 64, 7).dense(), r).item()
    assert not mx.allclose(rotation(kind, 64, 8).dense(), r).item()
    x = mx.random.normal((3, 64))
    assert mx.allclose(rotation(kind, 64, 7).inverse(rotation(kind, 64, 7).forward(x)), x, atol=1e-5).item()


def test_padding_to_a_power_of_two():
    assert [power_of_two_dim(d) for d in (1, 2, 64, 80, 96, 128, 192, 576)] == [2, 2, 64, 128, 128, 128, 256, 1024]


# -- distortion and inner products (unit vectors) -------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_mse_distortion_against_reference(bits, d):
    # 20,000 vectors: the statistical error of the mean is below 0.3% of it
    x = unit_vectors(20000, d, seed=bits * 1000 + d)
    _, x_hat = _round_trip("turboquant", x, bits=bits)
    assert mx.mean(mx.sum((x - x_hat) ** 2, axis=-1)).item() == pytest.approx(DISTORTION[(bits, d)], rel=0.03)
    if d == 128:  # E⟨y, x̃⟩ = s ⟨y, x⟩: the least-squares slope over independent unit y
        y = unit_vectors(20000, d, seed=bits)
        exact, estimate = mx.sum(x * y, axis=-1), mx.sum(x_hat * y, axis=-1)
        slope = (mx.sum(exact * estimate) / mx.sum(exact * exact)).item()
        assert slope == pytest.approx(SHRINK[bits], rel=0.05)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_prod_is_unbiased_with_reference_error(bits):
    d = 128
    x, y = unit_vectors(20000, d, seed=bits), unit_vectors(20000, d, seed=100 + bits)
    _, x_hat = _round_trip("turboquant_prod", x, bits=bits)
    exact, estimate = mx.sum(x * y, axis=-1), mx.sum(x_hat * y, axis=-1)
    slope = (mx.sum(exact * estimate) / mx.sum(exact * exact)).item()
    assert slope == pytest.approx(1.0, abs=0.03)  # unbiased (the MSE variant's slope is 0.64 at 1 bit)
    assert d * mx.mean((exact - estimate) ** 2).item() == pytest.approx(PROD_ERROR_128[bits], rel=0.05)


def test_qr_and_hadamard_give_the_same_distortion():
    x = unit_vectors(20000, 128, seed=5)
    errors = [mx.mean(mx.sum((x - _round_trip("turboquant", x, bits=2, rotation=kind)[1]) ** 2, -1)).item()
              for kind in ("hadamard", "qr")]
    assert errors[0] == pytest.approx(errors[1], rel=0.02) == pytest.approx(DISTORTION[(2, 128)], rel=0.03)


# -- large norms, padding, mixed precision ----------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_norm_700_keys_in_float16(method):
    x = unit_vectors(2000, 128, seed=3)
    keys = (x * 700).astype(mx.float16)  # ‖k‖² ≈ 4.9e5 overflows float16
    encoded, k_hat = _round_trip(method, keys, bits=3)
    assert mx.all(mx.isfinite(k_hat)).item()
    assert mx.allclose(encoded.data["norms"].astype(mx.float32), mx.array(700.0), rtol=1e-3).item()
    k32 = keys.astype(mx.float32)
    relative = (mx.sum((k_hat - k32) ** 2) / mx.sum(k32**2)).item()
    unit_relative = mx.mean(mx.sum((x - _round_trip(method, x, bits=3)[1]) ** 2, -1)).item()
    assert relative == pytest.approx(unit_relative, rel=0.03)
    _, k16 = _round_trip(method, keys, dtype=mx.float16, bits=3)
    assert k16.dtype == mx.float16 and mx.all(mx.isfinite(k16)).item()


def test_float32_norms_beyond_the_float16_range():
    x = unit_vectors(100, 64, seed=4) * 1e6
    _, x_hat = _round_trip("turboquant", x, bits=4, norm_dtype="float32")
    assert (mx.sum((x - x_hat) ** 2) / mx.sum(x**2)).item() < 2 * DISTORTION[(4, 64)]


def test_zero_vectors_decode_to_zero():
    _, x_hat = _round_trip("turboquant_prod", mx.zeros((1, 2, 3, 64), mx.float16), bits=2)
    assert mx.array_equal(x_hat, mx.zeros_like(x_hat)).item()


@pytest.mark.parametrize("head_dim", [80, 96, 192])
def test_padded_head_dims(head_dim):
    x = unit_vectors(4000, head_dim, seed=head_dim)
    encoded, x_hat = _round_trip("turboquant", x, bits=3)
    assert encoded.data["codes"].shape == (1, 1, 4000, packing.packed_words(encoded.params.rotated_dim(head_dim), 3))
    assert x_hat.shape == x.shape
    expected = _expected_distortion(encoded.params, head_dim)  # the padding's share of the error is dropped
    assert mx.mean(mx.sum((x - x_hat) ** 2, axis=-1)).item() == pytest.approx(expected, rel=0.03)


def test_mixed_precision_lies_between_its_bit_widths():
    x = unit_vectors(5000, 128, seed=9)
    encoded, x_hat = _round_trip("turboquant", x, bits=2, outlier_channels=64, outlier_bits=3)
    error = mx.mean(mx.sum((x - x_hat) ** 2, axis=-1)).item()
    assert error == pytest.approx(_expected_distortion(encoded.params, 128), rel=0.03)
    assert DISTORTION[(3, 128)] < error < DISTORTION[(2, 128)]
    # the paper's "2.5-bit" setting: 2.5 bits of codes, plus the float16 norm: (64·3 + 64·2 + 16) / 128
    assert encoded.params.accounting(128).bits_per_coordinate == 2.625


# -- attention ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("key_method, value_method", [("turboquant", "turboquant"),
                                                      ("turboquant_prod", "turboquant_prod"),
                                                      ("turboquant_prod", "turboquant")])
@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("causal", [False, True])
def test_attend_equals_attention_over_dequantized(key_method, value_method, head_dim, causal):
    B, Hq, Hkv, Tq, T = 1, 8, 2, 5, 300  # two blocks of keys
    q = mx.random.normal((B, Hq, Tq, head_dim))
    k = (mx.random.normal((B, Hkv, T, head_dim)) * 3).astype(mx.float16)
    v = mx.random.normal((B, Hkv, T, head_dim)).astype(mx.bfloat16)
    keys, k_hat = _round_trip(key_method, k, bits=3)
    values, v_hat = _round_trip(value_method, v, bits=2, outlier_channels=32, seed=1)
    mask = (mx.arange(T - Tq, T)[:, None] >= mx.arange(T)[None]) if causal else None
    plan = kvq.select(key_method, k.shape, params=keys.params, op="attend", num_q_heads=Hq)
    out, lse = plan.attend(q, keys, values, head_dim**-0.5, mask)
    ref_out, ref_lse = reference_attention(q, k_hat, v_hat, head_dim**-0.5, mask)
    assert out.shape == (B, Hq, Tq, head_dim) and out.dtype == mx.float32
    assert mx.allclose(out, ref_out, rtol=1e-3, atol=1e-4).item()
    assert mx.allclose(lse, ref_lse, rtol=1e-4, atol=1e-4).item()


def test_attend_mixes_with_affine_on_either_side():
    B, Hq, Hkv, Tq, T, D = 1, 4, 2, 3, 70, 64
    q = mx.random.normal((B, Hq, Tq, D))
    k, v = (mx.random.normal((B, Hkv, T, D)).astype(mx.float16) for _ in range(2))
    affine = kvq.select("affine", k.shape, op="dequantize").choices["dequantize"].implementation
    tq = TurboQuantMLX("turboquant")
    k_tq, k_tq_hat = _round_trip("turboquant", k, bits=4)
    v_aff, v_aff_hat = _round_trip("affine", v)
    out, _ = attend_encoded(q, k_tq, v_aff, D**-0.5, None, tq, affine, block_size=32)
    assert mx.allclose(out, reference_attention(q, k_tq_hat, v_aff_hat, D**-0.5, None)[0], rtol=1e-3, atol=1e-4)
    k_aff, k_aff_hat = _round_trip("affine", k)
    v_tq, v_tq_hat = _round_trip("turboquant_prod", v, bits=3)
    out, _ = attend_encoded(q, k_aff, v_tq, D**-0.5, None, affine, tq, block_size=32)
    ref, _ = dense_attend(q, k_aff_hat, v_tq_hat, D**-0.5)
    assert mx.allclose(out, ref, rtol=1e-3, atol=1e-4).item()


# -- properties over shapes, dtypes and bit widths ------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(method=st.sampled_from(METHODS), bits=st.integers(1, 4), outlier_bits=st.integers(1, 4),
       shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(0, 9),
                       st.sampled_from([1, 2, 3, 16, 40, 64, 80, 96, 128])),
       outlier_share=st.sampled_from([0, 0.25, 1.0]), dtype=st.sampled_from([mx.float16, mx.bfloat16, mx.float32]),
       seed=st.integers(0, 2**16))
def test_round_trip_properties(method, bits, outlier_bits, shape, outlier_share, dtype, seed):
    B, H, T, D = shape
    x = mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)
    outliers = int(outlier_share * power_of_two_dim(D))
    params = kvq.make_params(method, bits=bits, outlier_channels=outliers, outlier_bits=outlier_bits, seed=seed)
    impl = TurboQuantMLX(method)
    encoded = impl.kvq_quantize(x, params)
    # every field has the token axis at 2, and the arrays hold exactly what the accounting says
    assert all(a.shape[:3] == (B, H, T) for a in encoded.data.values()) and encoded.shape == shape
    assert encoded.nbytes == params.accounting(D).bytes_for(B, H, T)
    # codes are the nearest centroids of the rotated unit vectors, and survive pack/unpack exactly
    y = mse.rotation_of(params, D).forward(mse.normalise(x)[0])
    start = 0
    for name, count, group_bits in params.groups(D):
        if count and group_bits:
            codes = packing.unpack(encoded.data[name], group_bits, count)
            expected = codebook(params.rotated_dim(D), group_bits).encode(y[..., start:start + count])
            assert mx.array_equal(codes, expected).item()
            assert mx.array_equal(mse.pack_codes(codes, group_bits), encoded.data[name]).item()
        start += count
    x_hat = impl.kvq_dequantize(encoded, dtype)
    assert x_hat.dtype == dtype and x_hat.shape == shape
    assert mx.all(mx.isfinite(impl.kvq_dequantize(encoded, mx.float32))).item()
    if D >= 16:  # error of 64 vectors of this kind within the codebooks' expectation (which assumes D is not tiny)
        x = mx.array(np.random.default_rng(seed + 1).standard_normal((1, 2, 32, D)).astype(np.float32)).astype(dtype)
        x32, x_hat32 = x.astype(mx.float32), impl.kvq_dequantize(impl.kvq_quantize(x, params), mx.float32)
        relative = mx.mean(mx.sum((x32 - x_hat32) ** 2, -1) / mx.sum(x32**2, -1)).item()
        # a loose statistical bound (precision is the 20,000-vector tests' job): the mean over 64 vectors, set by
        # the smallest code group, plus for _prod the one fixed sketch S of D_pad rows (its error deviates from the
        # average over S by ~1/sqrt(D_pad)); over 3,000 random cases the error stayed below 88% of it
        smallest = min(n for _, n, _ in params.groups(D) if n)
        slack = (1 + 20 / math.sqrt(64 * smallest)) * (1 + 8 / math.sqrt(params.rotated_dim(D)) * (
            method == "turboquant_prod"))
        assert relative <= _expected_distortion(params, D) * slack + 2e-3


# -- parameters, errors, accounting, registration --------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    ({"bits": 5}, ValueError, r"bits must be one of 1, 2, 3, 4; got 5"),
    ({"bits": 0}, ValueError, r"bits must be one of 1, 2, 3, 4; got 0"),
    ({"bits": "4"}, ValueError, r"bits must be one of 1, 2, 3, 4; got '4'"),  # a string, as from a config file
    ({"rotation": "foo"}, ValueError, r"rotation must be one of hadamard, qr; got 'foo'"),
    ({"outlier_bits": 8}, ValueError, r"outlier_bits must be one of 1, 2, 3, 4; got 8"),
    ({"seed": -1}, ValueError, r"seed must be an int >= 0; got -1"),
    ({"outlier_channels": 2.5}, ValueError, r"outlier_channels must be an int >= 0; got 2.5"),
    ({"norm_dtype": "bfloat16"}, ValueError, r"norm_dtype must be one of float16, float32; got 'bfloat16'"),
    ({"group_size": 64}, TypeError, r"unknown parameter\(s\) group_size .* allowed: bits, rotation, seed"),
])
@pytest.mark.parametrize("method", METHODS)
def test_bad_parameters_are_rejected(method, kwargs, error, match):
    with pytest.raises(error, match=match):
        kvq.make_params(method, **kwargs)


@pytest.mark.parametrize("bad, error, match", [
    (mx.zeros((2, 64, 64)), ValueError, r"x must have rank 4 \(\[B, H, T, D\]\)"),
    (mx.zeros((1, 1, 4, 64), mx.int32), TypeError, r"x must have dtype float16, bfloat16 or float32"),
    (np.zeros((1, 1, 4, 64)), TypeError, r"x must be an mx.array"),
    (mx.zeros((1, 1, 4, 2048)), ValueError, r"head_dim 2048 is not supported: it must be an int in 1..1024"),
])
def test_quantize_rejects_bad_input(bad, error, match):
    with pytest.raises(error, match=match):
        TurboQuantMLX("turboquant").kvq_quantize(bad, kvq.make_params("turboquant"))


def test_mismatches_are_rejected():
    impl = TurboQuantMLX("turboquant")
    with pytest.raises(TypeError, match="params must be a TurboQuantParams for method 'turboquant'"):
        impl.kvq_quantize(mx.zeros((1, 1, 4, 64)), kvq.make_params("turboquant_prod"))
    with pytest.raises(ValueError, match="outlier_channels must be at most 64, the next power of two of head_dim 64"):
        impl.kvq_quantize(mx.zeros((1, 1, 4, 64)), kvq.make_params("turboquant", outlier_channels=65))
    keys = impl.kvq_quantize(mx.ones((1, 1, 4, 64)), kvq.make_params("turboquant"))
    with pytest.raises(ValueError, match="queries: head_dim 32 does not match the keys' 64"):
        impl.kvq_attend(mx.ones((1, 1, 1, 32)), keys, keys, 1.0, None)
    affine = kvq.select("affine", (1, 1, 4, 64), op="quantize").quantize(mx.ones((1, 1, 4, 64)),
                                                                         kvq.make_params("affine"))
    with pytest.raises(ValueError, match="values: turboquant attend needs turboquant or turboquant_prod"):
        impl.kvq_attend(mx.ones((1, 1, 1, 64)), keys, affine, 1.0, None)
    with pytest.raises(ValueError, match="head_dim 4096 is not supported"):
        kvq.select("turboquant", (1, 1, 16, 4096))


@pytest.mark.parametrize("method, head_dim, params, bits_per_coordinate", [
    ("turboquant", 128, {"bits": 4}, 4.125),
    ("turboquant", 128, {"bits": 3}, 3.125),
    ("turboquant", 128, {"bits": 2, "outlier_channels": 64, "outlier_bits": 3}, 2.625),
    ("turboquant", 128, {"bits": 3, "outlier_channels": 64, "outlier_bits": 4}, 3.625),
    ("turboquant", 128, {"bits": 2, "outlier_channels": 32, "outlier_bits": 3}, 2.375),
    # 48 codes of 3 bits take 144 bits, stored as 5 whole words (160 bits): word rounding is paid for
    ("turboquant", 128, {"bits": 2, "outlier_channels": 48, "outlier_bits": 3}, (160 + 160 + 16) / 128),
    ("turboquant", 128, {"bits": 4, "norm_dtype": "float32"}, 4.25),
    ("turboquant", 64, {"bits": 4}, 4.25),
    ("turboquant", 96, {"bits": 4}, (4 * 96 + 16) / 96),  # 96 = 12 · 8 is a Hadamard size: no padding
    ("turboquant_prod", 128, {"bits": 1}, 1.25),  # signs + two norms
    ("turboquant_prod", 128, {"bits": 3}, 3.25),
    ("turboquant_prod", 128, {"bits": 4}, 4.25),
    # rotated at 80 = 20 · 4: 5 outlier codes of 2 bits fill one word, 75 codes of 1 bit three words; 80 signs
    # three words; two float16 norms
    ("turboquant_prod", 80, {"bits": 2, "outlier_channels": 5}, (32 + 96 + 96 + 16 + 16) / 80),
])
def test_bits_accounting_matches_the_arrays(method, head_dim, params, bits_per_coordinate):
    params = kvq.make_params(method, **params)
    accounting = params.accounting(head_dim)
    assert accounting.bits_per_coordinate == pytest.approx(bits_per_coordinate)
    assert accounting.shared_bytes > 0 and "norms" in accounting.per_token
    encoded = TurboQuantMLX(method).kvq_quantize(mx.random.normal((2, 3, 17, head_dim)), params)
    assert encoded.nbytes == accounting.bytes_for(2, 3, 17)


def test_methods_are_registered_and_selectable():
    assert {"turboquant", "turboquant_prod"} <= set(kvq.methods())
    assert not any("turboquant" in message for message in kvq.registry().failures.values())
    for method in METHODS:
        plan = kvq.select(method, (1, 8, 4096, 128), num_q_heads=32)
        for op in ("quantize", "dequantize", "attend"):
            choice = plan.choices[op]  # on a CPU problem the mlx implementation is chosen (kernels need a GPU)
            (chosen,) = [c for c in choice.candidates if c.backend == choice.backend]
            assert choice.backend == "mlx" and 0 < chosen.cost < 1
        assert plan.choices["pack"].implementation.method == "*"
