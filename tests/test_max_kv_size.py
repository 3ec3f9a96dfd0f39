"""max_kv_size is never silently ignored (issue #25): a model patched by kvq.patch_model, asked for a bounded cache
through mlx-lm (make_prompt_cache, generate), keeps mlx-lm's rotating cache and says so."""

from __future__ import annotations

import warnings

import mlx.core as mx
import sys

import mlx_lm.generate  # noqa: F401 (the module: mlx_lm.generate, the attribute, is the function)
import pytest
from mlx_lm.models import cache as mlx_cache

import kvq
from kvq.cache import KVQCache
from kvq.cache.patch import MaxKVSizeWarning


@pytest.fixture
def patched(llama_model):
    kvq.patch_model(llama_model, "affine", bits=4, window=16)
    yield llama_model
    kvq.unpatch_model(llama_model)


def test_a_bounded_request_keeps_mlx_lm_rotating_cache(patched):
    with pytest.warns(MaxKVSizeWarning, match="max_kv_size=64: kvq has no compressed sliding-window cache yet"):
        caches = mlx_cache.make_prompt_cache(patched, max_kv_size=64)
    assert all(isinstance(c, mlx_cache.RotatingKVCache) and c.max_size == 64 for c in caches)
    prompt = mx.array([(7 * i + 3) % 256 for i in range(600)])[None]
    for start in range(0, 600, 128):
        patched(prompt[:, start : start + 128], cache=caches)
    assert caches[0].keys.shape[2] <= 64 + 127 and caches[0].offset == 600  # mlx-lm's bound, not 600 tokens


def test_generate_with_max_kv_size_goes_through_the_same_function(patched):
    module = sys.modules["mlx_lm.generate"]
    assert module.make_prompt_cache is kvq.cache.patch.make_prompt_cache
    with pytest.warns(MaxKVSizeWarning):
        caches = module.make_prompt_cache(patched, max_kv_size=32)
    assert isinstance(caches[0], mlx_cache.RotatingKVCache)


def test_without_max_kv_size_kvq_caches_and_no_warning(patched):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        caches = mlx_cache.make_prompt_cache(patched)
    assert all(isinstance(c, KVQCache) for c in caches)


def test_unpatch_restores_mlx_lm_function():
    from kvq.cache import patch

    patch.patch()
    assert mlx_cache.make_prompt_cache is patch.make_prompt_cache
    patch.unpatch()
    assert mlx_cache.make_prompt_cache is patch._ORIGINAL_MAKE
    patch.patch()
