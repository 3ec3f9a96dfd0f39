"""What mlx-lm's BatchGenerator does to a batch cache, in any order: a packed batch stays its rows.

tests/test_packed_rows.py checks packed rows (:mod:`kvq.cache.packed`) on fixed sequences of operations; here
hypothesis drives one batch that packs and one that never does (``BatchKVQCache.pack = False``: every row on its
own) through random sequences of what the server's generator does as requests come and go: decode steps, ``filter``
(sequences finishing), ``extract`` (a finished sequence's cache kept for the prompt cache), ``extend`` (new
sequences joining, some shorter than the sinks, some that have compressed nothing yet) and ``copy.deepcopy``.
After every operation the two batches hold the same rows: the same offsets, the same window tokens and
bit-identical compressed codes; every decode step attends the same (within 2e-5 absolute + 1e-4 relative, the
bound of tests/test_packed_rows.py: a packed row sums its parts in another order).
"""

from __future__ import annotations

import copy

import attrs
import mlx.core as mx
from conftest import cache_state, same_state
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvq.cache import BatchKVQCache, KVQCache, make_config

H_KV, N_REP, D = 2, 2, 64


def _config(method: str):
    bits = {"affine": {"bits": 4}, "turboquant": {"bits": 3}}[method]
    return attrs.evolve(make_config(method, sinks=2, window=4, **bits), flush=4, step=16)


def _row(config, length: int, seed: int) -> KVQCache:
    """One sequence's cache after a prefill of ``length`` random tokens."""
    row = KVQCache(config)
    k = mx.random.normal((1, H_KV, length, D), key=mx.random.key(seed))
    v = mx.random.normal((1, H_KV, length, D), key=mx.random.key(seed + 1))
    row.update_and_fetch(k, v)
    row.release_chunk()
    return row


def _size(batch: BatchKVQCache) -> int:
    return batch.offset.size  # not len(batch.rows): reading rows unpacks a packed batch


def _rows_of(batch: BatchKVQCache) -> list:
    """The batch's rows, read without unpacking it (``extract`` copies a packed row out)."""
    return [batch.extract(i) for i in range(_size(batch))] if batch.packed else batch.rows


def _same_rows(a: BatchKVQCache, b: BatchKVQCache) -> None:
    assert a.offset.tolist() == b.offset.tolist()
    for row_a, row_b in zip(_rows_of(a), _rows_of(b), strict=True):
        assert same_state(cache_state(row_a), cache_state(row_b))


class BatchOperations(RuleBasedStateMachine):
    """A packed and an unpacked batch of the same rows, driven alike."""

    @initialize(method=st.sampled_from(["affine", "turboquant"]),
                lengths=st.lists(st.integers(1, 30), min_size=2, max_size=5))
    def start(self, method, lengths):
        self.config, self.seed = _config(method), 1000
        self.packed = BatchKVQCache([_row(self.config, n, self._next()) for n in lengths])
        self.plain = BatchKVQCache([_row(self.config, n, self.seed - 2 * len(lengths) + 2 * i)
                                    for i, n in enumerate(lengths)])
        self.plain.pack = False

    def _next(self) -> int:
        self.seed += 2
        return self.seed - 2

    @rule(steps=st.integers(1, 8))
    def decode(self, steps):
        B = _size(self.packed)
        for _ in range(steps):
            key = mx.random.key(self._next())
            k, v, q = (mx.random.normal(shape, key=mx.random.split(key, 3)[i])
                       for i, shape in enumerate([(B, H_KV, 1, D), (B, H_KV, 1, D), (B, H_KV * N_REP, 1, D)]))
            outs = []
            for batch in (self.packed, self.plain):
                batch.update_and_fetch(k, v)
                outs.append(batch.attend(q, D ** -0.5))
            assert mx.allclose(outs[0], outs[1], atol=2e-5, rtol=1e-4).item()

    @precondition(lambda self: _size(self.packed) > 1)
    @rule(data=st.data())
    def filter(self, data):
        B = _size(self.packed)
        keep = sorted(data.draw(st.sets(st.integers(0, B - 1), min_size=1, max_size=B - 1)))
        for batch in (self.packed, self.plain):
            batch.filter(mx.array(keep))

    @rule(data=st.data())
    def extract(self, data):
        i = data.draw(st.integers(0, _size(self.packed) - 1))
        one, ref = self.packed.extract(i), self.plain.extract(i)
        _same_rows(BatchKVQCache([one]), BatchKVQCache([ref]))

    @precondition(lambda self: _size(self.packed) < 6)
    @rule(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=2))
    def extend(self, lengths):
        seeds = [self._next() for _ in lengths]
        self.packed.extend(BatchKVQCache([_row(self.config, n, s) for n, s in zip(lengths, seeds)]))
        self.plain.extend(BatchKVQCache([_row(self.config, n, s) for n, s in zip(lengths, seeds)]))

    @rule()
    def copy_and_go_on_with_the_copy(self):
        self.packed, self.plain = copy.deepcopy(self.packed), copy.deepcopy(self.plain)

    @invariant()
    def same_rows(self):
        if hasattr(self, "packed"):
            _same_rows(self.packed, self.plain)


BatchOperations.TestCase.settings = settings(max_examples=60, stateful_step_count=15, deadline=None,
                                             derandomize=True)
test_batch_operations_keep_packed_rows_equal_to_unpacked = BatchOperations.TestCase
