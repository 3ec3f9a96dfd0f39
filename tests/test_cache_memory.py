"""Memory is a feature, so it is measured (mx.get_active_memory / mx.get_peak_memory), not inferred."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from conftest import tiny_llama
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache

from kvq.cache import KVQCache, make_config, make_prompt_cache


def _settle() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


@pytest.mark.parametrize("method, params", [("affine", {"bits": 4}), ("affine", {"bits": 2, "group_size": 32})])
def test_resident_growth_matches_nbytes_and_accounting(method, params):
    B, H, T, D, chunk = 1, 8, 8192, 128, 512
    config = make_config(method, sinks=4, window=128, **params)
    cache = KVQCache(config)
    query = mx.random.normal((B, H, 1, D)).astype(mx.float16)
    before = _settle()
    for start in range(0, T, chunk):
        k = mx.random.normal((B, H, chunk, D)).astype(mx.float16)
        v = mx.random.normal((B, H, chunk, D)).astype(mx.float16)
        cache.update_and_fetch(k, v)
        # as in a model's forward, attention follows the update: it drops what the update kept for the
        # chunk's queries (the uncompressed copies of tokens compressed by this update)
        mx.eval(cache.state, cache.attend(query, D ** -0.5))
        del k, v
    growth = _settle() - before
    assert growth == pytest.approx(cache.nbytes, rel=0.10)
    flush = config.flush_tokens  # the window holds 128 to 128 + flush - 1 tokens, in a buffer of the most
    held = cache.window.length
    assert 128 <= held < 128 + flush and cache.compressed_keys.length == T - 4 - held
    # allocated in steps of 256 tokens after the held ones, a growth leaving room for the next flush
    compressed = cache.compressed_keys.capacity
    assert compressed - 256 - flush < T - 4 - held <= compressed
    expected = (2 * config.key_params.accounting(D).bytes_for(B, H, compressed)
                + 2 * (4 + 128 + flush - 1) * B * H * D * 2)
    assert cache.nbytes == pytest.approx(expected, rel=0.02)
    assert cache.nbytes < 0.35 * 2 * B * H * T * D * 2  # versus fp16 keys and values


def _prefill_peak(model, cache, prompt) -> float:
    mx.eval(prompt)
    _settle()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in generate_step(prompt, model, max_tokens=1, prompt_cache=cache, prefill_step_size=2048):
        pass
    return mx.get_peak_memory() - base


def _three_peaks(model, vocab, method, params, tokens: int = 8192):
    """Peak bytes of a prefill of ``tokens`` with mlx-lm's KVCache, its QuantizedKVCache (4-bit), and kvq."""
    prompt = mx.random.randint(0, vocab, (tokens,))
    kvcache = mlx_cache.make_prompt_cache(model)
    fp = _prefill_peak(model, kvcache, prompt)
    assert sum(c.nbytes for c in kvcache) >= 100e6
    del kvcache
    try:
        quantized = _prefill_peak(model, [mlx_cache.QuantizedKVCache(64, 4) for _ in model.layers], prompt)
    except RuntimeError as exc:  # MLX 0.32's CUDA quantized_matmul lacks these shapes: mlx-lm's cache cannot run
        assert "No implementation for problem shape" in str(exc)
        quantized = None
    ours = _prefill_peak(model, make_prompt_cache(model, method, **params), prompt)
    shown = "cannot run here" if quantized is None else f"{quantized / 2**20:.1f}"
    print(f"peak MB: kvq {method} {ours / 2**20:.1f}, mlx-lm q4 {shown}, KVCache {fp / 2**20:.1f}")
    return fp, quantized, ours


@pytest.mark.slow
def test_prefill_peak_below_mlx_lm_caches():
    """4K-token prefill in chunks of 2048 through a random llama whose uncompressed KV cache is 101 MB.

    The model runs in float32 on the CPU (MLX's CPU float16 matmul is too slow for CI), so mlx-lm's KVCache holds
    float32 here; its QuantizedKVCache and kvq hold 4-bit codes. mlx-lm materialises [H, 2048, T] attention scores
    per chunk; kvq walks the keys in blocks with an online softmax, so its peak stays near the model's own.
    Measured on 2 CPU cores (2026-12-06): kvq 158 MB, mlx-lm's QuantizedKVCache 388 MB, KVCache 497 MB (8K tokens,
    as until then, took 145 s of CI's 15 minutes; 4K takes 43 s).
    """
    model = tiny_llama(hidden=256, layers=3, heads=8, kv_heads=8, vocab=256, dtype=mx.float32, head_dim=128)
    fp, quantized, ours = _three_peaks(model, 256, "affine", {"bits": 4}, tokens=4096)
    assert ours < 0.6 * quantized and ours < 0.5 * fp


@pytest.mark.gpu
@pytest.mark.parametrize("method, params", [("affine", {"bits": 4}), ("turboquant", {"bits": 4})])
def test_prefill_peak_below_mlx_lm_caches_fp16_on_gpu(method, params):
    """The same comparison with a float16 model (a real fp16 KV cache of 268 MB) over 8K tokens on a GPU."""
    model = tiny_llama(hidden=1024, layers=4, heads=8, kv_heads=8, vocab=512, dtype=mx.float16, head_dim=128)
    fp, quantized, ours = _three_peaks(model, 512, method, params)
    assert ours < fp and (quantized is None or ours < quantized)
