"""Online-softmax attention and log-sum-exp merging against a direct softmax."""

from __future__ import annotations

import mlx.core as mx
import pytest

import numpy as np

import kvq
from kvq.attention import dense_attend, merge_parts, sink_logits_part


def _reference(q, k, v, scale, mask=None, sink_logits=None):
    rep = q.shape[1] // k.shape[1]
    s = (q * scale) @ mx.repeat(k, rep, axis=1).swapaxes(-1, -2)
    if mask is not None:
        s = mx.where(mask, s, -mx.inf)
    if sink_logits is not None:
        s = mx.concatenate([mx.broadcast_to(sink_logits[None, :, None, None], s.shape[:3] + (1,)), s], axis=-1)
        p = mx.softmax(s, axis=-1)[..., 1:]
    else:
        p = mx.softmax(s, axis=-1)
    return p @ mx.repeat(v, rep, axis=1)


@pytest.mark.parametrize("block_size", [7, 64, 1000])
def test_blockwise_equals_softmax(block_size):
    q, k, v = mx.random.normal((2, 6, 3, 16)), mx.random.normal((2, 2, 100, 16)), mx.random.normal((2, 2, 100, 16))
    out, lse = dense_attend(q, k, v, 0.25, block_size=block_size)
    assert mx.allclose(out, _reference(q, k, v, 0.25), atol=1e-5).item()
    s = (q * 0.25) @ mx.repeat(k, 3, axis=1).swapaxes(-1, -2)
    assert mx.allclose(lse, mx.logsumexp(s, axis=-1), atol=1e-5).item()


def test_split_parts_merge_exactly_with_masks_and_sink_logits():
    q, k, v = mx.random.normal((1, 4, 5, 8)), mx.random.normal((1, 2, 40, 8)), mx.random.normal((1, 2, 40, 8))
    mask = mx.arange(35, 40)[:, None] >= mx.arange(40)[None]
    sink_logits = mx.random.normal((4,))
    parts = [dense_attend(q, k[:, :, a:b], v[:, :, a:b], 0.3, mask[:, a:b], block_size=4)
             for a, b in [(0, 3), (3, 30), (30, 40)]]
    out, _ = merge_parts(parts + [sink_logits_part(sink_logits, q, 8)])
    assert mx.allclose(out, _reference(q, k, v, 0.3, mask, sink_logits), atol=1e-5).item()


def test_fully_masked_rows_give_zero_not_nan():
    q, k, v = mx.random.normal((1, 1, 2, 8)), mx.random.normal((1, 1, 4, 8)), mx.random.normal((1, 1, 4, 8))
    mask = mx.array([[False] * 4, [True, False, False, False]])
    out, lse = dense_attend(q, k, v, 1.0, mask, block_size=2)
    assert mx.all(mx.isfinite(out)).item()
    assert mx.array_equal(out[0, 0, 0], mx.zeros(8)).item() and lse[0, 0, 0].item() == -float("inf")
    assert mx.allclose(out[0, 0, 1], v[0, 0, 0]).item()
    merged, _ = merge_parts([(out, lse), (out, lse)])
    assert mx.all(mx.isfinite(merged)).item()


def test_large_norm_keys_in_fp16_do_not_overflow():
    k = (mx.random.normal((1, 1, 64, 64)) * 90).astype(mx.float16)  # |k| ~ 700
    q = (mx.random.normal((1, 1, 1, 64)) * 90).astype(mx.float16)
    out, lse = dense_attend(q, k, k, 64**-0.5)
    assert mx.all(mx.isfinite(out)).item() and mx.isfinite(lse).all().item()


@pytest.mark.parametrize("method", ["affine", "turboquant"])
def test_causal_string_mask_equals_the_boolean_mask(method):
    """mlx-lm passes ``mask="causal"``; every attend accepts it (queries are the last T_q positions)."""
    rng = np.random.default_rng(3)
    k = mx.array(rng.standard_normal((1, 2, 40, 64)).astype(np.float32))
    q = mx.array(rng.standard_normal((1, 4, 5, 64)).astype(np.float32))
    p = kvq.make_params(method, bits=4)
    plan = kvq.select(method, (1, 2, 40, 64), params=p, dtype=mx.float32, num_queries=5, num_q_heads=4)
    ke = plan.quantize(k, p)
    boolean = mx.arange(35, 40)[:, None] >= mx.arange(40)[None]
    out, lse = plan.attend(q, ke, ke, 0.125, "causal")
    ref, ref_lse = plan.attend(q, ke, ke, 0.125, boolean)
    assert mx.allclose(out, ref, atol=1e-6).item() and mx.allclose(lse, ref_lse, atol=1e-6).item()
    with pytest.raises(ValueError, match="mask must be None, 'causal' or a boolean array; got 'full'"):
        plan.attend(q, ke, ke, 0.125, "full")


@pytest.mark.parametrize("key_method, value_method", [("fp16", "fp16"), ("affine", "affine"),
                                                       ("turboquant", "turboquant"), ("qjl", "affine")])
def test_queries_of_another_head_dim_are_named(key_method, value_method):
    """Every method's pure-MLX attend names queries whose head_dim is not the keys' (before: MLX's matrix-product
    shape error from inside the first block, for fp16, affine and qjl keys; a new user met it through kvq.select)."""
    keys = mx.random.normal((1, 2, 40, 128)).astype(mx.float16)
    plan = kvq.select(key_method, keys.shape, params=kvq.make_params(key_method), num_q_heads=4, op="attend")
    encoded_keys = kvq.select(key_method, keys.shape, params=kvq.make_params(key_method)).quantize(
        keys, plan.params)
    value_plan = kvq.select(value_method, keys.shape, params=kvq.make_params(value_method))
    encoded_values = value_plan.quantize(keys, value_plan.params)
    with pytest.raises(ValueError, match="queries: head_dim 64 does not match the keys' 128"):
        plan.attend(mx.random.normal((1, 4, 1, 64)), encoded_keys, encoded_values, 0.125, None)
