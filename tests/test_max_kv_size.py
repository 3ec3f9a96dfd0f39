"""max_kv_size is never silently ignored (issue #25): a model patched by kvq.patch_model, asked for a bounded cache
through mlx-lm (make_prompt_cache, generate), gets kvq's compressed rotating caches, bounded as mlx-lm's
RotatingKVCache(max_kv_size, keep=4) is."""

from __future__ import annotations

import sys
import warnings

import mlx.core as mx
import mlx_lm.generate  # noqa: F401 (the module: mlx_lm.generate, the attribute, is the function)
import pytest
from mlx_lm.models import cache as mlx_cache

import kvq
from kvq.cache import KVQCache, RotatingKVQCache


@pytest.fixture
def patched(llama_model):
    kvq.patch_model(llama_model, "affine", bits=4, window=16)
    yield llama_model
    kvq.unpatch_model(llama_model)


def test_a_bounded_request_gets_compressed_rotating_caches(patched):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about max_kv_size
        caches = mlx_cache.make_prompt_cache(patched, max_kv_size=64)
    assert all(type(c) is RotatingKVQCache and (c.max_size, c.keep) == (64, 4) for c in caches)
    assert caches[0].config.key_params == kvq.cache.make_config("affine", bits=4).key_params
    prompt = mx.array([(7 * i + 3) % 256 for i in range(600)])[None]
    for start in range(0, 600, 128):
        patched(prompt[:, start : start + 128], cache=caches)
    nbytes = caches[0].nbytes
    for token in range(20):
        patched(mx.array([[token]]), cache=caches)
    layer = caches[0]
    assert layer.offset == 620 and layer.size() == 64  # mlx-lm's bound, not 620 tokens
    # the window holds 16 to 16 + flush - 1 tokens (flush 128 by default), the full ring max_size - keep - 16
    assert layer.sinks.length == 4 and 16 <= layer.window.length < 16 + layer.config.flush_tokens
    assert layer.compressed_keys.length == 64 - 4 - 16
    assert layer.nbytes == nbytes  # decoding on holds no more


def test_generate_with_max_kv_size_goes_through_the_same_function(patched):
    module = sys.modules["mlx_lm.generate"]
    assert module.make_prompt_cache is kvq.cache.patch.make_prompt_cache
    caches = module.make_prompt_cache(patched, max_kv_size=32)
    assert all(type(c) is RotatingKVQCache and c.max_size == 32 for c in caches)


def test_without_max_kv_size_kvq_caches_and_no_warning(patched):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        caches = mlx_cache.make_prompt_cache(patched)
    assert all(type(c) is KVQCache for c in caches)


def test_an_unpatched_model_keeps_mlx_lm_behaviour(llama_model):
    """(mlx-lm's llama has a make_cache, so mlx-lm itself ignores max_kv_size for it.)"""
    from kvq.cache import patch

    caches = mlx_cache.make_prompt_cache(llama_model, max_kv_size=32)
    assert [type(c) for c in caches] == [type(c) for c in patch._ORIGINAL_MAKE(llama_model, max_kv_size=32)]
    assert not any(isinstance(c, KVQCache) for c in caches)


def test_unpatch_restores_mlx_lm_function():
    from kvq.cache import patch

    patch.patch()
    assert mlx_cache.make_prompt_cache is patch.make_prompt_cache
    patch.unpatch()
    assert mlx_cache.make_prompt_cache is patch._ORIGINAL_MAKE
    patch.patch()


def test_a_make_prompt_cache_bound_before_the_patch_is_honoured_too(llama_model):
    """``from mlx_lm.models.cache import make_prompt_cache`` before ``kvq.patch_model``: that copy is mlx-lm's own,
    which calls ``model.make_cache()`` without ``max_kv_size``; the patched ``make_cache`` reads it from that call
    (before: kvq's unbounded caches, 604 tokens held after a 600-token prompt with ``max_kv_size=64``)."""
    bound_before = kvq.cache.patch._ORIGINAL_MAKE  # mlx-lm's function, as a script bound it before any patch
    kvq.patch_model(llama_model, "affine", bits=4, window=16)
    try:
        assert bound_before is not mlx_cache.make_prompt_cache  # the module's name was replaced, this copy not
        caches = bound_before(llama_model, max_kv_size=64)
        assert all(type(c) is RotatingKVQCache and (c.max_size, c.keep) == (64, 4) for c in caches)
        assert all(type(c) is KVQCache for c in bound_before(llama_model))  # no bound asked: unbounded
        assert all(type(c) is KVQCache for c in llama_model.make_cache())  # a direct call is not mlx-lm's
    finally:
        kvq.unpatch_model(llama_model)
