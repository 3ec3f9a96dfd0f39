"""The key channels RoPE keeps still (kvq.cache.still) and the centring that uses only them (kvq.cache.guard):
a first block's mean holds for every token a layer can hold only in channels that turn little (issue #53)."""

from __future__ import annotations

import math

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import tiny_llama

import kvq
from kvq.cache import make_config
from kvq.cache.guard import STILL_CENTER_LIMIT, guard_layer, offset_energy
from kvq.cache.still import MAX_ANGLE, still_channels


def expected(dims: int, head_dim: int, base: float, horizon: int, traditional: bool) -> tuple[int, ...]:
    """Channels whose pair turns at most MAX_ANGLE by position ``horizon``: theta_i = base^(-2i/dims); pairs
    (2i, 2i+1) for traditional RoPE, (i, i + dims/2) otherwise; channels past ``dims`` are not turned."""
    half = dims // 2
    slow = [i for i in range(half) if base ** (-2 * i / dims) * horizon <= MAX_ANGLE]
    pairs = [(2 * i, 2 * i + 1) if traditional else (i, i + half) for i in slow]
    return tuple(sorted([c for p in pairs for c in p] + list(range(dims, head_dim))))


@pytest.mark.parametrize("dims, head_dim, base, horizon, traditional", [
    (64, 64, 10000.0, 8192, False), (64, 64, 1e6, 32768, True), (256, 256, 1e6, 32768, False),
    (256, 256, 10000.0, 512, False), (32, 64, 10000.0, 4096, False),
])
def test_still_channels_are_the_slow_pairs(dims, head_dim, base, horizon, traditional):
    got = still_channels(nn.RoPE(dims, traditional=traditional, base=base), head_dim, horizon)
    assert got == expected(dims, head_dim, base, horizon, traditional)


def test_a_fast_pair_that_lands_near_a_whole_turn_is_not_still():
    """theta = 2 pi / 1000: at position 1000 the pair is back where it started, yet it turns all the way between."""
    class OnePair:
        def __call__(self, x, offset=0):
            angle = 2 * math.pi / 1000 * offset
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[..., :1], x[..., 1:2]
            return mx.concatenate([a * c - b * s, a * s + b * c, x[..., 2:]], axis=-1)

    assert still_channels(OnePair(), 4, 1000) == (2, 3)


def test_no_rope_or_an_unknown_one_says_unknown():
    assert still_channels(None, 64, 1024) is None
    assert still_channels(lambda x: x, 64, 1024) is None  # takes no offset


def _rotated(offsets: np.ndarray, positions: np.ndarray, rope, noise: float, seed: int = 0) -> mx.array:
    """Keys ``[1, 1, T, D]``: a constant ``offsets`` vector plus Gaussian noise, through ``rope`` at ``positions``."""
    rng = np.random.default_rng(seed)
    raw = offsets[None] + noise * rng.standard_normal((len(positions), offsets.size))
    rows = [rope(mx.array(raw[i])[None, None, None], offset=int(p)) for i, p in enumerate(positions)]
    return mx.concatenate(rows, axis=2).astype(mx.float32)


def test_centring_uses_only_still_channels_and_holds_far_away():
    """Offsets in a fast, a middle and a slow pair: near the block the whole block mean removes the middle and slow
    ones (the fast one averages out), but 1,500 tokens on the middle pair has turned about 2.7 rad and its mean adds
    energy. With the still channels known the layer subtracts only the slow pair's mean, which still removes its
    offset there."""
    D, horizon = 64, 2048
    rope = nn.RoPE(D, base=10000.0)
    still = still_channels(rope, D, horizon)
    offsets = np.zeros(D)
    offsets[4] = 6.0  # pair (4, 36): theta 0.56 rad / token
    offsets[22] = 6.0  # pair (22, 54): theta 1.8e-3, half a radian over the block
    offsets[31] = 6.0  # pair (31, 63): theta 1.3e-4, 0.27 rad over the horizon
    assert 31 in still and 63 in still and 22 not in still
    block = _rotated(offsets, np.arange(256), rope, noise=1.0)
    config = attrs.evolve(make_config("turboquant", bits=3), still_channels=still)
    _, mean, _ = guard_layer(config, block)
    assert mean is not None and offset_energy(block, still) >= STILL_CENTER_LIMIT
    outside = [c for c in range(D) if c not in still]
    assert np.all(np.array(mean)[..., outside] == 0)
    far = _rotated(offsets, np.arange(1500, 1756), rope, noise=1.0, seed=1)
    energy = lambda x: float(mx.sum(x * x))  # noqa: E731
    whole = mx.mean(block, axis=2, keepdims=True)
    assert energy(far - mean) < 0.9 * energy(far)  # the still mean still removes the slow offset
    assert energy(far - whole) > energy(far - mean)  # the whole mean, turned away, leaves more


def test_without_still_channels_the_whole_mean_rule_stands():
    """A config without still channels (a cache made without a model) keeps the guard's whole-mean rule."""
    D = 64
    block = _rotated(np.r_[np.zeros(D - 1), 6.0], np.arange(256), nn.RoPE(D, base=10000.0), noise=1.0)
    share = offset_energy(block)
    assert 0.2 < share < 0.8
    assert guard_layer(make_config("turboquant", bits=3), block)[1] is None
    still = tuple(range(D))
    assert guard_layer(attrs.evolve(make_config("turboquant", bits=3), still_channels=still), block)[1] is not None


def test_make_prompt_cache_asks_each_layers_rope():
    model = tiny_llama(hidden=256, heads=4, kv_heads=2, dtype=mx.float32)
    cache = kvq.make_prompt_cache(model, "turboquant", bits=4)
    assert model.args.max_position_embeddings is None  # the horizon is then kvq.cache.still.DEFAULT_HORIZON
    want = still_channels(model.layers[0].self_attn.rope, 64, 131072)
    assert want == ()  # base 10000 over 131072 tokens: the slowest pair turns 17 rad; nothing may be centred
    assert [c.config.still_channels for c in cache] == [want] * len(cache)
    rotating = kvq.make_prompt_cache(model, "turboquant", bits=4, max_kv_size=512)
    assert rotating[0].config.still_channels == still_channels(model.layers[0].self_attn.rope, 64, 512)
    assert rotating[0].config.still_channels == expected(64, 64, 10000.0, 512, False)  # the 7 slowest pairs


def test_a_models_rope_is_probed_once_while_it_lives():
    """A server makes caches for every request: the probe runs once per model and horizons, and is forgotten with
    the model."""
    import gc

    from kvq.cache import still

    model = tiny_llama(hidden=128, layers=2, heads=2, kv_heads=1, dtype=mx.float32)
    calls = []
    rope = model.layers[0].self_attn.rope

    class Counting(nn.Module):
        def __call__(self, x, offset=0):
            calls.append(offset)
            return rope(x, offset=offset)

    for layer in model.layers:
        layer.self_attn.rope = Counting()
    first = still.layer_still_channels(model, [512, 512])
    probes = len(calls)
    assert probes > 0 and still.layer_still_channels(model, [512, 512]) == first and len(calls) == probes
    still.layer_still_channels(model, [1024, 1024])
    assert len(calls) > probes  # other horizons: probed again
    key = id(model)
    del model, first
    gc.collect()
    assert not [k for k in still._FOUND if k[0] == key]
