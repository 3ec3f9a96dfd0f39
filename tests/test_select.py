"""kvq.select: picks by supports/cost, explains, caches per shape bucket, rejects bad input by name."""

from __future__ import annotations

import mlx.core as mx
import pytest

import kvq
from kvq.baselines.affine import AffineMLX
from kvq.selection import shape_bucket


class FastForLongContext(AffineMLX):
    """A fake kernel: supports head_dim 128 only; cheaper than pure MLX above 16384 tokens."""

    backend = "fake-kernel"

    def supports(self, problem):
        return problem.head_dim == 128

    def cost(self, problem):
        return 0.0 if problem.shape[2] > 16384 else 1.0

    def explain(self, problem):
        return "head_dim 128 only" if problem.head_dim != 128 else "fake crossover at 16384"


def test_select_picks_by_supports_and_cost(registered):
    registered(FastForLongContext())
    long = kvq.select("affine", (1, 8, 65536, 128), op="attend")
    short = kvq.select("affine", (1, 8, 1024, 128), op="attend")
    other_dim = kvq.select("affine", (1, 8, 65536, 64), op="attend")
    assert long.choices["attend"].backend == "fake-kernel"
    assert short.choices["attend"].backend == "mlx"
    assert other_dim.choices["attend"].backend == "mlx"
    assert "lowest cost of 1 supporting" in other_dim.choices["attend"].reason
    assert "fake-kernel: head_dim 128 only" in other_dim.choices["attend"].reason
    assert "fake-kernel" in short.explain() and "mlx:" in short.explain()


def test_plan_holds_the_bound_callables():
    plan = kvq.select("affine", (1, 2, 64, 64))
    impl = plan.choices["quantize"].implementation
    assert plan.quantize.__self__ is impl and plan.quantize.__func__ is type(impl).kvq_quantize
    assert plan.unpack.__name__ == "kvq_unpack"


def test_plans_are_cached_per_shape_bucket_and_invalidated_by_registration(registered):
    a = kvq.select("affine", (1, 8, 1000, 128))
    assert kvq.select("affine", (1, 8, 1024, 128)) is a
    assert kvq.select("affine", (1, 8, 1025, 128)) is not a
    assert shape_bucket((1, 8, 1025, 128)) == (1, 8, 2048, 128)
    registered(FastForLongContext())
    assert kvq.select("affine", (1, 8, 1000, 128)) is not a


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(method="nope", shape=(1, 1, 8, 64)), ValueError, r"method must be one of ([a-z0-9_]+, )*affine, .*fp16.*got 'nope'"),
    (dict(method="affine", shape=(1, 8, 64)), ValueError, r"shape must be four"),
    (dict(method="affine", shape=(1, 8, 64, 80)), ValueError, r"head_dim 80 .* multiple of 32 .* group sizes 32, 64, "
                                                              r"128 only"),
    (dict(method="affine", shape=(1, 8, 64, 96), params=kvq.make_params("affine", group_size=64)), ValueError,
     r"head_dim 96 .* multiple of 64 \(group_size=64 must divide it\)"),
    (dict(method="affine", shape=(1, 8, 64, 64), op="compress"), ValueError, r"op must be one of quantize"),
    (dict(method="affine", shape=(1, 8, 64, 64), dtype=mx.int32), TypeError, r"dtype must be mx.float16"),
    (dict(method="affine", shape=(1, 8, 64, 64), device="tpu"), ValueError, r"device must be one of"),
])
def test_bad_input_names_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        kvq.select(**kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(bits=7), ValueError, r"bits must be one of 2, 3, 4, 5, 6, 8; got 7"),
    (dict(group_size=48), ValueError, r"group_size must be one of 32, 64, 128; got 48"),
    (dict(bitz=4), TypeError, r"unknown parameter\(s\) bitz for method 'affine'; allowed: bits, group_size"),
])
def test_bad_params_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        kvq.make_params("affine", **kwargs)


def test_params_of_another_method_are_rejected():
    with pytest.raises(TypeError, match="params must be an AffineParams"):
        kvq.select("affine", (1, 1, 8, 64), params=kvq.make_params("fp16"))


def test_repeated_questions_are_answered_from_the_cache_and_bad_ones_still_fail():
    """The decode hot path asks select the same question every step; the answer comes from a cache keyed by the
    exact arguments, which only holds arguments that passed validation."""
    a = kvq.select("affine", (1, 8, 1000, 128), op="attend", num_q_heads=32)
    assert kvq.select("affine", (1, 8, 1000, 128), op="attend", num_q_heads=32) is a
    assert kvq.select("affine", (1, 8, 1000, 128), op="attend", num_q_heads=32, device="cpu") is a
    with pytest.raises(ValueError, match="head_dim 80"):
        kvq.select("affine", (1, 8, 1000, 80), op="attend", num_q_heads=32)
    with pytest.raises(ValueError, match="kernels must be one of"):
        kvq.select("affine", (1, 8, 1000, 128), op="attend", num_q_heads=32, kernels="always")
    with pytest.raises(TypeError, match=r"an mlx.core.Dtype\); got the string 'float16'"):
        kvq.select("affine", (1, 8, 1000, 128), dtype="float16")
    for bad in (7, 0, 12):  # grouped-query attention: a multiple of H_kv (8); a new user passed 7 unchallenged
        with pytest.raises(ValueError, match=rf"num_q_heads must be a positive multiple of the shape's H_kv \(8"):
            kvq.select("affine", (1, 8, 1000, 128), op="attend", num_q_heads=bad)
