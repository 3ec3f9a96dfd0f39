"""The compressed stores grow ahead of the flush that needs the room, on a decode step of each layer's own (#52).

On CUDA, MLX keeps a kernel's inputs alive until the command buffer that ran it completes, so when every layer's
store grew in the same step (the flush step), the replaced arrays of several layers were alive at once. These tests
pin the schedule (one layer per step, never a flush step) and that it changes no stored token and no output.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvq.cache import KVQCache, make_config
from kvq.cache.ring import RingStore
from kvq.cache import store as store_module
from kvq.cache.store import EncodedStore, spare
from kvq.encoded import Encoded

B, H, D = 1, 2, 64


class _Params:
    method = "test"


PARAMS = _Params()


def _encoded(start: int, n: int) -> Encoded:
    codes = (mx.arange(start, start + n, dtype=mx.uint32)[None, None, :, None] * mx.ones((B, H, 1, 3), mx.uint32))
    return Encoded(PARAMS, {"codes": codes, "norms": codes[..., :1].astype(mx.float32)}, D)


def test_reserve_grows_in_whole_steps_and_keeps_the_tokens():
    store = EncodedStore(step=4)
    store.reserve(100)  # empty: nothing to grow yet
    assert store.data is None
    store.append(_encoded(0, 3))
    assert store.capacity == 4
    store.reserve(10)  # the 3 held tokens and two steps
    assert store.capacity == 11 and store.length == 3
    assert store.data["codes"].shape == (B, H, 11, 3) and store.data["norms"].dtype == mx.float32
    np.testing.assert_array_equal(np.array(store.view().data["codes"][0, 0, :, 0]), [0, 1, 2])
    store.reserve(11)  # room already
    assert store.capacity == 11
    store.append(_encoded(3, 8))  # fills the reserved room without growing
    assert store.capacity == 11
    np.testing.assert_array_equal(np.array(store.view().data["codes"][0, 1, :, 2]), np.arange(11))


def test_a_block_after_a_trim_gets_room_counted_from_the_held_tokens():
    # counted from the old capacity, 100 held + one step (356) was too small for 300 more tokens: the write failed
    store = EncodedStore(step=256)
    store.append(_encoded(0, 256))
    assert store.trim(156) == 156 and store.capacity == 256
    store.append(_encoded(100, 300))
    assert store.length == 400 and store.capacity == 100 + 2 * 256
    np.testing.assert_array_equal(np.array(store.view().data["codes"][0, 0, :, 0]), np.arange(400))


def test_ring_reserve_stops_at_the_limit():
    ring = RingStore(step=4, limit=10)
    ring.append(_encoded(0, 3))
    ring.reserve(100)
    assert ring.capacity == 10
    ring.append(_encoded(3, 9))  # wraps: the newest 10 held
    assert ring.wrapped and ring.capacity == 10
    ring.reserve(100)
    assert ring.capacity == 10
    np.testing.assert_array_equal(np.sort(np.array(ring.view().data["codes"][0, 0, :, 0])), np.arange(2, 12))


def _decode(layers: int, steps: int, grow_ahead: bool, monkeypatch) -> tuple[list, list, list, list]:
    """Fill ``layers`` caches (affine:4, window 8, flush 8, store step 16) and decode ``steps`` tokens: per step,
    which layers grew and which flushed, the outputs of every layer's attention, and the caches."""
    if not grow_ahead:
        monkeypatch.setattr(KVQCache, "_schedule_growth", lambda self: None)
    config = make_config("affine", bits=4, sinks=4, window=8, flush=8, step=16, kernels="off")
    caches = [KVQCache(config) for _ in range(layers)]
    for i, cache in enumerate(caches):  # the layers' slots as make_prompt_cache gives them, whatever ran before
        cache._slot = i
    rng = np.random.default_rng(0)
    token = lambda n: mx.array(rng.standard_normal((B, H, n, D)), mx.float16)  # noqa: E731
    for cache in caches:
        cache.update_and_fetch(token(40), token(40))
    grew, flushed, outputs = [], [], []
    for _ in range(steps):
        before = [(c.compressed_keys.capacity, c.compressed_values.capacity, c.compressed_keys.length) for c in caches]
        query = token(1).astype(mx.float16)
        step_out = []
        for cache in caches:
            cache.update_and_fetch(token(1), token(1))
            step_out.append(cache.attend(mx.concatenate([query, query], axis=1), D ** -0.5))
        mx.eval(step_out, [c.state for c in caches])
        outputs.append(step_out)
        grew.append({i for i, c in enumerate(caches)
                     if (c.compressed_keys.capacity, c.compressed_values.capacity) != before[i][:2]})
        flushed.append({i for i, c in enumerate(caches) if c.compressed_keys.length != before[i][2]})
    return grew, flushed, outputs, caches


def test_layers_grow_on_steps_of_their_own_never_in_a_flush(monkeypatch):
    grew, flushed, _, caches = _decode(layers=5, steps=120, grow_ahead=True, monkeypatch=monkeypatch)
    growths = sum(len(g) for g in grew)
    assert growths >= 5 * 5  # each layer grew several times (16-token steps, 8 tokens a flush)
    for step, (g, f) in enumerate(zip(grew, flushed)):
        assert len(g) <= 1, f"step {step}: layers {sorted(g)} grew together"
        assert not (g & f), f"step {step}: layer {sorted(g & f)} grew in its flush"
    for cache in caches:  # stores never hold more than the flush after next needs
        assert cache.compressed_keys.capacity - cache.compressed_keys.length <= 16 + 8


def test_growing_ahead_changes_no_token_and_no_output(monkeypatch):
    _, _, ahead, ahead_caches = _decode(layers=3, steps=60, grow_ahead=True, monkeypatch=monkeypatch)
    with monkeypatch.context() as patch:
        grew, flushed, at_flush, flush_caches = _decode(layers=3, steps=60, grow_ahead=False, monkeypatch=patch)
    assert any(g & f for g, f in zip(grew, flushed))  # the old schedule grows in the flush step
    for a, b in zip(ahead, at_flush):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(np.array(x), np.array(y))
    for a, b in zip(ahead_caches, flush_caches):
        for side in ("compressed_keys", "compressed_values"):
            va, vb = getattr(a, side).view(), getattr(b, side).view()
            for name in va.data:
                np.testing.assert_array_equal(np.array(va.data[name]), np.array(vb.data[name]))


def test_a_prefill_chunk_after_a_trim_is_stored():
    # mlx-lm's server trims a cache to the prompt it shares with the next request, then prefills the rest in chunks:
    # here the chunk compresses more tokens than the trimmed store had room for (it failed to write before)
    config = make_config("affine", bits=4, sinks=4, window=8, flush=8, step=16, kernels="off")
    cache = KVQCache(config)
    rng = np.random.default_rng(1)
    token = lambda n: mx.array(rng.standard_normal((B, H, n, D)), mx.float16)  # noqa: E731
    keys, values = token(200), token(200)
    cache.update_and_fetch(keys, values)
    kept = cache.compressed_keys.view().tokens(0, 136).data
    mx.eval(kept)
    assert cache.trim(60) == 60 and cache.compressed_keys.length == 136
    cache.update_and_fetch(token(100), token(100))
    mx.eval(cache.state)
    assert cache.offset == 240
    assert cache.sinks.length + cache.compressed_keys.length + cache.window.length == 240
    assert cache.compressed_keys.capacity >= cache.compressed_keys.length
    after = cache.compressed_keys.view().tokens(0, 136).data
    for name in kept:
        np.testing.assert_array_equal(np.array(after[name]), np.array(kept[name]))


def test_a_chunk_that_grows_the_store_leaves_room_for_the_next_flush(monkeypatch):
    # otherwise every layer would grow in the first decode steps after a prefill (the window's room left then is
    # too short to spread them): H100, 48 x 32K turboquant:3, 7.8 GB above the caches in such a step
    monkeypatch.setattr(store_module, "SPARE_FROM", 16)  # from 4,096 tokens; these caches hold a few dozen
    config = make_config("affine", bits=4, sinks=4, window=8, flush=8, step=16, kernels="off")
    for tokens in (40, 41, 47, 100):
        cache = KVQCache(config)
        rng = np.random.default_rng(tokens)
        chunk = mx.array(rng.standard_normal((B, H, tokens, D)), mx.float16)
        cache.update_and_fetch(chunk, chunk)
        for store in (cache.compressed_keys, cache.compressed_values):
            assert store.capacity - store.length >= 8, tokens
            assert store.capacity - store.length < 16 + 8, tokens
        assert cache._grow_at == -1  # nothing left to grow before the next flush


def test_short_stores_leave_no_room_beyond_their_steps():
    # below SPARE_FROM tokens the room would be a visible share of the cache (a step more at 2K)
    assert spare(store_module.SPARE_FROM - 1, 128) == 0 and spare(store_module.SPARE_FROM, 128) == 128
    config = make_config("affine", bits=4, sinks=4, window=8, flush=8, step=16, kernels="off")
    cache = KVQCache(config)
    chunk = mx.array(np.random.default_rng(2).standard_normal((B, H, 47, D)), mx.float16)
    cache.update_and_fetch(chunk, chunk)
    store = cache.compressed_keys
    assert store.length == 32 and store.capacity == 32  # 47 - 4 sinks - 11 in the window: two whole steps


def test_a_chunk_shorter_than_the_last_ones_slack_is_stored():
    # no trim: a store with room left grew too little for the next block (counted from the capacity), and the
    # write raised (broadcast_shapes) before the growth counted from the held tokens
    store = EncodedStore(step=16)
    store.append(_encoded(0, 387))
    assert store.capacity == 400
    store.append(_encoded(387, 384))
    assert store.length == 771 and store.capacity >= 771
    np.testing.assert_array_equal(np.array(store.view().data["codes"][0, 1, :, 1]), np.arange(771))


def _speculative(grow_ahead: bool, monkeypatch) -> tuple[int, int]:
    """Decode in chunks of 3 tokens (a draft model's) after a 40-token prefill; ``(growths, growths in a flush)``."""
    if not grow_ahead:
        monkeypatch.setattr(KVQCache, "_schedule_growth", lambda self: None)
    config = make_config("affine", bits=4, sinks=4, window=8, flush=8, step=16, kernels="off")
    cache = KVQCache(config)
    cache._slot = 0  # the schedule's step must not depend on how many caches the test session made before
    rng = np.random.default_rng(3)
    token = lambda n: mx.array(rng.standard_normal((B, H, n, D)), mx.float16)  # noqa: E731
    cache.update_and_fetch(token(40), token(40))
    grew = in_flush = 0
    for _ in range(60):
        length, capacity = cache.compressed_keys.length, cache.compressed_keys.capacity
        cache.update_and_fetch(token(3), token(3))
        changed = cache.compressed_keys.capacity != capacity
        grew += changed
        in_flush += changed and cache.compressed_keys.length != length
        assert cache._grow_at == -1 or cache._grow_at > cache.offset  # never stepped over
    return grew, in_flush


def test_speculative_chunks_reach_the_scheduled_growth(monkeypatch):
    # the single offset a growth is scheduled at may fall inside a chunk: the update that passes it grows the
    # stores, instead of the flush after it
    grew, in_flush = _speculative(True, monkeypatch)
    with monkeypatch.context() as patch:
        grew_off, in_flush_off = _speculative(False, patch)
    assert grew_off == in_flush_off > 0  # without the schedule every growth is a flush's
    assert grew >= grew_off - 1 and in_flush < in_flush_off / 2
