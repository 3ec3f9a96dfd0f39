"""affine's group size follows head_dim (#24 item 16): ``group_size=None`` (the default) is 64 where 64 divides
head_dim, as mlx-lm's QuantizedKVCache and affine's former fixed default (so those head_dims keep their results),
else 32; a clear error where no group size ``mx.quantize`` supports divides head_dim. Made concrete where head_dim
is known: ``kvq.select`` (the plan, its explanation) and a cache's first compressed block (its prompt-cache file)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from conftest import tiny_llama
from mlx_lm.models import cache as mlx_cache

import kvq
from kvq.baselines.affine import GROUP_SIZES, AffineParams, auto_group_size
from kvq.cache import make_config


@pytest.mark.parametrize("head_dim, expected", [(256, 64), (128, 64), (64, 64), (192, 64), (96, 32), (32, 32),
                                                (160, 32), (80, None), (48, None), (16, None), (8, None)])
def test_automatic_group_size_prefers_mlx_lms_64(head_dim, expected):
    assert auto_group_size(head_dim) == expected
    assert AffineParams().group_size_for(head_dim) == expected


def test_mx_quantize_supports_only_the_group_sizes_offered():
    """Why 16 and 8 are not offered for head_dims 16, 8, 48, 80: MLX 0.32 refuses them (revisit if it stops)."""
    for group_size in GROUP_SIZES:
        mx.eval(mx.quantize(mx.ones((1, 128)), group_size=group_size, bits=4))
    for group_size in (8, 16, 256):
        with pytest.raises(ValueError, match="group size"):
            mx.eval(mx.quantize(mx.ones((1, 256)), group_size=group_size, bits=4))


def test_where_64_divides_head_dim_nothing_changes():
    """The plan and the codes are those of the former default, group_size=64, bit for bit."""
    x = mx.random.normal((1, 2, 40, 128)).astype(mx.float16)
    auto, explicit = kvq.select("affine", x.shape), kvq.select("affine", x.shape, params=AffineParams(group_size=64))
    assert repr(auto.params) == repr(explicit.params) == "AffineParams(bits=4, group_size=64)"
    a, b = auto.quantize(x, auto.params), explicit.quantize(x, explicit.params)
    assert a.params == b.params and all(mx.array_equal(a.data[k], b.data[k]).item() for k in b.data)
    assert "group_size: 64 for head_dim 128 (given as None" in auto.explain()
    assert "means" not in explicit.explain()  # a group size given is used as given


@pytest.mark.parametrize("head_dim", [32, 96])
def test_head_dims_that_64_does_not_divide_get_32(head_dim):
    plan = kvq.select("affine", (1, 2, 64, head_dim))
    assert plan.params == AffineParams(bits=4, group_size=32)
    assert f"group_size: 32 for head_dim {head_dim} (given as None" in plan.explain()
    assert plan.to_dict()["notes"] == [f"group_size: 32 for head_dim {head_dim} (given as None: the method's "
                                         "default for the head_dim)"]
    x = mx.random.normal((1, 2, 20, head_dim)).astype(mx.float16)
    encoded = plan.quantize(x, AffineParams())  # also from parameters not yet made concrete
    assert encoded.params.group_size == 32
    expected = mx.dequantize(*mx.quantize(x, group_size=32, bits=4), group_size=32, bits=4)
    assert mx.array_equal(plan.dequantize(encoded, mx.float16), expected).item()
    assert AffineParams().accounting(head_dim).bits_per_coordinate == 4 + 32 / 32


@pytest.mark.parametrize("head_dim", [80, 48, 16, 8])
def test_no_supported_group_size_divides_head_dim(head_dim):
    message = rf"affine: head_dim {head_dim} is not supported: .* group sizes 32, 64, 128 only"
    for check in (lambda: kvq.select("affine", (1, 2, 64, head_dim)), lambda: AffineParams().accounting(head_dim),
                  lambda: make_config("affine").check_head_dim(head_dim)):
        with pytest.raises(ValueError, match=message):
            check()
    # a group size given that does not divide head_dim says so, as before
    with pytest.raises(ValueError, match=r"head_dim 96 .* \(group_size=64 must divide it\)"):
        kvq.select("affine", (1, 2, 64, 96), params=AffineParams(group_size=64))


def test_kernels_ask_the_same_group_size():
    """kvq_metal's affine kernels read the group size made concrete (and never raise from ``supports``)."""
    from kvq_metal.baselines.affine import AffineKernels

    impl = AffineKernels("cuda")
    problem = kvq.Problem("affine", "attend", (1, 2, 1024, 80), params=AffineParams())
    assert impl.kernel_supports(problem) is False and impl.cost(problem) > 0


@pytest.mark.parametrize("head_dim, group_size", [(32, 32), (64, 64)])
def test_a_cache_stores_the_group_size_it_used(head_dim, group_size, tmp_path):
    """mlx-lm's model tests use head_dims such as 32; the cache's configuration, and the prompt-cache file it
    writes, hold the concrete group size, and a file saved with group_size 64 (every file before the automatic
    choice) loads and matches the default parameters."""
    model = tiny_llama(hidden=4 * head_dim, heads=4, kv_heads=2, head_dim=head_dim)
    cache = kvq.make_prompt_cache(model, "affine", bits=4, sinks=2, window=8, flush=1)
    model(mx.arange(40)[None], cache=cache)
    assert cache[0].compressed_keys.length == 40 - 2 - 8
    assert cache[0].config.key_params == AffineParams(bits=4, group_size=group_size)
    assert json.loads(cache[0].state["config"])["key_params"] == {"bits": 4, "group_size": group_size}
    file = str(tmp_path / "cache.safetensors")
    mlx_cache.save_prompt_cache(file, cache)
    loaded = kvq.load_prompt_cache(file, **({"expect": make_config("affine", bits=4, sinks=2, window=8, flush=1)}
                                            if group_size == 64 else {}))
    assert loaded[0].config.key_params == AffineParams(bits=4, group_size=group_size)
    step = mx.array([[7]])
    assert mx.array_equal(model(step, cache=loaded), model(step, cache=cache)).item()


def test_unfitted_parameters_compare_prompt_cache_files():
    """``load_prompt_cache(expect=...)`` compares ``unfitted()`` parameters: 64 is what the default means wherever
    64 is valid; 32 and 128 stay what they are (see AffineParams.unfitted)."""
    assert AffineParams(group_size=64).unfitted() == AffineParams()
    assert AffineParams(group_size=32).unfitted() == AffineParams(group_size=32)
    assert AffineParams(group_size=128).unfitted() == AffineParams(group_size=128)
    assert AffineParams().fit(mx.zeros((1, 1, 4, 96))) == AffineParams(group_size=32)
