"""A chunk's first compression decided ahead (:func:`kvq.cache.guard.decide_ahead`, :meth:`kvq.cache.KVQCache.settle`):
the update does not wait for the device, and once settled the layer holds, stores and attends exactly what a layer
that waited for the first block's decisions (:func:`kvq.cache.guard.guard_layer`) holds: centred, scaled, stored at
8 bits (its chunk stored again), or none of these; alone, rotating, and as a batch's rows."""

from __future__ import annotations

import contextlib
import warnings

import attrs

import mlx.core as mx
import numpy as np
import pytest

import kvq.cache.guard as guard
from kvq.cache import BatchKVQCache, KVQCache, RotatingKVQCache, make_config
from kvq.cache.guard import OutlierLayerWarning

from conftest import assert_same_held as assert_same, layer_held as held

H, D, T = 2, 64, 48
KINDS = ("plain", "offsets", "outlier", "scaled")
SCALE = D**-0.5


def row_keys(kind: str, seed: int, tokens: int = T):
    """Keys and values ``[1, H, tokens, D]``: ``plain`` standard normal keys; ``offsets`` with constant offsets of +60
    and -50 in channels 5 and 40 (centred); ``outlier`` those offsets and channel 9 swinging by 20 with position (one
    channel holds over a quarter of the varying energy: stored at 8 bits); ``scaled`` the first 8 channels 4x louder
    in both heads (key channel scales)."""
    kk, kv = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, H, tokens, D), key=kk)
    if kind in ("offsets", "outlier"):
        keys = keys + mx.zeros((D,)).at[5].add(60.0).at[40].add(-50.0)
    if kind == "outlier":
        swing = 20 * mx.sin(0.3 * mx.arange(tokens).astype(mx.float32))
        keys = keys + swing[:, None] * mx.zeros((D,)).at[9].add(1.0)
    if kind == "scaled":
        keys = keys * mx.where(mx.arange(D) < 8, 4.0, 1.0)
    return keys, mx.random.normal((1, H, tokens, D), key=kv)


class CountingMx:
    """``mlx.core`` with its ``eval`` calls counted (the guard's waits for the device)."""

    def __init__(self) -> None:
        self.evals = 0

    def __getattr__(self, name):
        return getattr(mx, name)

    def eval(self, *args):
        self.evals += 1
        return mx.eval(*args)


@contextlib.contextmanager
def waiting(monkeypatch):
    """Within: every chunk decides its guard by waiting (the reference)."""
    with monkeypatch.context() as m:
        m.setattr(KVQCache, "DECIDE_AHEAD", False)
        yield


def make(kind_of_cache: str, config):
    return KVQCache(config) if kind_of_cache == "plain" else RotatingKVQCache(config, max_size=40, keep=2)


def run(cache, keys, values, queries, chunks, steps: int = 3) -> list:
    """Prefill in ``chunks`` (token counts), each chunk's queries attended, then ``steps`` single-token decode steps;
    every attention output, as numpy."""
    outs, start = [], 0
    for n in chunks:
        cache.update_and_fetch(keys[:, :, start:start + n], values[:, :, start:start + n])
        outs.append(np.array(cache.attend(queries[:, :, start:start + n], SCALE)))
        start += n
    for t in range(start, start + steps):
        cache.update_and_fetch(keys[:, :, t:t + 1], values[:, :, t:t + 1])
        outs.append(np.array(cache.attend(queries[:, :, t:t + 1], SCALE)))
    return outs


@pytest.mark.parametrize("policy", ["upgrade", "warn"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cache_kind", ["plain", "rotating"])
def test_a_chunk_decided_ahead_holds_and_attends_what_a_waiting_one_does(cache_kind, kind, policy, monkeypatch):
    """Two chunks (the first compresses), then decode: the chunk's update waits for nothing, and the layer ends with
    the method, outlier flag, mean, scales, codes, sinks, window and bytes of a layer that waited, every attention
    output equal bit for bit, and the same warnings. An outlier layer under ``"upgrade"`` settles by storing its
    chunk again: two waits, both when its queries attend."""
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off", outlier_layers=policy).for_layer(1)
    keys, values = row_keys(kind, 3, tokens=T + 8)
    queries = mx.random.normal((1, 2 * H, T + 8, D), key=mx.random.key(11))
    chunks = [30, 18]

    with waiting(monkeypatch), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = make(cache_kind, config)
        expected = run(reference, keys, values, queries, chunks)
    expected_warnings = [str(w.message) for w in caught if w.category is OutlierLayerWarning]

    counting = CountingMx()
    monkeypatch.setattr(guard, "mx", counting)
    cache = make(cache_kind, config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.update_and_fetch(keys[:, :, :30], values[:, :, :30])
        assert counting.evals == 0 and cache._ahead is not None  # decided ahead: nothing waited for
        got = [np.array(cache.attend(queries[:, :, :30], SCALE))]
        assert cache._ahead is None and cache._fresh is None
        assert counting.evals == (2 if kind == "outlier" and policy == "upgrade" else 1)
        got += run(cache, keys[:, :, 30:], values[:, :, 30:], queries[:, :, 30:], chunks[1:])
    assert [str(w.message) for w in caught if w.category is OutlierLayerWarning] == expected_warnings
    assert len(expected_warnings) == (kind == "outlier")
    assert_same(held(cache), held(reference))
    assert (cache.key_mean is not None) == (kind in ("offsets", "outlier"))
    upgraded = kind == "outlier" and policy == "upgrade"
    # the outlier channel's swing makes its head's channels unequal too: scaled where it keeps TurboQuant
    assert (cache.key_scale is not None) == (kind == "scaled" or (kind == "outlier" and not upgraded))
    assert cache.config.key_params.method == ("affine" if upgraded else "turboquant")
    for i, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        np.testing.assert_array_equal(ours, theirs, err_msg=f"attention {i}")


@pytest.mark.parametrize("reader", ["update", "release_chunk", "config", "state", "keys", "nbytes", "trim", "copy"])
def test_a_chunk_stored_without_attending_is_settled_by_whatever_reads_the_layer_next(reader, monkeypatch):
    """An outlier layer's chunk stored and never attended (as ``kvq bench`` fills caches): the next update, the
    chunk's release, its configuration, the prompt-cache state (a file of it loads as the waiting layer's), the
    ``keys`` of pipeline parallelism, the bytes, a trim or a copy settles it first, and the layer then holds
    what a waiting layer holds (here its 8-bit stores)."""
    import copy

    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    keys, values = row_keys("outlier", 5, tokens=T + 1)
    with waiting(monkeypatch), warnings.catch_warnings():
        warnings.simplefilter("ignore", OutlierLayerWarning)
        reference = KVQCache(config)
        reference.update_and_fetch(keys[:, :, :T], values[:, :, :T])
        reference.release_chunk()
    cache = KVQCache(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutlierLayerWarning)
        cache.update_and_fetch(keys[:, :, :T], values[:, :, :T])
        assert cache._ahead is not None and cache._config.key_params.method == "turboquant"  # not yet settled
        if reader == "update":
            cache.update_and_fetch(keys[:, :, T:], values[:, :, T:])
            reference.update_and_fetch(keys[:, :, T:], values[:, :, T:])
        elif reader == "release_chunk":
            cache.release_chunk()
            assert cache._fresh is None
        elif reader == "config":
            assert cache.config.key_params.method == "affine"
        elif reader == "state":
            state = cache.state
            assert "affine" in state["config"]
            assert_same(held(KVQCache.from_state(state)), held(KVQCache.from_state(reference.state)))
        elif reader == "keys":
            assert cache.keys.shape == reference.keys.shape
        elif reader == "nbytes":
            assert cache.nbytes == reference.nbytes
        elif reader == "trim":
            assert cache.trim(1) == reference.trim(1) == 1
        else:
            cache = copy.deepcopy(cache)
    assert cache._ahead is None and cache._config.key_params.method == "affine"
    assert_same(held(cache), held(reference))


def test_a_chunk_that_fails_leaves_nothing_to_settle(monkeypatch):
    """A chunk whose quantizer raises after its first block was decided ahead: the error reaches the caller and the
    layer is as it was, with nothing pending; the next chunk compresses and decides as a fresh layer does."""
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    keys, values = row_keys("offsets", 2)
    cache = KVQCache(config)
    real = cache._encode

    def failing(k, v):
        raise RuntimeError("quantizer failed")

    monkeypatch.setattr(cache, "_encode", failing)
    with pytest.raises(RuntimeError, match="quantizer failed"):
        cache.update_and_fetch(keys, values)
    assert cache.offset == 0 and cache._ahead is None and cache._undo is None and cache.key_mean is None
    monkeypatch.setattr(cache, "_encode", real)
    with waiting(monkeypatch):
        reference = KVQCache(config)
        reference.update_and_fetch(keys, values)
        reference.release_chunk()
    cache.update_and_fetch(keys, values)
    cache.release_chunk()
    assert_same(held(cache), held(reference))


@pytest.mark.parametrize("lengths", [None, [10, T, T, T]], ids=["equal", "one-short"])
def test_a_batch_waits_for_nothing_while_storing_and_its_rows_decide_as_alone(lengths, monkeypatch):
    """Four rows (plain, offsets, outlier, scaled keys) prefilled as one batch chunk: the update waits for the device
    not once, the rows that compress decide their first blocks in one graph (one :func:`guard.decide_ahead_rows` of
    all of them, none alone), and after attending every row holds what the same tokens give a lone waiting cache
    (method, mean, scales, codes) and attends alike, the outlier row warning once. ``one-short``: the first row's
    prompt has 10 real tokens (right padding), too few to compress."""
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    data = [row_keys(kind, seed) for seed, kind in enumerate(KINDS)]
    counts = lengths or [T] * len(KINDS)
    q = mx.random.normal((len(KINDS), 2 * H, T, D), key=mx.random.key(9))

    alone = []
    with waiting(monkeypatch), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, ((k, v), n) in enumerate(zip(data, counts)):
            cache = KVQCache(config)
            cache.update_and_fetch(k[:, :, :n], v[:, :, :n])
            alone.append((cache, np.array(cache.attend(q[i:i + 1, :, :n], SCALE))))
    assert len([w for w in caught if w.category is OutlierLayerWarning]) == 1

    counting = CountingMx()
    monkeypatch.setattr(guard, "mx", counting)
    decided_rows = []
    rows_decider = guard.decide_ahead_rows
    monkeypatch.setattr(guard, "decide_ahead_rows",
                        lambda config, blocks: decided_rows.append(blocks.shape[0]) or rows_decider(config, blocks))
    batch = BatchKVQCache([KVQCache(config) for _ in KINDS])
    if lengths is not None:
        batch.prepare(lengths=lengths, right_padding=[T - n for n in lengths])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch.update_and_fetch(mx.concatenate([k for k, _ in data]), mx.concatenate([v for _, v in data]))
        assert counting.evals == 0
        assert decided_rows == [len([n for n in counts if n == T])]
        out = batch.attend(q, SCALE)
    assert len([w for w in caught if w.category is OutlierLayerWarning]) == 1
    if lengths is not None:
        batch.finalize()
    decided = [held(row) for row in batch.rows]
    assert [d["method"] for d in decided] == ["turboquant", "turboquant", "affine", "turboquant"]
    assert [d["mean"] is not None for d in decided] == [False, True, True, False]
    assert [d["scale"] is not None for d in decided] == [False, False, False, True]
    for i, (ours, (cache, expected)) in enumerate(zip(decided, alone)):
        assert_same(ours, held(cache))
        np.testing.assert_array_equal(np.array(out[i:i + 1, :, :counts[i]]), expected)


def test_rotating_rows_and_rows_of_one_token_decide_as_alone(monkeypatch):
    """Rotating rows (a ring of 40, keep 2) over two chunks, where in the second a row has one real token left
    (right padding): every row holds what a lone waiting cache holds, and the row whose first compression is a
    single token (never undone, so never decided ahead) waits for it there."""
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    data = [row_keys(kind, seed) for seed, kind in enumerate(KINDS)]
    first, lengths = 10, [T - 10, 1, T - 10, T - 10]  # the second chunk's real tokens per row
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutlierLayerWarning)
        with waiting(monkeypatch):
            alone = []
            for (k, v), n in zip(data, lengths):
                cache = RotatingKVQCache(config, max_size=40, keep=2)
                cache.update_and_fetch(k[:, :, :first], v[:, :, :first])
                cache.update_and_fetch(k[:, :, first:first + n], v[:, :, first:first + n])
                cache.release_chunk()
                alone.append(cache)
        batch = BatchKVQCache([RotatingKVQCache(config, max_size=40, keep=2) for _ in KINDS])
        batch.update_and_fetch(mx.concatenate([k[:, :, :first] for k, _ in data]),
                               mx.concatenate([v[:, :, :first] for _, v in data]))
        batch.prepare(lengths=lengths, right_padding=[T - first - n for n in lengths])
        batch.update_and_fetch(mx.concatenate([k[:, :, first:] for k, _ in data]),
                               mx.concatenate([v[:, :, first:] for _, v in data]))
        assert [row._ahead is not None for row in batch.rows] == [True, False, True, True]
        batch.release_chunk()
        batch.finalize()
    for row, cache in zip(batch.rows, alone):
        assert row._ahead is None
        assert_same(held(row), held(cache))


def test_an_outlier_layer_whose_chunk_fails_to_store_again_keeps_it_and_says_why(monkeypatch):
    """An outlier layer under ``"upgrade"`` whose chunk, stored again at 8 bits when it settles (here at the next
    update), fails there: no token is lost (the chunk stays as stored ahead, with the layer's method), the layer is
    marked an outlier layer with a warning naming the error, and it holds and attends what a layer under ``"warn"``
    does (its next update went on as usual)."""
    from kvq.cache.layer import KVQCache as Layer

    keys, values = row_keys("outlier", 4, tokens=T + 8)
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    with waiting(monkeypatch), warnings.catch_warnings():
        warnings.simplefilter("ignore", OutlierLayerWarning)
        reference = KVQCache(make_config("turboquant", bits=4, window=12, flush=4, kernels="off",
                                         outlier_layers="warn").for_layer(1))
        reference.update_and_fetch(keys[:, :, :T], values[:, :, :T])
        reference.update_and_fetch(keys[:, :, T:], values[:, :, T:])
    real = Layer._encode

    def encode(self, k, v):
        if self._config.key_params.method == "affine":
            raise RuntimeError("no 8-bit encoder here")
        return real(self, k, v)

    monkeypatch.setattr(Layer, "_encode", encode)
    cache = KVQCache(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.update_and_fetch(keys[:, :, :T], values[:, :, :T])
        cache.update_and_fetch(keys[:, :, T:], values[:, :, T:])
    messages = [str(w.message) for w in caught if w.category is OutlierLayerWarning]
    # the attempt's own warning ("stored with affine:8 instead"), then what came of it
    assert len(messages) == 2 and "failed (RuntimeError: no 8-bit encoder here), so it keeps" in messages[-1]
    assert cache.offset == T + 8 and cache.config.outlier_layer
    assert_same(held(cache), held(reference))
    q = mx.random.normal((1, 2 * H, 1, D), key=mx.random.key(5))
    np.testing.assert_array_equal(np.array(cache.attend(q, SCALE)), np.array(reference.attend(q, SCALE)))


def test_a_chunk_with_learned_sink_logits_settles_before_it_attends(monkeypatch):
    """Learned sink logits (gpt-oss): the chunk's layer is settled before its attention is built (on a GPU that path
    decodes the keys otherwise while the layer holds a mean), and attends as a waiting layer does."""
    from kvq.cache import engine

    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    keys, values = row_keys("offsets", 6)
    queries = mx.random.normal((1, 2 * H, T, D), key=mx.random.key(8))
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    with waiting(monkeypatch):
        reference = KVQCache(config)
        reference.update_and_fetch(keys, values)
        expected = np.array(reference.attend(queries, SCALE, sink_logits=sinks))
    seen, real = [], engine.attend

    def spy(*args, **kwargs):
        seen.append(cache._ahead is None)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "attend", spy)
    cache = KVQCache(config)
    cache.update_and_fetch(keys, values)
    assert cache._ahead is not None
    np.testing.assert_array_equal(np.array(cache.attend(queries, SCALE, sink_logits=sinks)), expected)
    assert seen == [True]
    assert_same(held(cache), held(reference))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_blocks_decided_together_are_decided_as_alone_bit_for_bit(dtype):
    """:func:`guard.decide_ahead_rows` of five rows' first blocks (each kind of keys, and non-finite ones): each row's
    decisions, concentration, mean and scales equal those :func:`guard.decide_ahead` and :func:`guard.guard_layer`
    give its block alone, bit for bit."""
    config = make_config("turboquant", bits=3).for_layer(1)
    blocks = [row_keys(kind, seed)[0] for seed, kind in enumerate(KINDS)]
    blocks.append(mx.where(mx.arange(D) == 3, mx.inf, blocks[0]))
    blocks = [b.astype(dtype) for b in blocks]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutlierLayerWarning)
        together = guard.decide_ahead_rows(config, mx.stack(blocks))
        for r, block in enumerate(blocks):
            alone = guard.decide_ahead(config, block)
            ours = together[r]
            assert ours.row == r and alone.row == 0
            assert ours.block.decided(r) == alone.block.decided()
            assert ours.block.concentration(r) == alone.block.concentration()
            np.testing.assert_array_equal(np.array(ours.mean), np.array(alone.mean))
            np.testing.assert_array_equal(np.array(ours.scales), np.array(alone.scales))
            waited, mean, scales = guard.guard_layer(config, block)
            if alone.block.decided()[1]:  # an outlier layer under "upgrade": stored again, waiting
                assert guard.settle(config, ours) is None and waited.outlier_layer
            else:
                kept = guard.settle(config, ours)
                assert kept[0] == waited
                for x, y in zip(kept[1:], (mean, scales)):
                    assert (x is None) == (y is None)
                    if x is not None:
                        np.testing.assert_array_equal(np.array(x), np.array(y))


def test_rows_of_another_configuration_decide_alone(monkeypatch):
    """A batch whose middle row has another configuration (its guard off): the other two decide together, it alone
    (where its guard does not apply), and each row holds what a lone waiting cache holds."""
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    off = make_config("turboquant", bits=4, window=12, flush=4, kernels="off", outlier_layers="off").for_layer(1)
    configs = [config, off, config]
    data = [row_keys("offsets", seed) for seed in range(3)]
    with waiting(monkeypatch):
        alone = []
        for c, (k, v) in zip(configs, data):
            cache = KVQCache(c)
            cache.update_and_fetch(k, v)
            cache.release_chunk()
            alone.append(cache)
    batch = BatchKVQCache([KVQCache(c) for c in configs])
    batch.update_and_fetch(mx.concatenate([k for k, _ in data]), mx.concatenate([v for _, v in data]))
    batch.release_chunk()
    assert [held(row)["mean"] is not None for row in batch.rows] == [True, False, True]
    for row, cache in zip(batch.rows, alone):
        assert_same(held(row), held(cache))


def test_rows_whose_still_channels_differ_decide_with_their_own():
    """Two rows whose configurations differ only in their still channels (which ``CacheConfig`` equality leaves out,
    and which set the centring rule and the mean's channels): the second row decides with its own (its mean zero
    outside its still channel), as alone."""
    base = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    still = attrs.evolve(base, still_channels=(5,))
    data = [row_keys("offsets", seed) for seed in range(2)]
    expected = []
    for config, (k, v) in zip((base, still), data):
        cache = KVQCache(config)
        cache.update_and_fetch(k, v)
        cache.release_chunk()
        expected.append(held(cache))
    assert np.all(expected[1]["mean"][..., np.arange(D) != 5] == 0) and np.any(expected[0]["mean"][..., 40] != 0)
    batch = BatchKVQCache([KVQCache(base), KVQCache(still)])
    batch.update_and_fetch(mx.concatenate([k for k, _ in data]), mx.concatenate([v for _, v in data]))
    batch.release_chunk()
    for row, theirs in zip(batch.rows, expected):
        assert_same(held(row), theirs)


def test_a_failed_batch_update_leaves_no_shared_decision_behind():
    """A batch's chunk whose second row's update raises: the third row, never updated, keeps no decision made from
    that chunk's keys; reused for keys without offsets it decides on its own (not centred), as alone."""
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    data = [row_keys("offsets", seed) for seed in range(3)]
    batch = BatchKVQCache([KVQCache(config) for _ in range(3)])

    def fails(*args):
        raise RuntimeError("row 1 failed")

    batch.rows[1].update_and_fetch = fails
    with pytest.raises(RuntimeError, match="row 1 failed"):
        batch.update_and_fetch(mx.concatenate([k for k, _ in data]), mx.concatenate([v for _, v in data]))
    row = batch.rows[2]
    assert row.offset == 0
    k, v = row_keys("plain", 7)
    row.update_and_fetch(k, v)
    row.release_chunk()
    alone = KVQCache(config)
    alone.update_and_fetch(k, v)
    alone.release_chunk()
    assert row.key_mean is None
    assert_same(held(row), held(alone))
