"""qjl keys: an unbiased estimator with the published variance, attention from sign sketches, honest bits.

Reference: ../shared/REFERENCE_VALUES.md, "QJL (Zandieh et al., arXiv 2406.03482)": score estimate
sqrt(π/2)/m · ‖k‖ · ⟨S q, sign(S k)⟩ is unbiased; with i.i.d. Gaussian S and unit q, k, m · Var ≈ π/2 − ⟨q,k⟩²;
rows orthogonalised in blocks of d give about 2.8x lower variance. "Known pitfalls": key norms of several
hundred overflow fp16 products; sqrt of a difference of rounded norms can go negative.

Tolerances assume full float32 matmuls, as on the CPU back end (CI). MLX runs float32 matmuls in TF32 on
NVIDIA GPUs and Apple M5 by default; run GPU checks with ``MLX_ENABLE_TF32=0`` (all pass on an H200 so, except
those with affine values: MLX 0.32.4's CUDA back end has no float32 ``quantized_matmul`` with
``transpose=False``, which the affine baseline's ``weighted_values`` uses).
"""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvq
from kvq import packing
from kvq.attention import attend_encoded
from kvq_backends_qjl import QJLMLX, attend
from kvq_backends_qjl.signs import pack_signs, unpack_signs
from kvq_backends_qjl.sketch import OUTLIER_STREAM, expected_gaussian_norm, make_sketch

RHOS = (0.0, 0.5, 0.9)
IMPL = QJLMLX()


def _pairs(rng, n, d, rho):
    """``n`` uniformly rotated unit pairs ``(q, k)`` with ``⟨q, k⟩ = rho`` exactly (float32 ``[n, d]``)."""
    q = rng.standard_normal((n, d))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    p = rng.standard_normal((n, d))
    p -= (p * q).sum(1, keepdims=True) * q
    p /= np.linalg.norm(p, axis=1, keepdims=True)
    return q.astype(np.float32), (rho * q + math.sqrt(1 - rho**2) * p).astype(np.float32)


def _estimate_pairs(params, q, k):
    """The implementation's score for each pair (pairs on the batch axis): float64 ``[n]``."""
    enc = IMPL.kvq_quantize(mx.array(k)[:, None, None], params)
    prepared = IMPL.prepare_queries(mx.array(q)[:, None, None, None], enc)
    return np.array(IMPL.scores(prepared, enc, 0, 1)).reshape(-1).astype(np.float64)


@lru_cache(maxsize=None)
def _errors(kind, seeds, pairs_per_seed, d=128, m=256):
    """Estimate minus truth, ``[seeds, len(RHOS), pairs_per_seed]``: one sketch draw (seed) per row."""
    rng = np.random.default_rng(2406)
    out = np.empty((seeds, len(RHOS), pairs_per_seed))
    for seed in range(seeds):
        params = kvq.make_params("qjl", sketch=kind, sketch_dim=m, outlier_channels=0, seed=seed)
        q, k = zip(*(_pairs(rng, pairs_per_seed, d, rho) for rho in RHOS))
        est = _estimate_pairs(params, np.concatenate(q), np.concatenate(k)).reshape(len(RHOS), -1)
        out[seed] = est - np.array(RHOS)[:, None]
    return out


# Gaussian: E[score | S] = ρ · mean‖s_row‖ / E‖g‖ varies with S, so unbiasedness needs many sketch draws.
# Orthogonal: every row has norm sqrt(d), so E[score | S] = ρ for each S and one draw suffices.
DESIGNS = {"gaussian": (256, 64), "orthogonal": (1, 16384)}


@pytest.mark.parametrize("kind", ["gaussian", "orthogonal"])
@pytest.mark.parametrize("r", range(len(RHOS)))
def test_estimator_is_unbiased(kind, r):
    """Mean error below 3σ/sqrt(N): N independent trials (sketch draws for Gaussian S, pairs for orthogonal)."""
    err = _errors(kind, *DESIGNS[kind])[:, r]
    trials = err.mean(axis=1) if kind == "gaussian" else err[0]
    assert abs(trials.mean()) < 3 * trials.std(ddof=1) / math.sqrt(trials.size)


@pytest.mark.parametrize("r", range(len(RHOS)))
def test_gaussian_variance_matches_pi_over_2_minus_rho_squared(r):
    m_var = 256 * np.mean(_errors("gaussian", *DESIGNS["gaussian"])[:, r] ** 2)
    assert m_var == pytest.approx(math.pi / 2 - RHOS[r] ** 2, rel=0.05)


@pytest.mark.parametrize("r", range(len(RHOS)))
def test_orthogonal_sketch_has_at_least_half_the_variance(r):
    """Reference ≈2.8x; measured 2.7x at ρ = 0, 3.0x at 0.5, 4.7x at 0.9 (d = 128, m = 256)."""
    gaussian = np.mean(_errors("gaussian", *DESIGNS["gaussian"])[:, r] ** 2)
    orthogonal = np.mean(_errors("orthogonal", *DESIGNS["orthogonal"])[:, r] ** 2)
    assert gaussian / orthogonal >= 2.0


def test_estimator_constants():
    """sqrt(π/2)/m for Gaussian S (the paper); orthogonal rows have norm sqrt(d), not E‖g‖, so c is rescaled."""
    assert expected_gaussian_norm(1) == pytest.approx(math.sqrt(2 / math.pi))
    assert expected_gaussian_norm(2) == pytest.approx(math.sqrt(math.pi / 2))
    assert expected_gaussian_norm(3) == pytest.approx(2 * math.sqrt(2 / math.pi))
    assert make_sketch(128, 256, "gaussian").estimator_scale == pytest.approx(math.sqrt(math.pi / 2) / 256)
    orth = make_sketch(64, 96, "orthogonal")
    assert orth.estimator_scale == pytest.approx(math.sqrt(math.pi / 2) * expected_gaussian_norm(64) / 8 / 96)
    rows = np.array(orth.matrix, dtype=np.float64)
    assert np.allclose(rows[:64] @ rows[:64].T, 64 * np.eye(64), atol=1e-3)  # one block: orthogonal rows
    assert np.allclose(np.linalg.norm(rows, axis=1), 8.0, atol=1e-4)


def test_small_outlier_sketch_is_unbiased():
    """The 4-dim outlier sketch: sqrt(π/2) alone would overestimate by sqrt(4)/E‖g‖ − 1 = 6%."""
    rng = np.random.default_rng(7)
    q, k = _pairs(rng, 20000, 4, 0.8)
    errors = []
    for seed in range(4):
        sketch = make_sketch(4, 64, "orthogonal", seed, OUTLIER_STREAM)
        s = np.array(sketch.matrix, dtype=np.float64)
        errors.append(sketch.estimator_scale * np.sum((q @ s.T) * np.sign(k @ s.T), axis=1) - 0.8)
    err = np.concatenate(errors)
    assert abs(err.mean()) < 3 * err.std() / math.sqrt(err.size)


def test_sketch_is_reproducible_across_processes():
    code = ("import hashlib, numpy as np; from kvq_backends_qjl.sketch import make_sketch; "
            "print(*(hashlib.sha256(np.array(make_sketch(64, 128, k, 5).matrix).tobytes()).hexdigest() "
            "for k in ('gaussian', 'orthogonal')))")
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    ours = [hashlib.sha256(np.array(make_sketch(64, 128, k, 5).matrix).tobytes()).hexdigest()
            for k in ("gaussian", "orthogonal")]
    assert theirs == ours
    assert not np.array_equal(np.array(make_sketch(64, 128, "gaussian", 5).matrix),
                              np.array(make_sketch(64, 128, "gaussian", 6).matrix))


# -- the stored form ----------------------------------------------------------------------------------------

def _reference_scores(q, enc):
    """Scores from the stored fields in float64 numpy: c/m ‖k_in‖ ⟨S q, σ⟩ + c_o/m_o ‖k_out‖ ⟨S_o q_out, σ_o⟩.

    :param q: ``[B, H_q, T_q, D]`` (already scaled). :return: ``[B, H_q, T_q, T]``.
    """
    p, d = enc.params, {n: np.array(a) for n, a in enc.data.items()}
    B, H, T, D = enc.shape
    qn = np.array(q, dtype=np.float64).reshape(B, H, -1, q.shape[2], D)
    sketch = make_sketch(D, p.sketch_dim_for(D), p.sketch, p.seed)
    signs = np.unpackbits(d["signs"], axis=-1, bitorder="little") * 2.0 - 1
    sq = qn @ np.array(sketch.matrix, dtype=np.float64).T
    s = np.einsum("bhrqm,bhtm->bhrqt", sq, signs) * d["norms"].astype(np.float64)[:, :, None, None]
    s *= sketch.estimator_scale
    if p.outlier_channels:
        so = make_sketch(p.outlier_channels, p.resolved_outlier_sketch_dim, p.sketch, p.seed, OUTLIER_STREAM)
        q_out = np.take_along_axis(qn[:, :, :, :, None, :], d["outlier_indices"][:, :, None, None].astype(int), -1)
        osigns = np.unpackbits(d["outlier_signs"], axis=-1, bitorder="little") * 2.0 - 1
        dots = np.sum((q_out @ np.array(so.matrix, dtype=np.float64).T) * osigns[:, :, None, None], axis=-1)
        s += so.estimator_scale * d["outlier_norms"].astype(np.float64)[:, :, None, None] * dots
    return s.reshape(B, -1, q.shape[2], T)


def test_quantize_stores_signs_of_the_inlier_sketch_and_group_outliers():
    B, H, T, D, g = 1, 2, 70, 64, 32
    x = np.random.default_rng(3).standard_normal((B, H, T, D)).astype(np.float32)
    x[..., 5] *= 20  # a strong outlier channel
    params = kvq.make_params("qjl", outlier_channels=3, group_size=g)
    enc = IMPL.kvq_quantize(mx.array(x), params)
    for start in range(0, T, g):  # numpy top-3 channels by norm over each group
        energy = (x[:, :, start:start + g] ** 2).sum(axis=2)
        top = np.sort(np.argsort(-energy, axis=-1)[..., :3], axis=-1)
        assert np.array_equal(np.array(enc.data["outlier_indices"][:, :, start:start + g]),
                              np.broadcast_to(top[:, :, None], (B, H, min(g, T - start), 3)))
    idx = np.array(enc.data["outlier_indices"]).astype(int)
    inliers = x.copy()
    np.put_along_axis(inliers, idx, 0.0, axis=-1)
    sketch = np.array(make_sketch(D, 128, "orthogonal").matrix)
    expected = np.packbits(inliers @ sketch.T >= 0, axis=-1, bitorder="little")
    assert np.mean(np.unpackbits(expected ^ np.array(enc.data["signs"]))) < 1e-3  # fp32 rounding near 0
    assert np.allclose(np.array(enc.data["norms"]), np.linalg.norm(inliers, axis=-1), rtol=1e-3)
    outliers = np.take_along_axis(x, idx, axis=-1)
    assert np.allclose(np.array(enc.data["outlier_norms"]), np.linalg.norm(outliers, axis=-1), rtol=1e-3)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_keys_with_all_energy_in_outlier_channels_give_finite_scores(head_dim):
    """Large fp16 keys (norm ~700) living only in the outlier channels: inlier norm exactly 0, no NaN."""
    x = np.zeros((1, 2, 40, head_dim), np.float32)
    x[..., [3, 17, 30, 41]] = np.random.default_rng(head_dim).standard_normal((1, 2, 40, 4)) * 350
    params = kvq.make_params("qjl", outlier_channels=4)
    enc = IMPL.kvq_quantize(mx.array(x).astype(mx.float16), params)
    assert np.all(np.array(enc.data["norms"]) == 0)
    q = mx.random.normal((1, 4, 2, head_dim)) * 30
    s = IMPL.scores(IMPL.prepare_queries(q.reshape(1, 2, 2, 2, head_dim), enc), enc, 0, 40)
    assert mx.all(mx.isfinite(s)).item()
    keys = x.astype(np.float16).astype(np.float32)[:, :, None]
    exact = np.array(q).reshape(1, 2, 2, 2, head_dim) @ keys.swapaxes(-1, -2)
    assert np.sqrt(np.mean((np.array(s) - exact) ** 2) / np.mean(exact**2)) < 0.35  # measured 0.17-0.20
    affine = kvq.registry().implementations[("affine", "mlx")]
    values = affine.kvq_quantize(mx.array(x).astype(mx.float16), kvq.make_params("affine"))
    out, lse = IMPL.kvq_attend(q, enc, values, head_dim**-0.5, None)
    assert mx.all(mx.isfinite(out)).item() and mx.all(mx.isfinite(lse)).item()


def test_one_outlier_channel_with_orthogonal_sketch_is_exact():
    """A 1-dim orthogonal sketch is ±1, so its estimate c·|x|·q·sign(x) with c = 1 is exact."""
    x = np.zeros((1, 1, 8, 64), np.float32)
    x[..., 9] = np.linspace(-700, 700, 8)
    enc = IMPL.kvq_quantize(mx.array(x), kvq.make_params("qjl", outlier_channels=1))
    q = mx.random.normal((1, 1, 1, 64))
    s = IMPL.scores(IMPL.prepare_queries(q[:, :, None], enc), enc, 0, 8)
    assert np.allclose(np.array(s).ravel(), np.array(q)[0, 0, 0, 9] * x[0, 0, :, 9], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("sketch_dim, outlier_channels", [(None, 4), (72, 0), (72, 2), (128, 0)])
@pytest.mark.parametrize("mask_kind", ["none", "causal"])
@pytest.mark.parametrize("value_method", ["affine", "fp16"])
def test_attend_equals_softmax_of_estimated_scores(sketch_dim, outlier_channels, mask_kind, value_method):
    """GQA (8 query heads on 2 kv heads), qjl keys + affine 4-bit (or fp16) values, blocks of 64 keys; m = 72
    takes the unpacked-bits path, multiples of 32 the quantized_matmul path."""
    B, Hq, Hkv, Tq, T, D = 1, 8, 2, 5, 150, 64
    q = mx.random.normal((B, Hq, Tq, D))
    k = (mx.random.normal((B, Hkv, T, D)) * 3).astype(mx.float16)
    v = mx.random.normal((B, Hkv, T, D)).astype(mx.float16)
    params = kvq.make_params("qjl", sketch_dim=sketch_dim, outlier_channels=outlier_channels)
    ke = IMPL.kvq_quantize(k, params)
    vp = kvq.make_params("affine", bits=4, group_size=32) if value_method == "affine" else kvq.make_params("fp16")
    value_impl = kvq.registry().implementations[(value_method, "mlx")]
    ve = value_impl.kvq_quantize(v, vp)
    mask = None if mask_kind == "none" else (mx.arange(T - Tq, T)[:, None] >= mx.arange(T)[None])
    scale = D**-0.5
    out, lse = attend_encoded(q, ke, ve, scale, mask, IMPL, value_impl, block_size=64)
    s = _reference_scores(q * scale, ke)
    if mask is not None:
        s = np.where(np.array(mask), s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    v_hat = np.repeat(np.array(value_impl.kvq_dequantize(ve, mx.float32), dtype=np.float64), Hq // Hkv, axis=1)
    ref = (p / p.sum(axis=-1, keepdims=True)) @ v_hat
    assert np.allclose(np.array(out), ref, rtol=1e-3, atol=1e-4)
    assert np.allclose(np.array(lse), np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1), rtol=1e-4)
    # the registered hook agrees, and dequantize is the estimate whose inner products are the scores
    hook_out, _ = IMPL.kvq_attend(q, ke, ve, scale, mask)
    assert mx.allclose(hook_out, out, rtol=1e-4, atol=1e-5).item()
    k_hat = np.repeat(np.array(IMPL.kvq_dequantize(ke, mx.float32), dtype=np.float64), Hq // Hkv, axis=1)
    assert np.allclose(np.array(q * scale, dtype=np.float64) @ k_hat.swapaxes(-1, -2),
                       _reference_scores(q * scale, ke), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("bits", [0, 1])
def test_score_paths_agree(bits, monkeypatch):
    """Unpacked ±1 floats (0, GPUs and m not a multiple of 32) and 1-bit codes read in place (1, CPU)."""
    if bits == 1 and mx.default_device() != mx.cpu:
        pytest.skip("MLX 0.32's GPU back ends have no 1-bit quantized_matmul")
    monkeypatch.setattr(attend, "code_bits", lambda sketch_dim, query_rows: bits)
    enc = IMPL.kvq_quantize(mx.random.normal((2, 2, 300, 64)) * 20, kvq.make_params("qjl", sketch_dim=96))
    q = mx.random.normal((2, 6, 3, 64))
    s = IMPL.scores(IMPL.prepare_queries(q.reshape(2, 2, 3, 3, 64), enc), enc, 17, 300)
    ref = _reference_scores(q, enc)[..., 17:]
    assert np.allclose(np.array(s).reshape(ref.shape), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_attend_through_select_and_empty_keys():
    plan = kvq.select("qjl", (1, 2, 0, 64))
    ke = plan.quantize(mx.zeros((1, 2, 0, 64)), plan.params)
    ve = kvq.select("fp16", (1, 2, 0, 64)).quantize(mx.zeros((1, 2, 0, 64)), kvq.make_params("fp16"))
    out, lse = plan.attend(mx.random.normal((1, 4, 1, 64)), ke, ve, 0.125, None)
    assert ke.num_tokens == 0 and mx.all(out == 0).item() and mx.all(lse == -mx.inf).item()


# -- accounting and validation ------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim, sketch_dim, outlier_channels, expected", [
    (128, None, 4, 2.75), (128, 128, 4, 1.75), (128, None, 0, 2.125), (128, 128, 0, 1.125),
    (64, None, 4, 3.5), (64, 64, 0, 1.25), (256, None, 4, 2.375)])
def test_bits_accounting_matches_nbytes(head_dim, sketch_dim, outlier_channels, expected):
    params = kvq.make_params("qjl", sketch_dim=sketch_dim, outlier_channels=outlier_channels)
    acc = params.accounting(head_dim)
    assert acc.bits_per_coordinate == expected
    enc = IMPL.kvq_quantize(mx.random.normal((2, 3, 45, head_dim)).astype(mx.bfloat16), params)
    assert enc.nbytes == acc.bytes_for(2, 3, 45)
    assert {n: a.nbytes * 8 / (2 * 3 * 45) for n, a in enc.data.items()} == acc.per_token
    assert acc.shared_bytes == 4 * (params.sketch_dim_for(head_dim) * head_dim
                                    + params.resolved_outlier_sketch_dim * outlier_channels)


def test_registered_through_the_entry_point():
    reg = kvq.registry()
    assert reg.origin["qjl"] == "plugin 'qjl'" and reg.origin[("qjl", "mlx")] == "plugin 'qjl'"
    assert set(kvq.select("qjl", (1, 8, 1024, 128)).choices) == {"quantize", "dequantize", "attend", "pack"}


@pytest.mark.parametrize("kwargs, match", [
    ({"sketch_dim": 100}, r"sketch_dim must be an int >= 8 and a multiple of 8 .*packed 8 per byte.*got 100"),
    ({"sketch_dim": 0}, r"sketch_dim must be an int >= 8"),
    ({"sketch": "foo"}, r"sketch must be one of orthogonal, gaussian; got 'foo'"),
    ({"outlier_channels": -1}, r"outlier_channels must be an int >= 0; got -1"),
    ({"outlier_sketch_dim": 12}, r"outlier_sketch_dim must be an int >= 8 and a multiple of 8"),
    ({"group_size": 0}, r"group_size must be an int >= 1; got 0"),
    ({"seed": 1.5}, r"seed must be an int >= 0; got 1.5"),
])
def test_bad_params_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvq.make_params("qjl", **kwargs)


def test_unknown_param_is_named():
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) bits for method 'qjl'; allowed: sketch_dim"):
        kvq.make_params("qjl", bits=2)


@pytest.mark.parametrize("bad, params, error, match", [
    (mx.zeros((2, 64, 64)), None, ValueError, r"x must have rank 4 \(\[B, H, T, D\]\)"),
    (mx.zeros((1, 1, 4, 64), mx.int32), None, TypeError, r"x must have dtype float16, bfloat16 or float32"),
    (mx.zeros((1, 1, 4, 4)), None, ValueError, r"head_dim 4 is not supported: it must exceed outlier_channels=4"),
    (mx.zeros((1, 1, 4, 64)), kvq.make_params("affine"), TypeError, r"params must be QJLParams"),
])
def test_quantize_rejects_bad_input(bad, params, error, match):
    with pytest.raises(error, match=match):
        IMPL.kvq_quantize(bad, params or kvq.make_params("qjl"))


# -- properties ---------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 3), bytes_=st.integers(1, 24), seed=st.integers(0, 2**31))
def test_sign_bits_round_trip(rows, bytes_, seed):
    x = np.random.default_rng(seed).standard_normal((rows, 8 * bytes_)).astype(np.float32)
    packed = pack_signs(mx.array(x))
    assert packed.dtype == mx.uint8 and packed.shape == (rows, bytes_)
    assert np.array_equal(np.array(unpack_signs(packed)), np.where(x >= 0, 1.0, -1.0))
    bits = mx.array((x >= 0).astype(np.uint32))
    if bytes_ % 4 == 0:  # the layout of kvq.packing (and mx.quantize) for 1-bit codes
        assert mx.array_equal(packed.view(mx.uint32), packing.pack(bits, 1)).item()


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 2), n_rep=st.integers(1, 3), num_queries=st.integers(1, 3),
       num_keys=st.integers(1, 40), head_dim=st.sampled_from([8, 24, 64, 80]), outliers=st.integers(0, 4),
       dtype=st.sampled_from([mx.float16, mx.bfloat16, mx.float32]), magnitude=st.sampled_from([1e-3, 1.0, 100.0]),
       sketch=st.sampled_from(["orthogonal", "gaussian"]), sketch_dim=st.sampled_from([None, 8, 40, 64]))
def test_scores_finite_over_random_shapes(batch, kv_heads, n_rep, num_queries, num_keys, head_dim, outliers,
                                          dtype, magnitude, sketch, sketch_dim):
    params = kvq.make_params("qjl", sketch=sketch, sketch_dim=sketch_dim, outlier_channels=min(outliers, head_dim - 1),
                             group_size=16)
    keys = (mx.random.normal((batch, kv_heads, num_keys, head_dim)) * magnitude).astype(dtype)
    enc = IMPL.kvq_quantize(keys, params)
    q = (mx.random.normal((batch, kv_heads * n_rep, num_queries, head_dim)) * magnitude).astype(dtype)
    prepared = IMPL.prepare_queries(q.astype(mx.float32).reshape(batch, kv_heads, n_rep, num_queries, head_dim), enc)
    s = IMPL.scores(prepared, enc, 0, num_keys)
    assert s.dtype == mx.float32 and s.shape == (batch, kv_heads, n_rep, num_queries, num_keys)
    assert mx.all(mx.isfinite(s)).item()
    ref = _reference_scores(q.astype(mx.float32), enc)  # GPUs may run float32 matmuls in TF32: atol
    assert np.allclose(np.array(s).reshape(ref.shape), ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


def test_a_cache_refuses_qjl_values():
    """QJL's sign sketch estimates inner products, not vectors: a cache must not store values with it (a new user
    ran ``kvq generate --method qjl`` and got qjl values without a word)."""
    from kvq.cache import make_config

    with pytest.raises(ValueError, match=r"qjl compresses keys only.*value_method='affine'.*--value-method affine"):
        make_config("qjl")
    config = make_config(None, key_method="qjl", value_method="affine")
    assert (config.key_params.method, config.value_params.method) == ("qjl", "affine")
