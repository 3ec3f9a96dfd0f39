"""A batch's rows' chunk stacked into one call (:mod:`kvq.cache.stacked`, issue #51): which rows stack and in what
groups, per-batch-row intervals in the GPU chunk path's mask (:func:`kvq.cache.prefill.interval_mask`), and a batch
of prompts of different lengths attended together through mlx-lm's ``BatchGenerator``."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvq
from kvq.cache import KVQCache, make_config, prefill, stacked
from kvq.cache.parts import Part

H, D = 2, 64


def codes(tokens: int, bits: int = 4):
    """Keys and values of ``tokens`` random tokens quantized with turboquant (``[1, H, tokens, D]`` codes)."""
    x = mx.random.normal((1, H, tokens, D), key=mx.random.key(tokens))
    plan = kvq.select("turboquant", x.shape, params=kvq.make_params("turboquant", bits=bits))
    return plan.quantize(x, plan.params), plan.quantize(-x, plan.params)


def dense(tokens: int, dtype=mx.float16):
    return (mx.random.normal((1, H, tokens, D)).astype(dtype),) * 2


def row(sinks: int, compressed: int, window: int, bits: int = 4, dtype=mx.float16) -> list:
    """A row's parts ``[sinks | compressed | dense]`` of those sizes (every column visible)."""
    parts = [Part(*dense(sinks, dtype), False)] if sinks else []
    return parts + [Part(*codes(compressed, bits), True), Part(*dense(window, dtype), False)]


def test_rows_stack_only_with_parts_of_one_structure():
    """A row stacks with rows whose parts have its structure (sinks or not, the codes' parameters, the dense
    dtype; rows of no codes, short prompts, with each other), never with a ring's parts (columns not contiguous from
    0); rows in no group of two or more are left to attend alone."""
    rows = [row(4, 40, 20), row(4, 36, 24), row(0, 40, 20), row(4, 40, 20, bits=3), row(4, 40, 20, dtype=mx.bfloat16),
            [Part(*dense(4), False), Part(*dense(20), False)], None, row(4, 40, 20),
            [Part(*dense(4), False), Part(*dense(14), False)]]
    ring = row(4, 40, 20)
    ring[-1] = Part(*dense(20), False, np.arange(20)[::-1].copy())
    rows.append(ring)
    assert stacked.signature(ring) is None and stacked.signature(rows[0] + rows[0][1:2]) is None  # two with codes
    assert stacked.signature(rows[0]) == stacked.signature(rows[1]) != stacked.signature(rows[3])
    assert stacked.signature(rows[5]) == stacked.signature(rows[8]) != stacked.signature(rows[0])
    assert stacked.groups(rows, mx.float16) == [[0, 1, 7], [5, 8]]


def test_groups_bound_the_padding_and_the_decoded_copy(monkeypatch):
    """From the row of most columns down, a row joins the open group while it holds at least MIN_FILL of the
    group's first row's columns and the group's padded decoded copy stays within STACKED_ROWS_BYTES; groups come out
    with ascending indices, groups of one are left out."""
    sizes = [(4, 100, 30), (4, 20, 10), (4, 60, 30), (4, 90, 30), (4, 40, 10), (4, 8, 4)]
    rows = [row(*s) for s in sizes]  # columns: 134, 34, 94, 124, 54, 16
    assert stacked.groups(rows, mx.float16) == [[0, 2, 3], [1, 4]]
    per_row = stacked.decoded_bytes([rows[0]], mx.float16)
    assert per_row == 134 * H * 2 * D * 2
    assert stacked.decoded_bytes([rows[0], rows[1]], mx.float16) == 2 * per_row  # padded to the longest per part
    monkeypatch.setattr(stacked, "STACKED_ROWS_BYTES", 2 * per_row)
    # a third row would not fit: 2 opens a group that 4 joins, then 1 and 5 are too short for it and for each other
    assert stacked.groups(rows, mx.float16) == [[0, 3], [2, 4]]
    monkeypatch.setattr(stacked, "MIN_FILL", 0.0)
    monkeypatch.setattr(stacked, "STACKED_ROWS_BYTES", 1 << 30)
    assert stacked.groups(rows, mx.float16) == [[0, 1, 2, 3, 4, 5]]


def test_stacked_parts_pad_each_row_and_keep_its_own_intervals():
    """Stacking rows of other sizes pads every part to its widest row's with the row's last column repeated (codes
    and dense tokens alike), and gives each batch row its own intervals clipped to its own columns; the mask made
    from them is each row's own mask, padded with hidden columns, stacked along the batch."""
    from kvq.cache.centring import KeyTransform

    a, b = row(4, 40, 20), row(4, 36, 24)
    # the dense part's rows see causally (3 query rows at the window's last 3 positions)
    causal = lambda n: (np.zeros(3, np.int64), np.arange(n - 2, n + 1))  # noqa: E731
    a[-1] = Part(a[-1].keys, a[-1].values, False, 0, *causal(20))
    b[-1] = Part(b[-1].keys, b[-1].values, False, 0, *causal(24))
    queries = mx.zeros((2, 2 * H, 3, D), mx.float16)
    q, parts = stacked.stack(queries, [a, b], [KeyTransform(), KeyTransform()])
    assert [p.size for p in parts] == [4, 40, 24]
    codes_b = parts[1].keys.data
    for name, field in b[1].keys.data.items():  # row b's codes, then its last token's repeated
        np.testing.assert_array_equal(np.array(codes_b[name][1:, :, :36]), np.array(field))
        np.testing.assert_array_equal(np.array(codes_b[name][1:, :, 36:]),
                                      np.repeat(np.array(field[:, :, -1:]), 4, axis=2))
    np.testing.assert_array_equal(np.array(parts[2].keys[0, :, 20:]),
                                  np.repeat(np.array(a[-1].keys[0, :, -1:]), 4, axis=1))
    np.testing.assert_array_equal(parts[1].hi, [[40] * 3, [36] * 3])
    np.testing.assert_array_equal(parts[2].hi, [[18, 19, 20], [22, 23, 24]])
    mask = np.array(prefill.interval_mask(parts, 0, 3, 68, mx.float16))
    assert mask.shape == (2, 1, 3, 68)
    for b_row, (parts_alone, width) in enumerate(((a, 64), (b, 64))):
        alone = np.array(prefill.interval_mask(parts_alone, 0, 3, width, mx.float16))
        stacked_row = mask[b_row, 0]
        sink, comp, window = stacked_row[:, :4], stacked_row[:, 4:44], stacked_row[:, 44:]
        n_comp = parts_alone[1].size
        np.testing.assert_array_equal(np.concatenate([sink, comp[:, :n_comp], window[:, :parts_alone[2].size]], 1),
                                      alone)
        assert (comp[:, n_comp:] < 0).all() and (window[:, parts_alone[2].size:] < 0).all()  # padding: hidden
    assert prefill.last_column(parts, 0, 3) == 68
    with pytest.raises(ValueError, match="user_mask"):
        prefill.interval_mask(parts, 0, 3, 68, mx.float16, mx.ones((2, 3, 68), mx.bool_), mx.arange(68))


def test_batch_generator_prompts_of_different_lengths_attend_together_and_give_the_tokens_alone(monkeypatch):
    """mlx-lm's ``BatchGenerator`` over prompts of 40, 33, 27 and 38 tokens in chunks of 16 (right padding: every
    chunk's rows hold other numbers of tokens): chunks are attended together, and every prompt's greedy tokens are
    those of the same run with every row attending alone."""
    import kvq.cache.engine as engine
    from kvq.cache import patch_model, unpatch_model

    from conftest import batch_greedy, gpu_chunk_rule, tiny_llama

    monkeypatch.setattr(KVQCache, "_prefill_on_device", gpu_chunk_rule)
    stack = stacked.stack
    ragged = []  # per stacked call, whether its rows held other numbers of tokens (intervals per batch row)
    monkeypatch.setattr(stacked, "stack", lambda *args: ragged.append(stack(*args)) or ragged[-1])
    model = tiny_llama(hidden=128, heads=4, kv_heads=2)
    prompts = [[(7 * i + 3 * p) % 256 for i in range(n)] for p, n in enumerate((40, 33, 27, 38))]
    runs = {}
    for attend_together in (True, False):
        if not attend_together:
            ragged = [any(p.lo is not None and p.lo.ndim == 2 for p in parts) for _, parts in ragged]
            monkeypatch.setattr(engine, "attend_rows", lambda *args: [])
        patch_model(model, "turboquant", bits=4, window=4, flush=4, sinks=2)
        try:
            runs[attend_together] = batch_greedy(model, prompts, 6)
        finally:
            unpatch_model(model)
    assert any(ragged) and not all(ragged)  # rows of different lengths stacked (and the first chunk's equal ones)
    assert runs[True] == runs[False]
