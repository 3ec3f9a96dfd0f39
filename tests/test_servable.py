"""kvq never hands a model an object it cannot use (issue #25): a model whose attention handles keys and values
itself (mlx-lm's stablelm casts them) keeps mlx-lm's caches, with a warning naming the error; the probe builds a
forward pass lazily, once per model class and cache settings, and blames kvq only when mlx-lm's caches pass it."""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import stablelm

import kvq
from kvq.cache import KVQCache, UnservableModelWarning, servable


def tiny_stablelm():
    args = stablelm.ModelArgs(model_type="stablelm", vocab_size=64, hidden_size=64, num_attention_heads=2,
                              num_hidden_layers=2, num_key_value_heads=2, intermediate_size=64, rope_theta=10000.0,
                              use_qkv_bias=False, partial_rotary_factor=0.25, layer_norm_eps=1e-5)
    return stablelm.Model(args)


def test_a_model_that_casts_its_keys_keeps_mlx_lm_caches():
    model = tiny_stablelm()
    with pytest.warns(UnservableModelWarning, match=r"stablelm: .* AttributeError: 'CompressedView' object has no "
                                                   r"attribute 'astype'\); its layers keep mlx-lm's caches"):
        caches = kvq.make_prompt_cache(model, "turboquant", bits=4)
    assert all(type(c) is mlx_cache.KVCache for c in caches)
    out = model(mx.array([[1, 2, 3]]), cache=caches)  # and the model runs with them
    assert out.shape == (1, 3, 64) and mx.all(mx.isfinite(out)).item()


def test_llama_is_served_and_probed_once(llama_model, monkeypatch):
    calls = []
    real = servable._builds
    monkeypatch.setattr(servable, "_builds", lambda model, caches: calls.append(1) or real(model, caches))
    for key in [key for key in servable._VERDICTS if key[0] is type(llama_model)]:
        del servable._VERDICTS[key]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnservableModelWarning)
        for _ in range(3):
            assert all(isinstance(c, KVQCache) for c in kvq.make_prompt_cache(llama_model, "affine", bits=4))
    assert len(calls) == 1  # one probe with kvq's caches, which built; the verdict is kept for class and settings


def test_a_setting_that_fails_the_probe_leaves_the_model_served_for_others():
    """A new user's float bits (``key_params={"bits": 4.0}``) reached MLX's quantize inside the probe, and the
    verdict, kept per model class, then gave every later cache of that model mlx-lm's caches. Verdicts are kept per
    settings now, and whole-valued float parameters are ints."""

    class Model:
        def __call__(self, tokens, cache=None):
            if cache == ["bad"]:
                raise TypeError("quantize(): incompatible function arguments")

    model = Model()
    bad = servable.unservable_reason(model, lambda: ["bad"], lambda: ["mlx"], settings="bad")
    assert bad == "TypeError: quantize(): incompatible function arguments"
    assert servable.unservable_reason(model, lambda: ["good"], lambda: ["mlx"], settings="good") is None
    assert servable.unservable_reason(model, lambda: ["bad"], lambda: ["mlx"], settings=["unhashable"]) == bad


def test_whole_float_bits_make_kvq_caches(llama_model):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnservableModelWarning)
        caches = kvq.make_prompt_cache(llama_model, key_method="affine", value_method="affine",
                                       key_params={"bits": 4.0}, window=0, sinks=0, flush=1)
    assert all(isinstance(c, KVQCache) for c in caches)
    assert caches[0].config.key_params.bits == 4 and type(caches[0].config.key_params.bits) is int
    assert kvq.make_params("turboquant", bits=4.0, outlier_channels=0.0) == kvq.make_params("turboquant", bits=4)


def test_a_probe_that_fails_with_mlx_lm_caches_too_blames_nothing():
    class NeedsImages(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(2, 2)]

        def __call__(self, tokens, cache=None):
            raise ValueError("this model needs pixel_values")

    with warnings.catch_warnings():
        warnings.simplefilter("error", UnservableModelWarning)
        caches = kvq.make_prompt_cache(NeedsImages(), "affine", bits=4)
    assert isinstance(caches[0], KVQCache)
