"""kvq's compressed rotating cache (issue #25): sliding-window layers and max_kv_size get RotatingKVQCache, which
shows every query the tokens mlx-lm's RotatingKVCache shows it in token-by-token decode (the first ``keep`` and the
newest ``max_size - keep``), in a prefill chunk of any size too, and holds memory bounded by the window."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import scaled_dot_product_attention
from test_architectures import tiny

import kvq
from kvq.cache import BatchKVQCache, RotatingKVQCache, make_config, patch_model, unpatch_model

SLIDING_MODELS = ["gemma3_text", "gpt_oss", "llama"]  # sliding window 16 in CONFIGS
PROMPT = [(7 * i + 3) % 128 for i in range(50)]


@pytest.fixture(scope="module", params=SLIDING_MODELS)
def sliding_model(request):
    return tiny(request.param)


def logits(model, caches, chunks=(20, 30), steps=20, forced=None, tokens=False):
    """Last-position logits ``[chunks + steps, vocab]`` after each prefill chunk of ``PROMPT`` and each of ``steps``
    decode steps (54 tokens past a 16-token window): greedy, or the ``forced`` tokens. With ``tokens``, also the
    tokens fed."""
    prompt, outs, start, fed = mx.array([PROMPT]), [], 0, []
    for n in chunks:
        outs.append(model(prompt[:, start : start + n], cache=caches)[0, -1])
        start += n
    for i in range(steps):
        fed.append(int(mx.argmax(outs[-1])) if forced is None else forced[i])
        outs.append(model(mx.array([[fed[-1]]]), cache=caches)[0, -1])
    out = np.array(mx.stack(outs))
    return (out, fed) if tokens else out


# -- what each query sees ----------------------------------------------------------------------------------
def mlx_lm_token_by_token(q, k, v, max_size, keep, scale=0.25):
    """Attention outputs ``[1, H_q, T, D]`` of mlx-lm's RotatingKVCache fed one token at a time (its decode)."""
    cache, outs = mlx_cache.RotatingKVCache(max_size, keep), []
    for t in range(k.shape[2]):
        keys, values = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append(scaled_dot_product_attention(q[:, :, t : t + 1], keys, values, cache=cache, scale=scale,
                                                 mask=None))
    return mx.concatenate(outs, axis=2)


@pytest.mark.parametrize("max_size, keep, window, flush", [
    (16, 0, 4, 1), (16, 4, 4, 1), (16, 4, 4, 3), (16, 2, 14, 1), (16, 2, 13, 4), (10, 3, 0, 1), (10, 3, 0, 5),
    (16, 0, 16, 1), (16, 0, 2, 7)])
@pytest.mark.parametrize("chunks", [[1] * 60, [60], [7, 13, 1, 1, 20, 18], [17, 1, 1, 1, 40]])
def test_each_query_sees_what_mlx_lm_decode_shows_it(max_size, keep, window, flush, chunks):
    """fp16 storage of float16 inputs is exact, so only the summation order differs from mlx-lm's (measured at most
    9e-4 over these cases, outputs of order 1): windows with and without keep, flush blocks, a window as large as
    max_size (nothing compressed), none (everything compressed), and chunks that straddle every boundary."""
    k, v, q = (mx.random.normal((1, h, 60, 16)).astype(mx.float16) for h in (2, 2, 4))
    cache = RotatingKVQCache(make_config("fp16", window=window, flush=flush, step=8), max_size, keep)
    outs, start = [], 0
    for n in chunks:
        cache.update_and_fetch(k[:, :, start : start + n], v[:, :, start : start + n])
        outs.append(cache.attend(q[:, :, start : start + n], 0.25))
        start += n
    ref = mlx_lm_token_by_token(q, k, v, max_size, keep)
    np.testing.assert_allclose(np.array(mx.concatenate(outs, axis=2).astype(mx.float32)),
                               np.array(ref.astype(mx.float32)), atol=2e-3)
    assert cache.size() == max_size and cache.offset == 60
    assert cache.compressed_keys.length <= max_size - keep - cache.config.window


@pytest.mark.parametrize("method, params", [("affine", {"bits": 4}), ("turboquant", {"bits": 4}),
                                            ("turboquant_prod", {"bits": 3})])
@pytest.mark.parametrize("max_size, keep, window, flush", [(16, 0, 4, 1), (16, 4, 4, 3), (20, 2, 0, 5)])
@pytest.mark.parametrize("chunks", [[1] * 60, [60], [7, 13, 1, 1, 20, 18]])
def test_compressed_tokens_are_those_a_kvq_cache_compresses(method, params, max_size, keep, window, flush, chunks):
    """The ring holds what KVQCache (sinks = keep) compresses, and each query sees its window of it: equal to a
    KVQCache fed token by token with the window given as a mask, up to float16 rounding of the outputs (at most
    4.9e-4 measured on the CPU; on the H200 one output of 15,360 for turboquant_prod, -2.2539 against -2.2559, one
    float16 ulp at that size; a token too many or too few in the window gives errors above 0.01)."""
    k, v, q = (mx.random.normal((1, h, 60, 64)).astype(mx.float16) for h in (2, 2, 4))
    reference, outs = kvq.KVQCache(make_config(method, sinks=keep, window=window, flush=flush, **params)), []
    for t in range(60):
        reference.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        j = np.arange(t + 1)
        window_mask = mx.array((j < keep) | (j > t - (max_size - keep)))[None]
        outs.append(reference.attend(q[:, :, t : t + 1], 0.125, mask=window_mask))
    cache = RotatingKVQCache(make_config(method, window=window, flush=flush, step=8, **params), max_size, keep)
    ours, start = [], 0
    for n in chunks:
        cache.update_and_fetch(k[:, :, start : start + n], v[:, :, start : start + n])
        ours.append(cache.attend(q[:, :, start : start + n], 0.125))
        start += n
    np.testing.assert_allclose(np.array(mx.concatenate(ours, axis=2).astype(mx.float32)),
                               np.array(mx.concatenate(outs, axis=2).astype(mx.float32)), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("method, mean, worst", [("affine", 0.15, 0.3), ("turboquant", 0.15, 0.3)])
def test_4bit_attention_is_close_to_mlx_lm_rotating_cache(method, mean, worst):
    """Relative L2 error of each query's attention output against mlx-lm's RotatingKVCache (token by token, float16),
    window 32 of 96 Gaussian tokens, head_dim 128, a residual window of 4: measured mean 0.106 / max 0.19 (affine:4),
    0.114 / 0.25 (turboquant:4); affine:8 gives 0.006 / 0.013."""
    k, v, q = (mx.random.normal((1, h, 96, 128)).astype(mx.float16) for h in (2, 2, 4))
    reference = mlx_lm_token_by_token(q, k, v, 32, 0, scale=128 ** -0.5).astype(mx.float32)
    cache, outs, start = RotatingKVQCache(make_config(method, bits=4, window=4), 32, 0), [], 0
    for n in (40, 1, 1, 30, 24):
        cache.update_and_fetch(k[:, :, start : start + n], v[:, :, start : start + n])
        outs.append(cache.attend(q[:, :, start : start + n], 128 ** -0.5))
        start += n
    ours = mx.concatenate(outs, axis=2).astype(mx.float32)
    error = np.array(mx.sqrt(((ours - reference) ** 2).sum(-1) / (reference ** 2).sum(-1)))
    assert np.isfinite(error).all() and error.mean() < mean and error.max() < worst, (error.mean(), error.max())


# -- mlx-lm's own model classes --------------------------------------------------------------------------
class _Stores16Bits:
    """An mlx-lm cache that stores keys and values rounded to float16, as kvq's fp16 method stores a float32
    model's: the reference that isolates kvq's attention from the 16-bit storage itself."""

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(*(x.astype(mx.float16).astype(x.dtype) for x in (keys, values)))


class KVCache16(_Stores16Bits, mlx_cache.KVCache):
    pass


class RotatingKVCache16(_Stores16Bits, mlx_cache.RotatingKVCache):
    pass


def mlx_lm_16_bit_caches(model) -> list:
    return [RotatingKVCache16(c.max_size, c.keep) if isinstance(c, mlx_cache.RotatingKVCache) else KVCache16()
            for c in model.make_cache()]


def test_sliding_layers_get_the_rotating_cache_and_mlx_lm_logits(sliding_model):
    """kvq's fp16 cache against mlx-lm's caches (RotatingKVCache on the sliding layers) storing the same 16 bits,
    54 tokens past the 16-token window: the same greedy tokens, and logits within 5e-3 when both are fed mlx-lm's
    tokens (llama and gpt_oss: 1e-4; the random gemma3 amplifies float32 noise that flips float16 roundings of its
    keys to 3.4e-3, as against float32 storage 16-bit storage alone moves its logits by 0.03)."""
    caches = kvq.make_prompt_cache(sliding_model, "fp16", window=4, flush=8)  # a flush within the 16-token ring
    for ours, theirs in zip(caches, sliding_model.make_cache()):
        if isinstance(theirs, mlx_cache.RotatingKVCache):
            assert type(ours) is RotatingKVQCache and (ours.max_size, ours.keep) == (theirs.max_size, theirs.keep)
        else:
            assert type(ours) is kvq.KVQCache
    ref, tokens = logits(sliding_model, mlx_lm_16_bit_caches(sliding_model), tokens=True)
    ours, greedy = logits(sliding_model, caches, tokens=True)
    assert greedy == tokens
    forced = logits(sliding_model, kvq.make_prompt_cache(sliding_model, "fp16", window=4, flush=8), forced=tokens)
    np.testing.assert_allclose(forced, ref, atol=5e-3)
    rotating = [c for c in caches if isinstance(c, RotatingKVQCache)]
    assert all(c.compressed_keys.length == 16 - 4 for c in rotating)  # the ring holds the window's older tokens


@pytest.mark.parametrize("method", ["affine:4", "turboquant:4", "turboquant:3"])
def test_every_method_gives_finite_logits(sliding_model, method):
    name, bits = method.split(":")
    out = logits(sliding_model, kvq.make_prompt_cache(sliding_model, name, bits=int(bits), window=4), steps=8)
    assert np.isfinite(out).all()


@pytest.fixture
def experts_below_the_sort(monkeypatch):
    """mlx-lm's ``SwitchGLU`` run on at most 63 token-expert pairs a call, below the 64 where it sorts them for
    ``gather_mm(..., sorted_indices=True)``: each token gets the same expert outputs (a token's experts do not depend
    on the others), through the unsorted route. On CUDA, MLX 0.32.4's sorted route (CUTLASS's grouped GEMM) returns
    wrong values now and then, with or without kvq (issue #49: benchmarks/investigations/gpu_chunk_flake.md)."""
    from mlx_lm.models.switch_layers import SwitchGLU

    call = SwitchGLU.__call__

    def in_pieces(self, x, indices):  # x [B, T, D], indices [B, T, top_k] -> [B, T, top_k, D]
        step = max(1, 63 // indices.shape[-1])
        return mx.concatenate([call(self, x[:, i : i + step], indices[:, i : i + step])
                               for i in range(0, x.shape[1], step)], axis=1)

    monkeypatch.setattr(SwitchGLU, "__call__", in_pieces)


@pytest.mark.parametrize("name", ["gpt_oss", "llama"])
@pytest.mark.parametrize("method", ["fp16", "affine:4"])
def test_chunked_prefill_gives_each_query_its_token_by_token_view(name, method, experts_below_the_sort):
    """The same logits whatever the chunks (float32 models: summation order; measured at most 1.4e-4). A chunk's
    tokens are stored, compressed and attended in 16 bits exactly as one by one. (The random gemma3 is left out: it
    turns 1e-6 of float32 noise into flipped float16 and 4-bit roundings; the cache-level tests cover its shapes.)
    gpt_oss's experts run below mlx-lm's sort (``experts_below_the_sort``): this checks kvq's chunks, not MLX's
    sorted expert GEMM, which on CUDA moved the one-chunk run's logits by up to 2 now and then."""
    model = tiny(name)
    method, _, bits = method.partition(":")
    params = {"bits": int(bits)} if bits else {}
    runs = [logits(model, kvq.make_prompt_cache(model, method, window=4, flush=3, **params), chunks, steps=4)
            for chunks in ([1] * 50, (50,), (9, 1, 23, 17))]
    for run in runs[1:]:  # the prompt's last logits and the 4 decode steps
        np.testing.assert_allclose(run[-5:], runs[0][-5:], atol=5e-4)


# -- max_kv_size -----------------------------------------------------------------------------------------
def test_max_kv_size_keeps_4_tokens_and_matches_mlx_lm_decode():
    """max_kv_size=24 on a llama without sliding layers: every layer a RotatingKVQCache(24, keep=4); a prompt
    prefilled in two chunks gives each token what mlx-lm's RotatingKVCache(24, keep=4) gives it token by token
    (mlx-lm's own chunk mask drops the keep tokens past 24: kvq follows its decode)."""
    from conftest import tiny_llama

    model = tiny_llama(hidden=128, vocab=128, dtype=mx.float32)
    caches = kvq.make_prompt_cache(model, "fp16", window=6, max_kv_size=24)
    assert all(type(c) is RotatingKVQCache and (c.max_size, c.keep) == (24, 4) for c in caches)
    ours = logits(model, caches, chunks=(30, 20))
    ref_caches = [mlx_cache.RotatingKVCache(24, keep=4) for _ in model.layers]
    ref = logits(model, ref_caches, chunks=(1,) * 50)
    np.testing.assert_allclose(ours[-21:], ref[-21:], atol=3e-3)
    np.testing.assert_allclose(ours[0], ref[29], atol=3e-3)  # the first chunk's last token


def _settle() -> int:
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    return mx.get_active_memory()


def _fill(cache, tokens: int, start: int, chunk: int = 512, heads: int = 2, head_dim: int = 256,
          prompt: int = 1100) -> None:
    """Store random float16 tokens ``start .. tokens`` (chunks of ``chunk``, then single tokens past the prompt of
    ``prompt``), attending after each update as a model does."""
    while start < tokens:
        n = min(chunk if start < prompt else 1, tokens - start)
        k, v = (mx.random.normal((1, heads, n, head_dim)).astype(mx.float16) for _ in range(2))
        cache.update_and_fetch(k, v)
        out = cache.attend(mx.random.normal((1, 2 * heads, n, head_dim)).astype(mx.float16), head_dim ** -0.5)
        mx.eval(out, cache.state)
        start += n


def test_memory_is_bounded_by_the_window_and_a_third_of_mlx_lm_rotating_cache():
    """Gemma 3's sliding layers: window 1024, head_dim 256 (2 KV heads here; the ratio does not depend on them).
    Measured with mx.get_active_memory: mlx-lm's RotatingKVCache holds 1024 float16 tokens (2.00 MiB); kvq's with
    turboquant:4 (4.06 bits per coordinate) and a residual window of 64 holds 64 float16 and 960 compressed tokens
    (0.60 MiB, 0.30x; 0.35x with a window of 128), the same after a 1100-token prompt and 64 decode steps as 200
    steps later. With a flush of 32: the window's buffer holds 64 + 31 tokens (the default flush, 128, makes it
    64 + 127: 0.42x). 200 decode steps add less than one token's bytes: none on the CPU; on a GPU (H100 and H200) 8
    bytes, which a bound decode step holds from some later flush on (696,320 bytes after 1 and after 64 steps,
    696,328 after 200), not per token."""
    config = make_config("turboquant", bits=4, window=64, flush=32)
    # what a method makes once per process (rotation, codebook; on a GPU the decode kernel's constants too)
    _fill(RotatingKVQCache(config, 1024, 0), 203, 0, prompt=200)
    before = _settle()
    ours = RotatingKVQCache(config, 1024, 0)
    _fill(ours, 1164, 0, prompt=1100)
    after_prompt = _settle() - before
    _fill(ours, 1364, 1164)
    after_decode = _settle() - before
    token_bytes = 2 * 2 * 256 * 4 // 8  # one compressed token of keys and values: 2 heads x 256 at 4 bits, each
    assert 0 <= after_decode - after_prompt < token_bytes  # 200 more tokens, not one token's bytes more
    assert after_decode == pytest.approx(ours.nbytes, rel=0.02)
    del ours
    before = _settle()
    theirs = mlx_cache.RotatingKVCache(1024, 0)
    for n in (512, 512, 76) + (1,) * 4:
        theirs.update_and_fetch(*(mx.random.normal((1, 2, n, 256)).astype(mx.float16) for _ in range(2)))
        mx.eval(theirs.keys, theirs.values)
    reference = _settle() - before
    assert reference == 1024 * 2 * 256 * 2 * 2
    assert after_decode <= 0.35 * reference, after_decode / reference


# -- trim, files, batching, errors -------------------------------------------------------------------------
def test_trim_before_the_window_fills_then_not(sliding_model):
    """Trimmed to 7 of 12 tokens, a cache continues as one filled with those 7 (within 5e-3: the 12-token prefill
    saw some of them through 16-bit storage where the 7-token one saw float32; the random gemma3 amplifies that);
    past the window nothing can be trimmed, as with mlx-lm's RotatingKVCache."""
    caches = kvq.make_prompt_cache(sliding_model, "fp16", window=4)
    rotating = [c for c in caches if isinstance(c, RotatingKVQCache)]
    prompt = mx.array([PROMPT[:12]])
    sliding_model(prompt, cache=caches)
    assert all(c.is_trimmable() for c in rotating)
    assert mlx_cache.trim_prompt_cache(caches, 5) == 5
    step = mx.array([[PROMPT[7]]])
    fresh = kvq.make_prompt_cache(sliding_model, "fp16", window=4)
    sliding_model(prompt[:, :7], cache=fresh)
    np.testing.assert_allclose(np.array(sliding_model(step, cache=caches)), np.array(sliding_model(step, cache=fresh)),
                               atol=5e-3)
    sliding_model(mx.array([PROMPT[:20]]), cache=caches)  # 28 tokens: past the 16-token window
    assert not any(c.is_trimmable() for c in rotating)
    assert all(c.trim(3) == 0 for c in rotating)


@pytest.mark.parametrize("loader", ["kvq", "mlx_lm"])
def test_prompt_cache_files_round_trip_a_wrapped_ring(sliding_model, tmp_path, loader):
    caches = kvq.make_prompt_cache(sliding_model, "affine", bits=4, window=4, flush=3)
    logits(sliding_model, caches, steps=7)
    ring = next(c for c in caches if isinstance(c, RotatingKVQCache)).compressed_keys
    assert ring.wrapped
    path = str(tmp_path / "cache.safetensors")
    kvq.save_prompt_cache(path, caches)
    loaded = (kvq.load_prompt_cache if loader == "kvq" else mlx_cache.load_prompt_cache)(path)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert [c.nbytes for c in loaded] == [c.nbytes for c in caches]
    for _ in range(3):  # decode steps that overwrite ring slots after the load
        step = mx.array([[17]])
        # bit-identical on the CPU; 3e-7 apart on an H200 (loaded arrays are fresh contiguous copies)
        np.testing.assert_allclose(np.array(sliding_model(step, cache=loaded)),
                                   np.array(sliding_model(step, cache=caches)), rtol=0, atol=1e-5)


def test_a_corrupt_rotating_state_is_refused(sliding_model):
    caches = kvq.make_prompt_cache(sliding_model, "fp16", window=4)
    logits(sliding_model, caches, steps=2)
    layer = next(c for c in caches if isinstance(c, RotatingKVQCache))
    state = {**layer.state, "left": layer.left + 1}
    with pytest.raises(ValueError, match="rotating layer .* inconsistent"):
        RotatingKVQCache.from_state(state)


def test_batch_generation_with_sliding_layers_matches_single_sequences():
    """mlx-lm's BatchGenerator (merge, extend, filter, extract) over rows of rotating caches, prompts longer and
    shorter than the 16-token window."""
    from conftest import batch_greedy

    model = tiny("llama")
    prompts = [[(5 * i + 1) % 128 for i in range(n)] for n in (40, 11, 27)]

    def single(prompt):
        cache = kvq.make_prompt_cache(model, "affine", bits=8, window=4)
        gen = generate_step(mx.array(prompt), model, max_tokens=6, prompt_cache=cache,
                            sampler=lambda x: mx.argmax(x, -1), prefill_step_size=16)
        return [int(t) for t, _ in gen]

    singles = [single(p) for p in prompts]
    patch_model(model, "affine", bits=8, window=4)
    try:
        got = batch_greedy(model, prompts, 6)
    finally:
        unpatch_model(model)
    assert got == singles


def test_batch_files_rebuild_rotating_rows(tmp_path):
    model = tiny("gpt_oss")
    rows = [kvq.make_prompt_cache(model, "affine", bits=8, window=4) for _ in range(2)]
    for i, row in enumerate(rows):
        model(mx.array([PROMPT[: 20 + 15 * i]]), cache=row)
    batch = [BatchKVQCache.merge([a, b]) for a, b in zip(*rows)]
    path = str(tmp_path / "batch.safetensors")
    kvq.save_prompt_cache(path, batch)
    loaded = kvq.load_prompt_cache(path)
    assert [[type(r) for r in c.rows] for c in loaded] == [[type(r) for r in c.rows] for c in batch]
    assert type(loaded[0].rows[0]) is RotatingKVQCache


def test_masks_and_windows_it_cannot_honour_are_refused():
    cache = RotatingKVQCache(make_config("fp16"), 16, 0)
    assert cache.make_mask(1, window_size=16) is None and cache.make_mask(5, window_size=16) == "causal"
    with pytest.raises(ValueError, match="max_size=16 .* window of 8"):
        cache.make_mask(5, window_size=8)
    cache.update_and_fetch(mx.zeros((1, 1, 3, 16)), mx.zeros((1, 1, 3, 16)))
    with pytest.raises(ValueError, match="no mask array"):
        cache.attend(mx.zeros((1, 1, 3, 16)), 1.0, mask=mx.ones((3, 3), mx.bool_))
    with pytest.raises(ValueError, match="keep must be"):
        RotatingKVQCache(make_config("fp16"), 4, 4)
    # a full-attention cache on a sliding layer: most often another model's prompt-cache file, which the error asks
    with pytest.raises(ValueError, match="not a sliding window .* made for another model"):
        kvq.KVQCache(make_config("fp16")).make_mask(5, window_size=16)
    with pytest.raises(ValueError, match="max_kv_size must be"):
        kvq.make_prompt_cache(tiny("llama"), "fp16", max_kv_size=4)
