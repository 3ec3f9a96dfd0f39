"""The hot path stays short (issue #49): from mlx-lm's attention call (kvq's patched
``scaled_dot_product_attention``) a decode step reaches its kernel within 4 Python frames, a batch's packed decode
step too, and a prefill chunk on a GPU reaches MLX's fused attention within 6.

Kernels are recording stubs: an implementation's bound step (what kvq_metal's ``DecodeStep`` is) calls a recorder
where the real step launches its kernel; ``mx.fast.scaled_dot_product_attention`` is wrapped by a recorder that
calls it. Each recorder counts the Python frames from the patched attention's frame (1) to the frame that called it.
"""

import inspect

import mlx.core as mx
import pytest

from kvq.attention import dense_attend, merge_parts
from kvq.cache import BatchKVQCache, KVQCache, make_config
from kvq.cache import patch as kvq_patch
from kvq.plugins import registry

from conftest import gpu_chunk_rule

DECODE_FRAMES = 4
PREFILL_FRAMES = 6


def frames_from_attention() -> int:
    """Frames from kvq's patched attention (1) to the caller of the function that calls this (the kernel's caller)."""
    frame, depth = inspect.currentframe().f_back.f_back, 0
    while frame is not None:
        depth += 1
        if frame.f_code is kvq_patch.scaled_dot_product_attention.__code__:
            return depth
        frame = frame.f_back
    raise AssertionError("not called from kvq's patched scaled_dot_product_attention")


class _Recorder:
    def __init__(self):
        self.depths = []

    def kernel(self, out):
        self.depths.append(frames_from_attention())
        return out


def _bound(impl, recorder: _Recorder):
    """A ``bind_dense`` (or ``bind_ragged_dense``: its ``lengths`` are ignored, only the path is measured) whose step
    computes the parts in pure MLX and hands the result to the recording "kernel", as a kernel implementation's step
    launches its kernel."""

    def bind(queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values):
        def step(q, wk, wv, lengths=None):
            parts = [impl.kvq_attend(q, keys, values, scale, None), dense_attend(q, sink_keys, sink_values, scale),
                     dense_attend(q, wk, wv, scale)]
            return recorder.kernel(merge_parts(parts)[0].astype(q.dtype))

        return step

    return bind


def _data(B, T, seed=0):
    k = mx.random.normal((B, 2, T, 64), key=mx.random.key(seed)).astype(mx.float16)
    v = mx.random.normal((B, 2, T, 64), key=mx.random.key(seed + 1)).astype(mx.float16)
    return k, v


def test_decode_reaches_its_kernel_within_four_frames(monkeypatch):
    impl = registry().implementations[("affine", "mlx")]
    recorder = _Recorder()
    monkeypatch.setattr(impl, "bind_dense", _bound(impl, recorder), raising=False)
    # kernels off: the pure-MLX implementation (whose bind_dense is the stub) serves on a GPU too
    cache = KVQCache(make_config("affine", bits=4, sinks=4, window=16, flush=4, kernels="off"))
    k, v = _data(1, 60)
    cache.update_and_fetch(k, v)
    cache.release_chunk()
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(9)).astype(mx.float16)
    for step in range(3):
        keys, values = cache.update_and_fetch(*_data(1, 1, seed=20 + step))
        kvq_patch.scaled_dot_product_attention(q, keys, values, cache=cache, scale=0.125, mask=None)
    assert recorder.depths == [DECODE_FRAMES] * 3  # patched attention > KVQCache.attend > _fused_attend > step


def test_packed_batch_decode_reaches_its_kernel_within_four_frames(monkeypatch):
    impl = registry().implementations[("affine", "mlx")]
    recorder = _Recorder()
    monkeypatch.setattr(impl, "bind_ragged_dense", _bound(impl, recorder), raising=False)
    config = make_config("affine", bits=4, sinks=2, window=4, flush=4, kernels="off")
    rows = []
    for i, n in enumerate((30, 41)):
        row = KVQCache(config)
        row.update_and_fetch(*_data(1, n, seed=3 * i))
        row.release_chunk()
        rows.append(row)
    batch = BatchKVQCache(rows)
    q = mx.random.normal((2, 4, 1, 64), key=mx.random.key(9)).astype(mx.float16)
    for step in range(2):
        keys, values = batch.update_and_fetch(*_data(2, 1, seed=40 + step))
        kvq_patch.scaled_dot_product_attention(q, keys, values, cache=batch, scale=0.125, mask=None)
    assert batch.packed
    assert recorder.depths == [DECODE_FRAMES] * 2  # patched attention > Batch.attend > PackedRows.attend > step


@pytest.mark.parametrize("method", ["affine", "turboquant"])
def test_prefill_chunk_reaches_fused_attention_within_six_frames(monkeypatch, method):
    depths = []
    original = mx.fast.scaled_dot_product_attention

    def recording_attention(*args, **kwargs):
        depths.append(frames_from_attention())
        return original(*args, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recording_attention)
    monkeypatch.setattr(KVQCache, "_prefill_on_device", gpu_chunk_rule)
    cache = KVQCache(make_config(method, bits=4, sinks=4, window=16, flush=8))
    k, v = _data(1, 96)
    for start in range(0, 96, 32):
        keys, values = cache.update_and_fetch(k[:, :, start : start + 32], v[:, :, start : start + 32])
        q = mx.random.normal((1, 4, 32, 64), key=mx.random.key(start)).astype(mx.float16)
        mx.eval(kvq_patch.scaled_dot_product_attention(q, keys, values, cache=cache, scale=0.125, mask="causal"))
    # patched attention > KVQCache.attend > engine.attend > prefill.attend_dequantized (4), for each of the three
    # chunks (every one holds compressed tokens: the first compresses its own oldest)
    assert len(depths) == 3 and max(depths) <= PREFILL_FRAMES, depths
