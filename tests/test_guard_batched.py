"""A batch's first-block checks (:class:`kvq.cache.guard.Batched`): the rows of a ``BatchKVQCache`` that make their
first compression in one prefill chunk wait for the device once between them, and each decides what it would alone
(centred, scaled, stored at 8 bits, or none of these)."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

import kvq.cache.guard as guard
from kvq.cache import BatchKVQCache, KVQCache, make_config
from kvq.cache.guard import OutlierLayerWarning

H, D, T = 2, 64, 48
KINDS = ("plain", "offsets", "outlier", "scaled")


def row_keys(kind: str, seed: int):
    """Keys and values ``[1, H, T, D]``: ``plain`` standard normal keys; ``offsets`` with constant offsets of +60 and
    -50 in channels 5 and 40 (centred); ``outlier`` those offsets and channel 9 swinging by 20 with position (one
    channel holds over a quarter of the varying energy: stored at 8 bits); ``scaled`` the first 8 channels 4x louder
    in both heads (key channel scales)."""
    kk, kv = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, H, T, D), key=kk)
    if kind in ("offsets", "outlier"):
        keys = keys + mx.zeros((D,)).at[5].add(60.0).at[40].add(-50.0)
    if kind == "outlier":
        keys = keys + (20 * mx.sin(0.3 * mx.arange(T).astype(mx.float32)))[:, None] * mx.zeros((D,)).at[9].add(1.0)
    if kind == "scaled":
        keys = keys * mx.where(mx.arange(D) < 8, 4.0, 1.0)
    return keys, mx.random.normal((1, H, T, D), key=kv)


class CountingMx:
    """``mlx.core`` with its ``eval`` calls counted (the guard's waits for the device)."""

    def __init__(self) -> None:
        self.evals = 0

    def __getattr__(self, name):
        return getattr(mx, name)

    def eval(self, *args):
        self.evals += 1
        return mx.eval(*args)


def state(cache: KVQCache) -> dict:
    """What the checks decide for a row, and the codes it stored."""
    arrays = {f"{side}.{name}": np.array(value)
              for side, store in (("k", cache.compressed_keys), ("v", cache.compressed_values)) if store.length
              for name, value in store.view().data.items()}
    return {"method": cache.config.key_params.method, "outlier": cache.config.outlier_layer,
            "mean": None if cache.key_mean is None else np.array(cache.key_mean),
            "scale": None if cache.key_scale is None else np.array(cache.key_scale), **arrays}


def assert_same(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(ours[name], value, err_msg=name)
        else:
            assert ours[name] == value, name


@pytest.mark.parametrize("lengths", [None, [10, T, T, T]], ids=["equal", "one-short"])
def test_rows_wait_once_and_decide_as_alone(lengths, monkeypatch):
    """Four rows (plain, offsets, outlier, scaled keys) prefilled as one batch chunk: the guard waits for the device
    once (four lone caches: four times), every row holds what the same tokens give a lone cache (method, mean,
    scales, codes) and attends alike, and the outlier row warns once. ``one-short``: the first row's prompt has 10
    real tokens (right padding), too few to compress, so three rows defer."""
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    data = [row_keys(kind, seed) for seed, kind in enumerate(KINDS)]
    counts = lengths or [T] * len(KINDS)
    counting = CountingMx()
    monkeypatch.setattr(guard, "mx", counting)

    alone = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for (k, v), n in zip(data, counts):
            cache = KVQCache(config)
            cache.update_and_fetch(k[:, :, :n], v[:, :, :n])
            alone.append(cache)
    lone_waits, lone_warnings = counting.evals, [w for w in caught if w.category is OutlierLayerWarning]
    assert lone_waits == sum(n >= 16 for n in counts)  # window + flush tokens: a first compression each

    counting.evals = 0
    batch = BatchKVQCache([KVQCache(config) for _ in KINDS])
    if lengths is not None:
        batch.prepare(lengths=lengths, right_padding=[T - n for n in lengths])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch.update_and_fetch(mx.concatenate([k for k, _ in data]), mx.concatenate([v for _, v in data]))
    assert counting.evals == 1
    assert len([w for w in caught if w.category is OutlierLayerWarning]) == len(lone_warnings) == 1

    decided = [state(row) for row in batch.rows]
    assert [d["method"] for d in decided] == ["turboquant", "turboquant", "affine", "turboquant"]
    assert [d["mean"] is not None for d in decided] == [False, True, True, False]
    assert [d["scale"] is not None for d in decided] == [False, False, False, True]
    for ours, cache in zip(decided, alone):
        assert_same(ours, state(cache))

    q = mx.random.normal((len(KINDS), 2 * H, T, D), key=mx.random.key(9))
    out = batch.attend(q, D**-0.5)
    if lengths is not None:
        batch.finalize()
    for i, cache in enumerate(alone):
        n = counts[i]
        np.testing.assert_allclose(np.array(out[i:i + 1, :, :n]), np.array(cache.attend(q[i:i + 1, :, :n], D**-0.5)),
                                   atol=1e-6, rtol=1e-6)


def test_a_failed_replay_leaves_no_statistics_behind():
    """A replay whose rows do not take every recorded statistic raises, and the next check waits for the device
    itself (nothing recorded is left for it to take)."""
    checks = guard.Batched()
    keys, _ = row_keys("offsets", 0)
    config = make_config("turboquant", bits=4).for_layer(0)
    with pytest.raises(guard.Deferred), checks.collect():
        guard.guard_layer(config, keys)
    with pytest.raises(RuntimeError, match="were not replayed"), checks.replay():
        pass
    assert guard.guard_layer(config, keys)[1] is not None  # centred, from its own statistics


def test_rotating_rows_and_rows_of_one_token_decide_as_alone(monkeypatch):
    """Rotating rows (a ring of 40, keep 2) over two chunks, where in the second a row has one real token left
    (right padding): the rows that store a chunk wait once between them, a row of one token checks on its own (a
    one-token update is not undone, so it never defers), and every row holds what a lone cache holds."""
    from kvq.cache import RotatingKVQCache

    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    data = [row_keys(kind, seed) for seed, kind in enumerate(KINDS)]
    first, lengths = 10, [T - 10, 1, T - 10, T - 10]  # the second chunk's real tokens per row
    counting = CountingMx()
    monkeypatch.setattr(guard, "mx", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutlierLayerWarning)
        alone = []
        for (k, v), n in zip(data, lengths):
            cache = RotatingKVQCache(config, max_size=40, keep=2)
            cache.update_and_fetch(k[:, :, :first], v[:, :, :first])
            cache.update_and_fetch(k[:, :, first:first + n], v[:, :, first:first + n])
            alone.append(cache)
        counting.evals = 0
        batch = BatchKVQCache([RotatingKVQCache(config, max_size=40, keep=2) for _ in KINDS])
        batch.update_and_fetch(mx.concatenate([k[:, :, :first] for k, _ in data]),
                               mx.concatenate([v[:, :, :first] for _, v in data]))
        assert counting.evals == 0  # 10 tokens: no row compresses yet
        batch.prepare(lengths=lengths, right_padding=[T - first - n for n in lengths])
        batch.update_and_fetch(mx.concatenate([k[:, :, first:] for k, _ in data]),
                               mx.concatenate([v[:, :, first:] for _, v in data]))
        batch.finalize()
    assert counting.evals == 1  # rows 0, 2 and 3 together; row 1 (11 tokens) has not compressed
    for row, cache in zip(batch.rows, alone):
        assert row.offset == cache.offset
        assert_same(state(row), state(cache))


def test_a_row_that_fails_while_collecting_leaves_no_deferral_behind(monkeypatch):
    """A row whose quantizer raises once the batch replays its checks: the error reaches the caller, that row is as
    it was, and the next lone check waits for the device itself (nothing is left recording or replaying in the
    thread)."""
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    data = [row_keys(kind, seed) for seed, kind in enumerate(KINDS[:3])]
    rows = [KVQCache(config) for _ in data]
    calls = {"n": 0}
    real = rows[1]._encode

    def failing(keys, values):
        calls["n"] += 1
        raise RuntimeError("quantizer failed")

    monkeypatch.setattr(rows[1], "_encode", failing)
    batch = BatchKVQCache(rows)
    with pytest.raises(RuntimeError, match="quantizer failed"):
        batch.update_and_fetch(mx.concatenate([k for k, _ in data]), mx.concatenate([v for _, v in data]))
    assert calls["n"] == 1 and rows[1].offset == 0 and rows[1].compressed_keys.length == 0
    assert guard._BATCH.collecting is None and guard._BATCH.replay is None
    monkeypatch.setattr(rows[1], "_encode", real)
    lone = KVQCache(config)
    counting = CountingMx()
    monkeypatch.setattr(guard, "mx", counting)
    lone.update_and_fetch(*data[1])
    assert counting.evals == 1 and lone.key_mean is not None  # its own wait; centred (offsets)
