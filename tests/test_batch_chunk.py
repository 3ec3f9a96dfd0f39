"""A batch's prefill chunk attended in one call (:func:`kvq.cache.engine.attend_rows`, issue #51): mlx-lm's
``BatchGenerator`` prefills its prompts as one batch, and on a GPU every row took its own decode, mask and attention
call per layer. The GPU chunk path is forced on the CPU here (as in ``test_prefill_chunks.py``); each row must see
and hold what it does alone."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

import kvq.cache.engine as engine
from kvq.cache import BatchKVQCache, KVQCache, RotatingKVQCache, make_config
from kvq.cache import prefill, stacked
from kvq.cache.guard import OutlierLayerWarning

from conftest import assert_same_held as assert_held_alike, gpu_chunk_rule, layer_held as held

H, D, T = 2, 64, 48
SCALE = D**-0.5
KINDS = ("plain", "offsets", "outlier", "scaled")


def row_keys(kind: str, seed: int, tokens: int = T, dtype=mx.float16):
    """Keys and values ``[1, H, tokens, D]`` of ``dtype``: ``plain`` standard normal; ``offsets`` constant offsets in
    two channels (the layer is centred); ``outlier`` those offsets and one channel swinging with position (an
    outlier layer: stored again at 8 bits when it settles); ``scaled`` eight channels 4x louder (key scales)."""
    kk, kv = mx.random.split(mx.random.key(seed))
    keys = mx.random.normal((1, H, tokens, D), key=kk)
    if kind in ("offsets", "outlier"):
        keys = keys + mx.zeros((D,)).at[5].add(6.0).at[40].add(-5.0) * 10
    if kind == "outlier":
        keys = keys + (20 * mx.sin(0.3 * mx.arange(tokens).astype(mx.float32)))[:, None] * mx.zeros((D,)).at[9].add(1.0)
    if kind == "scaled":
        keys = keys * mx.where(mx.arange(D) < 8, 4.0, 1.0)
    return keys.astype(dtype), mx.random.normal((1, H, tokens, D), key=kv).astype(dtype)


@pytest.fixture
def on_device(monkeypatch):
    """The GPU's chunk path (a decoded copy, one masked fused attention per call) taken on the CPU; counts the
    attention calls queued (:data:`kvq.cache.prefill.IN_FLIGHT`) and the batches attended as one."""
    monkeypatch.setattr(KVQCache, "_prefill_on_device", gpu_chunk_rule)
    calls = {"queued": 0, "together": 0}
    monkeypatch.setattr(prefill.IN_FLIGHT, "push", lambda out: calls.__setitem__("queued", calls["queued"] + 1))
    together = engine.attend_rows

    def counted(*args):
        out = together(*args)
        calls["together"] += len(out)
        return out

    monkeypatch.setattr(engine, "attend_rows", counted)
    return calls


def alone(configs, data, q, chunks):
    """Each row prefilled alone in ``chunks``: its outputs per chunk and the cache."""
    results = []
    for i, (config, (k, v)) in enumerate(zip(configs, data)):
        cache, outs, start = KVQCache(config), [], 0
        for n in chunks:
            cache.update_and_fetch(k[:, :, start:start + n], v[:, :, start:start + n])
            outs.append(np.array(cache.attend(q[i:i + 1, :, start:start + n], SCALE).astype(mx.float32)))
            start += n
        results.append((cache, outs))
    return results


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
@pytest.mark.parametrize("chunks", [[T], [20, T - 20]], ids=["one-chunk", "two-chunks"])
def test_a_batch_chunk_is_attended_in_one_call_and_each_row_sees_what_it_sees_alone(on_device, chunks, dtype):
    """Four rows (plain, centred, outlier, scaled keys) prefilled as one batch: each chunk is queued once for the
    rows of one configuration (not once per row: after the outlier row's upgrade to 8 bits, the second chunk's other
    three rows are still attended together, the upgraded one alone), and every row's output and everything it holds
    equal those of the row prefilled alone, the outlier row's chunk stored again and attended again when it
    settles."""
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    data = [row_keys(kind, seed, dtype=dtype) for seed, kind in enumerate(KINDS)]
    q = mx.random.normal((len(KINDS), 2 * H, T, D), key=mx.random.key(9)).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutlierLayerWarning)
        expected = alone([config] * len(KINDS), data, q, chunks)
        on_device.update(queued=0, together=0)
        batch = BatchKVQCache([KVQCache(config) for _ in KINDS])
        outs, start = [], 0
        for n in chunks:
            batch.update_and_fetch(mx.concatenate([k[:, :, start:start + n] for k, _ in data]),
                                   mx.concatenate([v[:, :, start:start + n] for _, v in data]))
            outs.append(np.array(batch.attend(q[:, :, start:start + n], SCALE).astype(mx.float32)))
            start += n
    # first chunk: one call for the four rows, then the outlier row alone again once it settles (stored at 8 bits);
    # a second chunk: one call for the three rows of the first configuration, one for the upgraded row
    assert on_device["together"] == len(chunks)
    assert on_device["queued"] == 2 + (2 if len(chunks) == 2 else 0)
    for i, (cache, their_outs) in enumerate(expected):
        assert_held_alike(held(batch.rows[i]), held(cache))
        for c, theirs in enumerate(their_outs):
            np.testing.assert_array_equal(outs[c][i:i + 1], theirs, err_msg=f"row {i}, chunk {c}")


@pytest.mark.parametrize("kinds", [("plain",) * 3, ("plain", "offsets", "scaled")], ids=["plain", "mixed"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_rows_of_different_lengths_are_attended_together_each_as_alone(on_device, kinds, dtype):
    """Rows of different lengths (right padding: one prompt of 36 tokens, one of 30, one of 48) hold parts of other
    sizes: they are still attended in one call, each part padded to the longest row's and each batch row keeping its
    own intervals; every row holds exactly what it holds alone and its real query rows' outputs are its own (the
    padded, hidden columns can change only the order of float additions)."""
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    data = [row_keys(kind, seed, dtype=dtype) for seed, kind in enumerate(kinds)]
    lengths = [36, 30, T]
    q = mx.random.normal((3, 2 * H, T, D), key=mx.random.key(9)).astype(dtype)
    expected = [alone([config], [(k[:, :, :n], v[:, :, :n])], q[i:i + 1, :, :n], [n])[0]
                for i, ((k, v), n) in enumerate(zip(data, lengths))]
    on_device.update(queued=0, together=0)
    batch = BatchKVQCache([KVQCache(config) for _ in data])
    batch.prepare(lengths=lengths, right_padding=[T - n for n in lengths])
    batch.update_and_fetch(mx.concatenate([k for k, _ in data]), mx.concatenate([v for _, v in data]))
    out = np.array(batch.attend(q, SCALE).astype(mx.float32))
    batch.finalize()
    assert on_device["together"] == 1 and on_device["queued"] == 1
    # bit for bit on the CPU (its attention adds the hidden columns' exact zeros); a GPU's fused attention may sum
    # in another order over the wider rows
    tolerance = 0 if mx.default_device() == mx.cpu else 2e-3 if dtype == mx.float16 else 1.6e-2
    for i, ((cache, theirs), n) in enumerate(zip(expected, lengths)):
        assert_held_alike(held(batch.rows[i]), held(cache))
        np.testing.assert_allclose(out[i:i + 1, :, :n], theirs[0], rtol=tolerance, atol=tolerance,
                                   err_msg=f"row {i}")
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_short_prompts_with_nothing_compressed_attend_as_kvcache_and_together(on_device, monkeypatch, dtype):
    """Prompts shorter than the sinks and the window (a chat's first turn: nothing compressed) hold only dense
    parts, which a GPU attends in MLX's fused attention as mlx-lm's KVCache does (the parts path, a dense attention
    per slice of rows merged in float32, differed from it by up to 0.07 in bfloat16 for keys with offsets in the
    tens), a batch of them in one call: each row holds what it holds alone, and its real query rows' outputs are
    its own alone and KVCache's (MLX's fused attention over the row's tokens, causal), bit for bit on the CPU."""
    # (the on_device fixture takes the GPU's rule: nothing compressed takes the fused path too)
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    lengths = [18, 10, 15, 18]
    data = [row_keys(kind, seed, tokens=18, dtype=dtype) for seed, kind in enumerate(("plain", "offsets") * 2)]
    q = mx.random.normal((4, 2 * H, 18, D), key=mx.random.key(9)).astype(dtype)
    expected = [alone([config], [(k[:, :, :n], v[:, :, :n])], q[i:i + 1, :, :n], [n])[0]
                for i, ((k, v), n) in enumerate(zip(data, lengths))]
    assert on_device["queued"] == 4  # alone: each row's chunk one fused call too
    on_device.update(queued=0, together=0)
    batch = BatchKVQCache([KVQCache(config) for _ in data])
    batch.prepare(lengths=lengths, right_padding=[18 - n for n in lengths])
    batch.update_and_fetch(mx.concatenate([k for k, _ in data]), mx.concatenate([v for _, v in data]))
    out = np.array(batch.attend(q, SCALE).astype(mx.float32))
    batch.finalize()
    assert on_device["together"] == 1 and on_device["queued"] == 1
    assert all(not row.compressed_keys.length for row in batch.rows)
    tolerance = 0 if mx.default_device() == mx.cpu else 2e-3 if dtype == mx.float16 else 1.6e-2
    for i, ((cache, theirs), n) in enumerate(zip(expected, lengths)):
        assert_held_alike(held(batch.rows[i]), held(cache))
        k, v = data[i]
        kvcache = mx.fast.scaled_dot_product_attention(q[i:i + 1, :, :n], k[:, :, :n], v[:, :, :n], scale=SCALE,
                                                       mask="causal")
        for reference in (theirs[0], np.array(kvcache.astype(mx.float32))):
            np.testing.assert_allclose(out[i:i + 1, :, :n], reference, rtol=tolerance, atol=tolerance,
                                       err_msg=f"row {i}")


def prefill_batch(rows, data, q, prefixes, lengths, chunk):
    """``rows`` (caches holding ``prefixes[b]`` tokens of ``data[b]``) prefilled as one batch with the next
    ``lengths[b]`` tokens each, right-padded to the longest, in chunks of ``chunk``: each chunk's outputs (every
    query row, padding rows too) and the rows."""
    batch = BatchKVQCache(rows)
    longest = max(lengths)
    batch.prepare(lengths=list(lengths), right_padding=[longest - n for n in lengths])

    def tokens(x, b, s, e):  # row b's tokens s..e after its prefix, zeros past its data
        p = prefixes[b]
        piece = x[b:b + 1, :, p + s:p + e]
        return mx.pad(piece, [(0, 0), (0, 0), (0, e - s - piece.shape[2]), (0, 0)])

    outs = []
    for s in range(0, longest, chunk):
        e = min(longest, s + chunk)
        k, v = (mx.concatenate([tokens(x, b, s, e) for b in range(len(rows))]) for x in data)
        batch.update_and_fetch(k, v)
        outs.append(np.array(batch.attend(mx.concatenate([tokens(q, b, s, e) for b in range(len(rows))]), SCALE)
                             .astype(mx.float32)))
    batch.finalize()
    return outs, batch.rows


@pytest.mark.parametrize("mask_bytes", [1 << 30, 1], ids=["one-call", "sliced"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_rows_of_other_offsets_and_lengths_stacked_in_groups_see_what_they_see_alone(on_device, monkeypatch, dtype,
                                                                                    mask_bytes):
    """Rows that hold other numbers of tokens before the batch's chunk (prompt-cache prefixes: one row's sinks seen
    causally, another's whole) and prompts of other lengths, in chunks of 16: the rows stack in groups that are not
    ranges of the batch (a short row between them; ``MIN_FILL``), and with ``PREFILL_MASK_BYTES`` at 1 each call's
    ``[B, 1, rows, keys]`` mask is cut into slices of 16 rows; every query row's output (right padding's too) and
    everything each row holds equal those of the same batch attending row by row."""
    monkeypatch.setattr(prefill, "PREFILL_MASK_BYTES", mask_bytes)
    config = make_config("turboquant", bits=3, sinks=2, window=4, flush=2, kernels="off").for_layer(1)
    kinds, prefixes, lengths = ("plain", "offsets", "plain", "scaled"), (2, 0, 17, 30), (40, 8, 33, 36)
    total = max(prefixes) + max(lengths)
    data = [mx.concatenate(side) for side in zip(*(row_keys(k, s, total, dtype) for s, k in enumerate(kinds)))]
    q = mx.random.normal((len(kinds), 2 * H, total, D), key=mx.random.key(9)).astype(dtype)
    runs, groups = {}, []
    for together in (True, False):
        rows = []
        for b, p in enumerate(prefixes):
            rows.append(KVQCache(config))
            if p:
                rows[-1].update_and_fetch(data[0][b:b + 1, :, :p], data[1][b:b + 1, :, :p])
                rows[-1].attend(q[b:b + 1, :, :p], SCALE)
        if not together:
            monkeypatch.setattr(engine, "attend_rows", lambda *args: [])
        else:
            real = stacked.groups
            monkeypatch.setattr(stacked, "groups", lambda *args: groups.append(real(*args)) or groups[-1])
        runs[together] = prefill_batch(rows, data, q, prefixes, lengths, 16)
    stacked_groups = [g for chunk in groups for g in chunk]
    assert any(g != list(range(g[0], g[-1] + 1)) for g in stacked_groups)  # groups that are not ranges (a row apart)
    (outs, rows), (their_outs, their_rows) = runs[True], runs[False]
    for c, (ours, theirs) in enumerate(zip(outs, their_outs)):
        np.testing.assert_array_equal(ours, theirs, err_msg=f"chunk {c}")
    for ours, theirs in zip(rows, their_rows):
        assert_held_alike(held(ours), held(theirs))


def test_rotating_rows_attend_alone(on_device):
    """Rotating rows keep their own path (their parts are a ring's): no call for the batch."""
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    data = [row_keys("plain", seed) for seed in range(2)]
    batch = BatchKVQCache([RotatingKVQCache(config, max_size=40, keep=2) for _ in data])
    batch.update_and_fetch(mx.concatenate([k for k, _ in data]), mx.concatenate([v for _, v in data]))
    batch.attend(mx.random.normal((2, 2 * H, T, D)).astype(mx.float16), SCALE)
    assert on_device["together"] == 0


def test_stacked_rows_make_one_call_with_the_chunks_mask_and_groups_bound_their_copy(on_device, monkeypatch):
    """Four rows stacked: one fused attention call for the batch where each row alone makes one (the additive mask
    is one ``[rows, keys]`` array broadcast over the batch, so the batch does not cut the call into slices); with
    :data:`kvq.cache.stacked.STACKED_ROWS_BYTES` below two rows' decoded copy, no rows stack and each attends
    alone, one call each. The outputs are each row's alone either way."""
    monkeypatch.setattr(prefill, "PREFILL_MASK_BYTES", T * 96 * 2)  # one call for one row of up to 96 keys
    calls = []
    sdpa = mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append(q.shape[0]) or sdpa(q, k, v, **kw))
    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(1)
    data = [row_keys("plain", seed) for seed in range(4)]
    q = mx.random.normal((4, 2 * H, T, D), key=mx.random.key(9)).astype(mx.float16)
    expected = [alone([config], [d], q[i:i + 1], [T])[0][1][0] for i, d in enumerate(data)]
    for budget, groups in ((1 << 30, [4]), (1, [1, 1, 1, 1])):
        monkeypatch.setattr(stacked, "STACKED_ROWS_BYTES", budget)
        calls.clear()
        on_device.update(queued=0)
        batch = BatchKVQCache([KVQCache(config) for _ in data])
        batch.update_and_fetch(mx.concatenate([k for k, _ in data]), mx.concatenate([v for _, v in data]))
        out = np.array(batch.attend(q, SCALE))
        assert calls == groups and on_device["queued"] == len(groups)
        for i, theirs in enumerate(expected):
            np.testing.assert_array_equal(out[i:i + 1], theirs)


def test_batch_generator_prompts_attended_together_give_the_tokens_of_rows_attended_alone(on_device, monkeypatch):
    """mlx-lm's ``BatchGenerator`` (the server's path) over three prompts of 40 tokens and one of 27, in chunks of 16,
    windows that flush during the prompt: the equal-length prompts' chunks are attended together, and every prompt's
    greedy tokens are those of the same run with every row attending alone."""
    from kvq.cache import patch_model, unpatch_model

    from conftest import batch_greedy, tiny_llama

    model = tiny_llama(hidden=128, heads=4, kv_heads=2)
    prompts = [[(7 * i + 3 * p) % 256 for i in range(n)] for p, n in enumerate((40, 40, 27, 40))]
    runs = {}
    for together in (True, False):
        if not together:
            monkeypatch.setattr(engine, "attend_rows", lambda *args: [])
        on_device.update(together=0)
        patch_model(model, "turboquant", bits=4, window=4, flush=4, sinks=2)
        try:
            runs[together] = batch_greedy(model, prompts, 6)
        finally:
            unpatch_model(model)
        if together:
            assert on_device["together"] > 0
    assert runs[True] == runs[False]
