"""mlx-lm's server reuses a kvq cache only where that cannot change the answer (kvq.cache.reuse, issue #23:
identical requests give identical tokens whatever the server's prompt cache reuses).

A new user found the fault: ``kvq serve --method turboquant --bits 4 --window 16 --flush 16``, one chat request
sent four times at temperature 0: the first two answers ("The sky is blue because of Rayleigh scattering, ...")
were a fresh run's, the next two ("The sky appears blue because ...") came from the first request's cache trimmed
back to the prompt, whose answer had pushed the window past a flush (prompt tokens compressed that a fresh run
holds uncompressed).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import cache_state, same_state
from hypothesis import given, settings, strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import LRUPromptCache

from kvq.cache import KVQCache, RotatingKVQCache, make_config, make_prompt_cache
from kvq.cache.reuse import InexactTrim, exact_trims

D = 64


def _tokens(n: int, seed: int = 5):
    k = mx.random.normal((1, 2, n, D), key=mx.random.key(seed)).astype(mx.float16)
    v = mx.random.normal((1, 2, n, D), key=mx.random.key(seed + 1)).astype(mx.float16)
    return k, v


@settings(max_examples=80, deadline=None, derandomize=True)
@given(length=st.integers(1, 70), n=st.integers(0, 75), window=st.integers(0, 9), flush=st.integers(1, 6),
       chunk=st.integers(1, 70))
def test_trims_exactly_says_whether_a_trim_leaves_a_fresh_runs_state(length, n, window, flush, chunk):
    """``trims_exactly(n)`` is True exactly when ``trim(n)`` leaves the counts, window tokens and codes of a fresh
    cache fed the remaining tokens (affine: per-token codes, so equal tokens give equal codes)."""
    config = make_config("affine", bits=4, sinks=2, window=window, flush=flush)
    k, v = _tokens(length)
    cache = KVQCache(config)
    for s in range(0, length, chunk):
        cache.update_and_fetch(k[:, :, s:s + chunk], v[:, :, s:s + chunk])
    exact = cache.trims_exactly(n)
    removed = cache.trim(n)
    fresh = KVQCache(config)
    if length - removed:
        fresh.update_and_fetch(k[:, :, : length - removed], v[:, :, : length - removed])
    assert removed == min(n, length)
    same = same_state(cache_state(cache), cache_state(fresh))
    assert not exact or same, (length, n, window, flush, chunk)  # an exact trim leaves a fresh run's state
    # and every trim that leaves it is called exact, but one that removes every compressed token: what the first
    # compression fitted stays (test_a_trim_removing_every_compressed_token_is_not_exact)
    assert exact or not same or (cache.compressed_keys.length == 0 and removed > 0), (length, n, window, flush)


def test_a_trim_removing_every_compressed_token_is_not_exact():
    """A layer's first compression fits state from its tokens: centring (a constant key offset) and an outlier
    layer's 8 bits (one channel 40 times the others, kvq.cache.guard). A trim that removes every compressed token
    keeps that state, so it is not what a fresh run of other tokens would hold (a reviewer's case: the server
    serving a new conversation that shares only its first tokens); fed the same tokens again, the trimmed cache
    attends exactly as a fresh one (the fit is kept, not redone on the upgraded configuration)."""
    k = mx.random.normal((1, 2, 80, D), key=mx.random.key(1)) + 5.0
    k[..., 3] = k[..., 3] * 40
    k, v = k.astype(mx.float16), mx.random.normal((1, 2, 80, D), key=mx.random.key(2)).astype(mx.float16)
    config = make_config("affine", bits=4, sinks=4, window=16, flush=16)
    with pytest.warns(UserWarning):  # the guard names the outlier layer
        cache = KVQCache(config)
        cache.update_and_fetch(k[:, :, :60], v[:, :, :60])
        assert cache.key_mean is not None and cache.config.outlier_layer and cache.compressed_keys.length
        assert not cache.trims_exactly(57) and cache.trims_exactly(4)
        cache.trim(57)
        cache.update_and_fetch(k[:, :, 3:60], v[:, :, 3:60])
        fresh = KVQCache(config)
        fresh.update_and_fetch(k[:, :, :60], v[:, :, :60])
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(3)).astype(mx.float16)
    assert cache.key_mean is not None and cache.config == fresh.config
    assert mx.array_equal(cache.attend(q, D ** -0.5), fresh.attend(q, D ** -0.5)).item()


def test_inside_exact_trims_an_inexact_trim_raises_and_changes_nothing():
    cache = KVQCache(make_config("affine", bits=4, sinks=2, window=4, flush=4))
    k, v = _tokens(20)
    cache.update_and_fetch(k, v)  # 18 after the sinks: 12 compressed, a window of 6
    before = cache_state(cache)
    assert cache.trims_exactly(2) and not cache.trims_exactly(3)  # 16 after the sinks: a fresh run holds 4 + 4
    with exact_trims():
        with pytest.raises(InexactTrim, match="trimming 3 of 20 tokens"):
            cache.trim(3)
        assert same_state(cache_state(cache), before)
        assert cache.trim(2) == 2
    assert cache.trim(3) == 3  # outside: trims as before (speculative decoding, direct calls)


def test_rotating_cache_refuses_the_same_inexact_trims():
    cache = RotatingKVQCache(make_config("affine", bits=4, window=4, flush=4), max_size=64, keep=2)
    k, v = _tokens(20)
    cache.update_and_fetch(k, v)
    assert cache.trims_exactly(2) and not cache.trims_exactly(3)
    with exact_trims(), pytest.raises(InexactTrim):
        cache.trim(3)


def _greedy(model, cache, prompt: list[int], n: int) -> list[int]:
    step = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache,
                         sampler=lambda x: mx.argmax(x, -1))
    return [int(t) for t, _ in step]


def _filled(model, tokens: list[int], options: dict) -> list:
    cache = make_prompt_cache(model, "affine", bits=4, **options)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("segment", [False, True], ids=["no-segment-entry", "segment-entry"])
@pytest.mark.parametrize("answer", [3, 12])
def test_the_servers_prompt_cache_gives_a_repeated_request_the_fresh_answer(llama_model, answer, segment):
    """mlx-lm's LRUPromptCache holding a finished request (prompt + answer), and with ``segment`` the cache of the
    prompt's first 20 tokens (the server stores one at each chat segment's end), asked for the same prompt again: a
    trim that is exact (3 answer tokens, no flush since the prompt) is reused; one that is not (12, past a flush)
    is not: the request gets the segment's entry, kept beside the longer one (mlx-lm drops the prefixes of a
    trimmable cache's entry), or no cache (the server recomputes). Either way the repeated request's greedy tokens
    are the fresh run's; before, the inexact trim was reused, its state not the fresh run's."""
    # 28 tokens after the sinks: 16 compressed, a window of 12 (8 .. 15, flush 8); mlx-lm trims to the prompt's
    # first 29 (16 and 11); 3 answer tokens leave 16 compressed, 12 compress 8 more
    prompt = [(11 * i + 5) % 200 + 1 for i in range(30)]
    options = dict(sinks=2, window=8, flush=8)
    fresh = _greedy(llama_model, make_prompt_cache(llama_model, "affine", bits=4, **options), prompt, 6)
    first = make_prompt_cache(llama_model, "affine", bits=4, **options)
    tokens = prompt + _greedy(llama_model, first, prompt, answer)
    stored = tokens[: first[0].offset]  # what the cache holds (the last answer token is never fed back)
    lru = LRUPromptCache(max_size=4)
    if segment:
        lru.insert_cache("model", prompt[:20], _filled(llama_model, prompt[:20], options), cache_type="user")
    lru.insert_cache("model", stored, first)
    cache, rest = lru.fetch_nearest_cache("model", prompt)
    exact = first[0].trims_exactly(len(stored) - (len(prompt) - 1))
    assert exact == (answer == 3)
    if exact:
        assert cache is not None and rest == prompt[-1:] and cache[0].offset == len(prompt) - 1
    elif segment:
        assert cache is not None and rest == prompt[20:] and cache[0].offset == 20
    else:
        assert cache is None and rest == prompt
        cache = make_prompt_cache(llama_model, "affine", bits=4, **options)
    assert first[0].offset == len(stored)  # the stored entry itself is never trimmed
    assert _greedy(llama_model, cache, rest, 6) == fresh
