"""Non-finite keys and values (issue #24, item 7): one policy for every registered method, documented once in
``kvq.contract.Quantizes``.

A block of 40 tokens, two KV heads; token 3 of KV head 0 gets a NaN, a +inf, a -inf, or a NaN and a +inf (at
coordinates 5 and 20, both in ``affine``'s first group of 32). For every method, pure MLX: decoding gives that
token non-finite coordinates (``fp16``: the ones given; ``affine``: their group; every other method: all of them)
and every other token exactly what the block with those coordinates set to 0 gives; attention over such a key is
NaN for the queries of that KV head (as ``mx.fast.scaled_dot_product_attention`` over fp16 keys gives for a NaN)
and unchanged for the other head; over such a value, the coordinates it reaches are non-finite. The fused kernels'
side of the policy is in tests/test_kernels_gpu.py.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import kvq
from kvq.contract import Fits, optional_hook
from kvq.plugins import registry

D, T, BAD, POSITIONS = 64, 40, 3, (5, 20)
KINDS = {"nan": (math.nan,), "+inf": (math.inf,), "-inf": (-math.inf,), "nan+inf": (math.nan, math.inf)}
VECINFER_MODEL = "nan-policy"
#: label -> (method, parameters); vecinfer's model, role and layer are added by the ``vecinfer`` fixture
CASES = {
    "fp16": ("fp16", {}),
    "affine": ("affine", {"bits": 4, "group_size": 32}),
    "turboquant": ("turboquant", {"bits": 4}),
    "turboquant[float32 norms]": ("turboquant", {"bits": 3, "norm_dtype": "float32"}),
    "turboquant[rotated outliers]": ("turboquant", {"bits": 2, "outlier_channels": 16, "outlier_bits": 3}),
    "turboquant[data outliers]": ("turboquant", {"bits": 2, "outlier_channels": 16, "outlier_select": "data"}),
    "turboquant_prod": ("turboquant_prod", {"bits": 3}),
    "turboquant_rvq": ("turboquant_rvq", {"bits": 2, "residual_bits": 2}),
    "qjl": ("qjl", {"outlier_channels": 4, "group_size": 8}),
    "qjl[no outliers]": ("qjl", {"outlier_channels": 0}),
    "vecinfer": ("vecinfer", {"sub_dim": 4, "code_bits": 6}),
}


@pytest.fixture(scope="module")
def vecinfer_calibrated(tmp_path_factory):
    """A small synthetic VecInfer calibration (layer 0, two KV heads) in a temporary ``KVQ_DATA_DIR``."""
    from kvq_backends_vecinfer import storage
    from kvq_backends_vecinfer.calibrate import Options, calibrate
    from kvq_backends_vecinfer.collect import Recording
    from kvq_backends_vecinfer.params import VecInferParams

    rng = np.random.default_rng(0)
    keys, values = (mx.array(rng.standard_normal((2, 1024, D)).astype(np.float32)) for _ in range(2))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVQ_DATA_DIR", str(tmp_path_factory.mktemp("kvq-data")))
        storage.forget()
        settings = [VecInferParams(role=r, **CASES["vecinfer"][1]) for r in ("keys", "values")]
        calibrate(Recording([keys], [values], (0,)), VECINFER_MODEL, settings,
                  Options(iterations=4, points_per_centroid=16), progress=False)
        yield
        storage.forget()


def _params(label: str, role: str):
    method, kwargs = CASES[label]
    if method == "vecinfer":
        kwargs = {**kwargs, "model_id": VECINFER_MODEL, "role": role, "layer": 0}
    return method, kvq.make_params(method, **kwargs)


def _encode(label: str, x: mx.array, role: str = "keys"):
    """``x`` encoded by the label's pure-MLX implementation, shared state fitted on ``x`` as a cache would."""
    method, params = _params(label, role)
    fit = optional_hook(params, Fits)
    if fit is not None:
        params = fit(x)
    return registry().implementations[(method, "mlx")].kvq_quantize(x, params)


def _blocks(kind: str) -> tuple[mx.array, mx.array]:
    """``(bad, reference)`` float16 ``[1, 2, T, D]``: token ``BAD`` of KV head 0 with the kind's values at
    :data:`POSITIONS`, and the same block with those coordinates 0."""
    x = np.random.default_rng(1).standard_normal((1, 2, T, D)).astype(np.float16)
    x[0, 0, BAD, list(POSITIONS)] = 0
    bad = x.copy()
    for position, value in zip(POSITIONS, KINDS[kind]):
        bad[0, 0, BAD, position] = value
    return mx.array(bad), mx.array(x)


def _expected_non_finite(label: str, kind: str) -> set[int]:
    """Coordinates of the bad vector that decode non-finite (``kvq.contract.Quantizes``)."""
    method = CASES[label][0]
    if method == "fp16":
        return set(POSITIONS[: len(KINDS[kind])])
    if method == "affine":
        return set(range(32))  # the group of 32 that holds them
    return set(range(D))


def _attend(label: str, keys, values, queries):
    method = CASES[label][0]
    impl = registry().implementations[(method, "mlx")]
    return impl.kvq_attend(queries, keys, values, D**-0.5, None)


def _values_for(label: str, x: mx.array):
    """Values to pair with the label's keys: the same method, or ``affine`` for ``qjl`` (keys only)."""
    return _encode("affine" if CASES[label][0] == "qjl" else label, x, role="values")


def _queries() -> mx.array:
    return mx.array(np.random.default_rng(2).standard_normal((1, 4, 1, D)).astype(np.float16))  # GQA 2


@pytest.fixture
def labels_ready(request):
    if CASES[request.param][0] == "vecinfer":
        request.getfixturevalue("vecinfer_calibrated")
    return request.param


def test_every_registered_method_is_covered():
    assert set(kvq.methods()) <= {method for method, _ in CASES.values()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("labels_ready", CASES, indirect=True)
def test_dequantize_keeps_the_token_non_finite_and_no_other(labels_ready, kind):
    label = labels_ready
    bad, reference = _blocks(kind)
    method = CASES[label][0]
    impl = registry().implementations[(method, "mlx")]
    got = np.array(impl.kvq_dequantize(_encode(label, bad), mx.float32))
    want = np.array(impl.kvq_dequantize(_encode(label, reference), mx.float32))
    assert set(np.flatnonzero(~np.isfinite(got[0, 0, BAD]))) == _expected_non_finite(label, kind)
    if method not in ("fp16", "affine"):
        assert np.isnan(got[0, 0, BAD]).all()  # NaN, not a mixture of NaN and inf
    others = np.ones(got.shape[:3], bool)
    others[0, 0, BAD] = False
    assert np.array_equal(got[others], want[others])  # bit for bit


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("labels_ready", CASES, indirect=True)
def test_attention_over_the_key_is_nan_for_its_head_only(labels_ready, kind):
    label = labels_ready
    bad, reference = _blocks(kind)
    q = _queries()
    values = _values_for(label, reference)
    out, lse = (np.array(a) for a in _attend(label, _encode(label, bad), values, q))
    ref_out, ref_lse = (np.array(a) for a in _attend(label, _encode(label, reference), values, q))
    # fp16 SDPA, the reference behaviour: NaN for the queries of KV head 0 wherever a NaN is involved
    sdpa = np.array(mx.fast.scaled_dot_product_attention(q, bad, reference, scale=D**-0.5))
    if CASES[label][0] == "fp16":
        assert np.array_equal(np.isnan(out), np.isnan(sdpa))  # ±inf alone: whatever its sign makes of the score
    else:
        # (kvq.attention reports a NaN row's lse as -inf, a row that sees no key: merged parts stay NaN)
        assert np.isnan(out[:, :2]).all() and not np.isfinite(lse[:, :2]).any()
        if "nan" in kind:
            assert np.isnan(sdpa[:, :2]).all()
    assert np.array_equal(out[:, 2:], ref_out[:, 2:]) and np.array_equal(lse[:, 2:], ref_lse[:, 2:])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("labels_ready", [c for c in CASES if CASES[c][0] != "qjl"], indirect=True)
def test_attention_over_the_value_is_non_finite_where_it_reaches(labels_ready, kind):
    label = labels_ready
    bad, reference = _blocks(kind)
    q = _queries()
    keys = _encode(label, reference)
    out = np.array(_attend(label, keys, _encode(label, bad, role="values"), q)[0])
    ref = np.array(_attend(label, keys, _encode(label, reference, role="values"), q)[0])
    expected = _expected_non_finite(label, kind)
    for head in (0, 1):  # both query heads of KV head 0
        assert set(np.flatnonzero(~np.isfinite(out[0, head, 0]))) == expected
    assert np.array_equal(out[:, 2:], ref[:, 2:])


def test_vecinfer_finite_vector_on_the_reserved_pattern_stays_finite(vecinfer_calibrated):
    """A finite vector whose nearest codes are all ``K - 1`` (the pattern that marks non-finite input) is stored
    with its first sub-vector's second-nearest centroid instead: it decodes finite, close to the vector."""
    from kvq_backends_vecinfer import storage, vq

    _, params = _params("vecinfer", "values")
    table = storage.layer_codebook(params)
    K, S = table.codebook.shape[1:]
    last = mx.tile(table.codebook[0, K - 1], (D // S,))  # every sub-vector on centroid K - 1, rotated domain
    x = vq.inverse_transform(mx.broadcast_to(last, (1, 2, 1, D)), None)  # values: y = H x
    impl = registry().implementations[("vecinfer", "mlx")]
    encoded = impl.kvq_quantize(x, params)
    codes = np.array(vq.unpack_codes(encoded.data["codes"], params.code_bits, D // S))
    assert (codes[..., 1:] == K - 1).all() and (codes[..., 0] != K - 1).all()
    decoded = impl.kvq_dequantize(encoded, mx.float32)
    assert mx.all(mx.isfinite(decoded)).item()
    assert not mx.any(vq.reserved(encoded.data["codes"], D // S, params.code_bits)).item()
