"""One layer's cache through any sequence of what mlx-lm and its server do to it: chunks of any size, trims,
prompt-cache files, copies (a :class:`kvq.cache.KVQCache`, and a :class:`kvq.cache.RotatingKVQCache` whose ring
wraps). While every trim so far was exact (:meth:`kvq.cache.KVQCache.trims_exactly`), the
cache holds what a fresh cache fed the same remaining tokens holds (counts, window tokens and codes bit for bit),
whatever chunks, files and copies came between; a file round trip and a copy never change a cache, and a copy
shares nothing with its original.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from conftest import cache_state, same_state
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvq.cache import KVQCache, load_prompt_cache, make_config, save_prompt_cache

D, H_KV, N_REP, STREAM = 64, 2, 2, 160
CONFIGS = {
    "affine:4": dict(method="affine", bits=4, sinks=2, window=6, flush=4),
    "turboquant:3": dict(method="turboquant", bits=3, sinks=3, window=5, flush=3),
    "qjl+affine:4": dict(key_method="qjl", value_method="affine", value_params={"bits": 4}, sinks=2, window=8,
                         flush=1),
}
KEYS = mx.random.normal((1, H_KV, STREAM, D), key=mx.random.key(21)).astype(mx.float16)
VALUES = mx.random.normal((1, H_KV, STREAM, D), key=mx.random.key(22)).astype(mx.float16)


class CacheOperations(RuleBasedStateMachine):
    """``self.held``: the stream's tokens the cache holds (a prefix: trims drop the newest); ``self.exact``: every
    trim so far was exact, so the cache must equal a fresh one fed ``self.held`` tokens."""

    @initialize(label=st.sampled_from(list(CONFIGS)))
    def start(self, label):
        self.config = make_config(**CONFIGS[label])
        self.cache, self.held, self.exact = KVQCache(self.config), 0, True

    @rule(n=st.integers(1, 40))
    def update_and_attend(self, n):
        n = min(n, STREAM - self.held)
        if not n:
            return
        s = self.held
        self.cache.update_and_fetch(KEYS[:, :, s:s + n], VALUES[:, :, s:s + n])
        q = mx.random.normal((1, H_KV * N_REP, n, D), key=mx.random.key(s)).astype(mx.float16)
        out = self.cache.attend(q, D ** -0.5)
        assert out.shape == (1, H_KV * N_REP, n, D) and mx.all(mx.isfinite(out)).item()
        self.held += n

    @rule(n=st.integers(1, 50))
    def trim(self, n):
        exact = self.cache.trims_exactly(n)
        removed = self.cache.trim(n)
        assert removed == min(n, self.held)
        self.held -= removed
        self.exact = self.exact and exact
        if self.held == 0:
            self.exact = True  # an emptied cache starts over

    @rule()
    def file_round_trip(self):
        import tempfile

        before = cache_state(self.cache)
        with tempfile.TemporaryDirectory() as folder:
            path = f"{folder}/layer.safetensors"
            save_prompt_cache(path, [self.cache])
            (self.cache,) = load_prompt_cache(path)
        assert same_state(cache_state(self.cache), before)

    @rule()
    def copy_and_go_on_with_the_copy(self):
        original, before = self.cache, cache_state(self.cache)
        self.cache = copy.deepcopy(original)
        n = min(5, STREAM - self.held)
        if n:  # the copy takes tokens; the original must not see them
            self.cache.update_and_fetch(KEYS[:, :, self.held:self.held + n], VALUES[:, :, self.held:self.held + n])
            self.held += n
        assert same_state(cache_state(original), before)

    @invariant()
    def as_a_fresh_cache_while_every_trim_was_exact(self):
        if not hasattr(self, "cache"):
            return
        assert self.cache.offset == self.held
        assert self.cache.sinks.length + self.cache.compressed_keys.length + self.cache.window.length == self.held
        if self.exact and self.held:
            fresh = KVQCache(self.config)
            fresh.update_and_fetch(KEYS[:, :, : self.held], VALUES[:, :, : self.held])
            assert same_state(cache_state(self.cache), cache_state(fresh))


CacheOperations.TestCase.settings = settings(max_examples=60, stateful_step_count=12, deadline=None,
                                             derandomize=True)
test_cache_operations_in_any_order = pytest.mark.filterwarnings("ignore")(CacheOperations.TestCase)


def test_a_loaded_cache_updated_then_copied(tmp_path):
    """The sequence the state machine found: a cache loaded from a file, updated, then deep-copied (mlx-lm's server
    copies every cache it reuses) raised ``cannot pickle 'Dtype' object`` (the file's dtype and the update's were
    two objects, and the copy passed only one through)."""
    cache = KVQCache(make_config(**CONFIGS["affine:4"]))
    cache.update_and_fetch(KEYS[:, :, :20], VALUES[:, :, :20])
    save_prompt_cache(str(tmp_path / "c.safetensors"), [cache])
    (loaded,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    loaded.update_and_fetch(KEYS[:, :, 20:21], VALUES[:, :, 20:21])
    twin = copy.deepcopy(loaded)
    assert same_state(cache_state(twin), cache_state(loaded))


class RotatingOperations(CacheOperations):
    """The same operations on a :class:`kvq.cache.RotatingKVQCache` (a sliding-window layer, ``max_size`` 40):
    trims only while ``offset < max_size`` (as mlx-lm's); the ring wraps and drops tokens. While every trim was
    exact, the cache equals a fresh one fed the same tokens, the ring compared oldest first."""

    @initialize(label=st.sampled_from(["affine:4", "turboquant:3"]), keep=st.sampled_from([0, 2]))
    def start(self, label, keep):
        from kvq.cache import RotatingKVQCache

        options = {k: v for k, v in CONFIGS[label].items() if k != "sinks"}
        self.config, self.keep = make_config(**options), keep
        self.cache, self.held, self.exact = RotatingKVQCache(self.config, 40, keep), 0, True

    def _fresh(self):
        from kvq.cache import RotatingKVQCache

        return RotatingKVQCache(self.config, 40, self.keep)

    @rule(n=st.integers(1, 50))
    def trim(self, n):
        if not self.cache.is_trimmable():
            assert self.cache.trim(n) == 0
            return
        super().trim(n)

    @invariant()
    def as_a_fresh_cache_while_every_trim_was_exact(self):
        if not hasattr(self, "cache"):
            return
        assert self.cache.offset == self.held
        if self.exact and self.held:
            fresh = self._fresh()
            fresh.update_and_fetch(KEYS[:, :, : self.held], VALUES[:, :, : self.held])
            fresh.release_chunk()
            assert same_state(cache_state(self.cache, ring=True), cache_state(fresh, ring=True))


RotatingOperations.TestCase.settings = settings(max_examples=60, stateful_step_count=12, deadline=None,
                                                derandomize=True)
test_rotating_cache_operations_in_any_order = pytest.mark.filterwarnings("ignore")(RotatingOperations.TestCase)
