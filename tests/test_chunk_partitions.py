"""Any split of a token stream into chunks leaves the cache, and gives each query, what one token at a time does.

tests/test_prefill_chunks.py checks chunks of one size at a time through a model; here hypothesis draws mixed
partitions (chunks of 1 next to chunks that cross several window flushes, a chunk ending exactly where a flush
starts, ...) over a fixed stream of random keys, values and queries, straight into one layer's cache, with small
sinks, window and flush so that every few tokens cross a boundary. For every partition:

- the stores equal the token-by-token run's: the same count compressed and held in the window, and the compressed
  codes bit-identical (the same tokens were quantized in the same blocks);
- each chunk's queries (one per new token, as a model asks them) get the token-by-token run's attention rows,
  within float rounding: max error relative to the output's largest element below 2e-4 on the CPU's path
  (measured 0 for affine and turboquant, 8.9e-5 for qjl, whose keys are scored in another grouping) and 2e-3 on
  the GPU's (measured 3.5e-4 to 7.1e-4: the fused call's float16 output, one ulp is 4.9e-4). On a GPU the
  token-by-token reference itself decodes through the fused kernel, so the CPU's path is held to 2e-3 there too
  (measured 3.5e-4 on the H200 for all three methods). One query shown one
  token more or less in the compressed part (``KVQCache._visible`` off by one) errs by 1.2e-2 to 4.6e-2.

Both chunk paths run: the CPU's (each part attended over the codes) and the GPU's (the compressed tokens decoded to
a transient 16-bit copy, one fused attention call with a per-row mask: ``kvq.cache.prefill``), forced on the CPU.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvq.cache import KVQCache, make_config

TOKENS, H_KV, N_REP, D = 72, 2, 2, 64
#: (method options, sinks, window, flush): a per-token method, a rotated 3-bit one with a flush block, and QJL
#: keys, whose 32-token outlier groups make the window give up whole groups (CacheConfig.flush_tokens)
CONFIGS = {
    "affine:4": (dict(method="affine", bits=4), 2, 8, 4),
    "turboquant:3": (dict(method="turboquant", bits=3), 3, 6, 5),
    "qjl+affine:4": (dict(key_method="qjl", value_method="affine", value_params={"bits": 4}), 2, 8, 1),
}


def _config(label: str):
    options, sinks, window, flush = CONFIGS[label]
    return make_config(**options, sinks=sinks, window=window, flush=flush)


def _stream():
    keys = mx.random.normal((1, H_KV, TOKENS, D), key=mx.random.key(11)).astype(mx.float16)
    values = mx.random.normal((1, H_KV, TOKENS, D), key=mx.random.key(12)).astype(mx.float16)
    queries = mx.random.normal((1, H_KV * N_REP, TOKENS, D), key=mx.random.key(13)).astype(mx.float16)
    return keys, values, queries


def _run(label: str, sizes: list[int], on_device: bool):
    """The cache after the stream fed in chunks of ``sizes`` (each chunk's queries attended after its update),
    and every query's output row, float32 ``[H_q, TOKENS, D]``."""
    keys, values, queries = _stream()
    cache, rows, start = KVQCache(_config(label)), [], 0
    if on_device:  # the GPU's chunk path, where the cache holds compressed tokens (as on a GPU)
        cache._prefill_on_device = lambda q: cache._chunk_fused()  # the GPU's rule (conftest.gpu_chunk_rule)
    for n in sizes:
        cache.update_and_fetch(keys[:, :, start:start + n], values[:, :, start:start + n])
        rows.append(cache.attend(queries[:, :, start:start + n], D ** -0.5).astype(mx.float32))
        start += n
    out = mx.concatenate(rows, axis=2)[0]
    mx.eval(out)
    return cache, np.array(out)


@lru_cache(maxsize=None)
def _reference(label: str):
    return _run(label, [1] * TOKENS, on_device=False)


def _partitions():
    """Chunk sizes summing to TOKENS: a few sizes drawn, the rest of the stream in one chunk."""
    def close(sizes):
        used = sum(sizes)
        return sizes + ([TOKENS - used] if used < TOKENS else [])

    return st.lists(st.integers(1, 40), min_size=1, max_size=8).map(
        lambda sizes: close([s for i, s in enumerate(sizes) if sum(sizes[: i + 1]) <= TOKENS]))


@pytest.mark.parametrize("on_device", [False, True], ids=["cpu-path", "device-path"])
@pytest.mark.parametrize("label", list(CONFIGS))
@settings(max_examples=30, deadline=None, derandomize=True)
@given(sizes=_partitions())
def test_any_partition_stores_and_attends_as_one_token_at_a_time(label, on_device, sizes):
    assert sum(sizes) == TOKENS and min(sizes) >= 1
    ref_cache, ref_rows = _reference(label)
    cache, rows = _run(label, sizes, on_device)
    assert (cache.offset, cache.compressed_keys.length, cache.window.length) == \
        (ref_cache.offset, ref_cache.compressed_keys.length, ref_cache.window.length), sizes
    for store, ref_store in ((cache.compressed_keys, ref_cache.compressed_keys),
                             (cache.compressed_values, ref_cache.compressed_values)):
        for name, array in ref_store.view().data.items():
            assert mx.array_equal(array, store.view().data[name]).item(), (sizes, name)
    error = np.max(np.abs(rows - ref_rows)) / np.max(np.abs(ref_rows))
    # on a GPU the token-by-token reference decodes through the fused kernel, whatever path the chunks take
    fused = on_device or mx.default_device() == mx.gpu
    assert error < (2e-3 if fused else 2e-4), f"chunks {sizes}: relative max error {error:.2e}"
