"""mlx-lm's ``kv_bits`` on kvq caches (issue #24, item 15): never silently ignored. mlx-lm asks every cache that has
``to_quantized`` to quantize itself once it holds ``quantized_kv_start`` tokens; a kvq cache that already holds what
``kv_bits`` asks for (kvq's ``affine`` with those bits and group size) goes on as it is, any other refuses."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache

from kvq.cache import BatchKVQCache, KVQCache, make_config, make_prompt_cache, patch_model, unpatch_model

PROMPT = mx.array([(7 * i + 3) % 256 for i in range(200)])


def greedy(model, cache=None, n=6, **kwargs):
    gen = generate_step(PROMPT, model, max_tokens=n, prompt_cache=cache, sampler=lambda x: mx.argmax(x, -1),
                        prefill_step_size=64, **kwargs)
    return [int(t) for t, _ in gen]


@pytest.fixture
def patched(llama_model):
    """``patched(method, **params)``: the tiny llama with kvq.patch_model (undone afterwards)."""
    def patch(method, **params):
        return patch_model(llama_model, method, **params)

    yield patch
    unpatch_model(llama_model)


@pytest.mark.parametrize("method, params, kv", [
    ("affine", {"bits": 4}, {"kv_bits": 8}),
    ("affine", {"bits": 8}, {"kv_bits": 8, "kv_group_size": 32}),
    ("turboquant", {"bits": 4}, {"kv_bits": 4}),
    ("fp16", {}, {"kv_bits": 8}),
])
def test_kv_bits_that_asks_for_another_compression_is_refused(patched, method, params, kv):
    model = patched(method, **params)
    bits, group_size = kv["kv_bits"], kv.get("kv_group_size", 64)
    with pytest.raises(ValueError, match=rf"kv_bits={bits} \(kv_group_size={group_size}\) asks mlx-lm to quantize "
                                         rf"a kvq cache .* kvq.patch_model\(model, 'affine', bits={bits}, "
                                         rf"group_size={group_size}\)"):
        greedy(model, quantized_kv_start=0, **kv)


def test_the_error_comes_when_mlx_lm_asks(patched):
    """mlx-lm asks once a cache holds quantized_kv_start tokens (its default: 5000); before that kv_bits changes
    no cache, kvq's or mlx-lm's."""
    model = patched("affine", bits=4)
    with pytest.raises(ValueError, match="kv_bits=8"):
        greedy(model, kv_bits=8, quantized_kv_start=150)
    assert greedy(model, kv_bits=8) == greedy(model)  # 206 tokens < 5000


@pytest.mark.parametrize("group_size", [{}, {"group_size": 64}, {"group_size": 32}])
def test_kv_bits_that_the_cache_already_holds_goes_on_with_the_same_caches(llama_model, group_size):
    """Also with affine's default group size: 64 at this head_dim, mlx-lm's default kv_group_size."""
    cache = make_prompt_cache(llama_model, "affine", bits=8, window=16, **group_size)
    same = list(cache)
    tokens = greedy(llama_model, cache, kv_bits=8, kv_group_size=group_size.get("group_size", 64),
                    quantized_kv_start=0)
    assert all(a is b for a, b in zip(cache, same))  # mlx-lm kept the kvq caches
    assert tokens == greedy(llama_model, make_prompt_cache(llama_model, "affine", bits=8, window=16, **group_size))


def test_batch_caches_answer_for_every_row():
    rows = [KVQCache(make_config("affine", bits=8, group_size=64)), KVQCache(make_config("affine", bits=4))]
    assert BatchKVQCache(rows[:1]).to_quantized(64, 8) is not None
    with pytest.raises(ValueError, match="kv_bits=8"):
        BatchKVQCache(rows).to_quantized(64, 8)


def test_mlx_lms_own_caches_are_unchanged(llama_model):
    """A model that kvq did not patch quantizes as mlx-lm does."""
    cache = mlx_cache.make_prompt_cache(llama_model)
    try:
        greedy(llama_model, cache, n=2, kv_bits=8, quantized_kv_start=0)
    except Exception:  # noqa: BLE001 - mlx-lm's quantized attention is missing on some MLX back ends
        pass
    assert all(type(c) is mlx_cache.QuantizedKVCache for c in cache)
