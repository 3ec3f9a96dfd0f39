"""The kvq cache inside mlx-lm: parity with KVCache, compressed storage, files, trim, batching, errors."""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache

import kvq
from kvq.cache import KVQCache, load_prompt_cache, make_config, make_prompt_cache, patch, patch_model, unpatch_model

PROMPT = mx.array([(7 * i + 3) % 256 for i in range(200)])


def logits_run(model, cache, prompt=PROMPT, chunk=None, steps=32, forced=None):
    """Prefill (optionally chunked), then decode greedily (or the ``forced`` tokens); [steps + 1, vocab] logits."""
    chunk = chunk or prompt.size
    for i in range(0, prompt.size, chunk):
        logits = model(prompt[None, i : i + chunk], cache=cache)[0, -1]
    out = [logits]
    for i in range(steps):
        y = mx.argmax(out[-1]) if forced is None else forced[i]
        out.append(model(y.reshape(1, 1), cache=cache)[0, -1])
    return mx.stack(out).astype(mx.float32)


def greedy(model, cache, prompt=PROMPT, n=12, prefill_step_size=64):
    gen = generate_step(prompt, model, max_tokens=n, prompt_cache=cache, sampler=lambda x: mx.argmax(x, -1),
                        prefill_step_size=prefill_step_size)
    return [int(t) for t, _ in gen]


@pytest.mark.parametrize("window, chunk", [(128, None), (0, 64), (16, 48)])
def test_fp16_equals_mlx_lm_kvcache(llama_model, window, chunk):
    ref = logits_run(llama_model, mlx_cache.make_prompt_cache(llama_model), chunk=chunk)
    ours = logits_run(llama_model, make_prompt_cache(llama_model, "fp16", window=window), chunk=chunk)
    assert mx.allclose(ours, ref, atol=2e-2, rtol=1e-2).item(), mx.abs(ours - ref).max()
    assert mx.array_equal(mx.argmax(ours, -1), mx.argmax(ref, -1)).item()


def test_affine_8bit_top1_matches_fp16(llama_model):
    ref = logits_run(llama_model, make_prompt_cache(llama_model, "fp16"), chunk=64)
    ours = logits_run(llama_model, make_prompt_cache(llama_model, "affine", bits=8, window=16), chunk=64)
    assert mx.array_equal(mx.argmax(ours, -1), mx.argmax(ref, -1)).item()


@pytest.mark.skipif(mx.default_device() == mx.gpu and not mx.metal.is_available(),
                    reason="mlx-lm's QuantizedKVCache raises on MLX 0.32 CUDA (quantized_matmul shapes)")
def test_affine_matches_mlx_lm_quantized_cache_numerics(llama_model):
    """No sinks, no window: the same stored codes as mlx-lm's QuantizedKVCache, so close logits (teacher forced;
    mlx-lm attends in fp16, kvq in fp32)."""
    forced = mx.arange(32) * 5 % 256
    ref = logits_run(llama_model, [mlx_cache.QuantizedKVCache(64, 4) for _ in llama_model.layers], chunk=50,
                     forced=forced)
    ours = logits_run(llama_model, make_prompt_cache(llama_model, "affine", bits=4, sinks=0, window=0, flush=1), chunk=50,
                      forced=forced)
    assert mx.allclose(ours, ref, atol=5e-2, rtol=1e-2).item(), mx.abs(ours - ref).max()


def test_layout_and_no_fp16_copy_of_compressed_tokens(llama_model):
    cache = make_prompt_cache(llama_model, "affine", bits=4, sinks=4, window=32, flush=1)
    logits_run(llama_model, cache, chunk=50, steps=3)
    layer = cache[0]
    assert layer.offset == 203 and layer.sink_keys.shape[2] == 4 and layer.window_keys.shape[2] == 32
    assert layer.compressed_keys.length == 203 - 36
    assert layer.compressed_keys.data["codes"].dtype == mx.uint32
    # nothing else is held: the resident bytes are exactly sinks + window + compressed store
    fp = 2 * (4 + 32) * 2 * 64 * 2  # sinks and window buffers: K and V, H_kv 2, D 64, fp16
    assert layer.nbytes == fp + layer.compressed_keys.nbytes + layer.compressed_values.nbytes


def test_prompt_cache_file_round_trip_bit_exact_and_continues(llama_model, tmp_path):
    cache = make_prompt_cache(llama_model, "affine", bits=4, window=16)
    first = greedy(llama_model, cache, n=6)
    file = str(tmp_path / "cache.safetensors")
    mlx_cache.save_prompt_cache(file, cache, {"note": "kvq"})
    loaded, meta = load_prompt_cache(file, expect=make_config("affine", bits=4, window=16), return_metadata=True)
    assert meta["note"] == "kvq" and isinstance(loaded[0], KVQCache)
    for a, b in zip(cache, loaded):
        sa, sb = a.state, b.state
        for name in ("keys", "values"):
            for field in sa[name]:
                assert mx.array_equal(sa[name][field], sb[name][field])
        assert mx.array_equal(sa["window_keys"], sb["window_keys"]) and sa["offset"] == sb["offset"]
    nxt = mx.array([first[-1]])
    assert greedy(llama_model, loaded, nxt, n=6) == greedy(llama_model, cache, nxt, n=6)


def test_a_loaded_file_serves_attention_without_a_cache_made_first(llama_model, tmp_path):
    """In a fresh process nothing has patched mlx-lm's attention yet: kvq.load_prompt_cache does it, or the model
    would hand the caches' stand-ins to mx.fast.scaled_dot_product_attention (a TypeError)."""
    cache = make_prompt_cache(llama_model, "affine", bits=4, window=8)
    greedy(llama_model, cache, n=2)
    file = str(tmp_path / "c.safetensors")
    mlx_cache.save_prompt_cache(file, cache)
    patch.unpatch()  # as in a new process
    loaded = load_prompt_cache(file)
    assert patch.is_patched("mlx_lm.models.llama")
    assert greedy(llama_model, loaded, mx.array([3]), n=2) == greedy(llama_model, cache, mx.array([3]), n=2)


def test_loading_a_file_of_another_method_or_format_fails_cleanly(llama_model, tmp_path):
    cache = make_prompt_cache(llama_model, "affine", bits=4)
    greedy(llama_model, cache, n=2)
    file = str(tmp_path / "c.safetensors")
    mlx_cache.save_prompt_cache(file, cache)
    with pytest.raises(ValueError, match=r"layer 0 does not hold what expect= asks: keys affine bits 4, expected 8; "
                                         r"values affine bits 4, expected 8$"):
        load_prompt_cache(file, expect=make_config("affine", bits=8))
    with pytest.raises(ValueError, match=r"keys method 'affine', expected 'turboquant'"):
        load_prompt_cache(file, expect=make_config("turboquant", bits=4))
    arrays, meta = mx.load(file, return_metadata=True)
    config = cache[0].state["config"].replace('"format": 3', '"format": 99')
    bad = copy.copy(cache[0])
    with pytest.raises(ValueError, match="file format 99 .* not supported"):
        KVQCache.from_state({**bad.state, "config": config})
    assert mx.load(file).keys() == arrays.keys()  # the file is untouched


def test_trim_then_regenerate(llama_model):
    cache = make_prompt_cache(llama_model, "affine", bits=8, window=32)
    tokens = greedy(llama_model, cache, n=10)
    extra = cache[0].offset - (PROMPT.size + 4)  # keep the prompt and the first 4 generated tokens
    for c in cache:
        assert c.trim(extra) == extra and c.offset == PROMPT.size + 4
    again = greedy(llama_model, cache, mx.array(tokens[4:5]), n=5)
    assert again == tokens[5:10]


def test_fp16_trim_past_the_window_is_exact(llama_model):
    cache = make_prompt_cache(llama_model, "fp16", window=4)
    ref = logits_run(llama_model, make_prompt_cache(llama_model, "fp16", window=4), PROMPT[:150], steps=0)
    logits_run(llama_model, cache, PROMPT, steps=0)
    for c in cache:
        assert c.trim(51) == 51
    out = logits_run(llama_model, cache, PROMPT[149:150], steps=0)
    assert mx.allclose(out, ref, atol=1e-3).item()


def test_generate_twice_starts_from_empty_caches(llama_model):
    model = patch_model(llama_model, "affine", bits=8)
    try:
        made = mlx_cache.make_prompt_cache(model)
        assert all(isinstance(c, KVQCache) and c.empty() for c in made)
        first = greedy(model, None, n=6)
        second = greedy(model, None, n=6)
        assert first == second
    finally:
        unpatch_model(llama_model)
    assert not hasattr(llama_model, "_kvq_original_make_cache")
    assert type(mlx_cache.make_prompt_cache(llama_model)[0]) is mlx_cache.KVCache


def test_patch_is_idempotent_reversible_and_scoped(llama_model):
    from mlx_lm.models import llama

    ref = logits_run(llama_model, mlx_cache.make_prompt_cache(llama_model), steps=2)
    patch.patch()
    patch.patch()
    assert patch.is_patched("mlx_lm.models.llama")
    assert mx.array_equal(logits_run(llama_model, mlx_cache.make_prompt_cache(llama_model), steps=2), ref)
    patch.unpatch()
    assert llama.scaled_dot_product_attention is patch._ORIGINAL
    patch.patch()


def test_attention_follows_the_keys_not_the_cache_named():
    """mlx-lm's attention with kvq's patch (issue #25): stand-ins are attended by the cache that made them, whatever
    cache the call names (KV-sharing layers name none, or their own); arrays by mlx-lm's function, even when the
    call names a kvq cache (before: that cache's tokens were attended and the arrays ignored)."""
    mx.random.seed(1)
    a, b = KVQCache(make_config("fp16", window=0)), KVQCache(make_config("fp16", window=0))
    k, v = mx.random.normal((1, 2, 5, 64)), mx.random.normal((1, 2, 5, 64))
    b.update_and_fetch(mx.random.normal((1, 2, 3, 64)), mx.random.normal((1, 2, 3, 64)))
    views = a.update_and_fetch(k, v)
    assert views[0].cache is a and a.keys_and_values()[0].cache is a and b.keys_and_values()[0].cache is b
    q = mx.random.normal((1, 4, 1, 64))
    want = mx.fast.scaled_dot_product_attention(q, k.astype(mx.float16).astype(mx.float32),
                                                v.astype(mx.float16).astype(mx.float32), scale=0.125)
    for named in (a, b, None):
        got = patch.scaled_dot_product_attention(q, *a.keys_and_values(), cache=named, scale=0.125, mask=None)
        assert mx.allclose(got, want, atol=1e-5).item()
    arrays = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    got = patch.scaled_dot_product_attention(q, k, v, cache=b, scale=0.125, mask=None)
    assert mx.array_equal(got, arrays).item()
    assert KVQCache(make_config("fp16")).keys_and_values() == (None, None)


def test_batch_stand_ins_are_the_batch_s():
    """A batch's update returns stand-ins of the batch's shape whose attention is the batch's, every row over its
    own tokens (before: the last row's, of one row)."""
    from kvq.cache import BatchKVQCache

    rows = [KVQCache(make_config("fp16", window=0)) for _ in range(2)]
    batch = BatchKVQCache(rows)
    keys, values = batch.update_and_fetch(mx.random.normal((2, 2, 3, 64)), mx.random.normal((2, 2, 3, 64)))
    assert keys.cache is batch and keys.shape == (2, 2, 3, 64) and values.shape == (2, 2, 3, 64)
    q = mx.random.normal((2, 4, 3, 64))
    got = patch.scaled_dot_product_attention(q, keys, values, cache=None, scale=0.125, mask="causal")
    for i, row in enumerate(rows):
        assert mx.allclose(got[i : i + 1], row.attend(q[i : i + 1], 0.125, "causal"), atol=1e-5).item()


def test_batch_generation_matches_single_sequences(llama_model):
    from conftest import batch_greedy

    prompts = [[(5 * i + 1) % 256 for i in range(n)] for n in (40, 23, 57)]
    singles = [greedy(llama_model, make_prompt_cache(llama_model, "affine", bits=8, window=8), mx.array(p), n=5,
                      prefill_step_size=16) for p in prompts]
    model = patch_model(llama_model, "affine", bits=8, window=8)
    try:
        got = batch_greedy(model, prompts, 5)
    finally:
        unpatch_model(llama_model)
    assert got == singles


@pytest.mark.parametrize("keys, values, error, match", [
    (mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 4, 64)), ValueError, "must agree on B, H, T"),
    (mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64), mx.float16), TypeError, "same dtype"),
    (mx.zeros((1, 2, 3, 80)), mx.zeros((1, 2, 3, 80)), ValueError, "head_dim 80 is not supported"),
    (mx.zeros((2, 3, 64)), mx.zeros((2, 3, 64)), ValueError, r"keys must have rank 4"),
])
def test_bad_updates_are_rejected_and_nothing_is_stored(keys, values, error, match):
    cache = KVQCache(make_config("affine", bits=4))
    with pytest.raises(error, match=match):
        cache.update_and_fetch(keys, values)
    assert cache.empty() and cache.nbytes == 0


def test_layout_change_is_rejected():
    cache = KVQCache(make_config("affine", bits=4, window=0))
    cache.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
    before = cache.nbytes
    with pytest.raises(ValueError, match=r"do not match this cache's \(B=1, H=2"):
        cache.update_and_fetch(mx.zeros((1, 4, 1, 64)), mx.zeros((1, 4, 1, 64)))
    assert cache.offset == 3 and cache.nbytes == before


def test_make_prompt_cache_checks_the_model_head_dim():
    from conftest import tiny_llama

    model = tiny_llama(hidden=96, heads=2, kv_heads=1)  # head_dim 48
    with pytest.raises(ValueError, match="head_dim 48 is not supported"):
        make_prompt_cache(model, "affine", bits=4)
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        make_prompt_cache(model, "fp16", window=-1)
    with pytest.raises(TypeError, match="unknown parameter"):
        make_prompt_cache(model, "fp16", bits=4)
    # a misspelt cache setting: both lists are named, the method's parameters and the cache's settings
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) windw for method 'affine'; allowed: bits, "
                                        r"group_size; the cache's own settings: .*sinks, window, step"):
        make_prompt_cache(model, "affine", windw=3)


def test_separate_key_and_value_methods(llama_model):
    cache = make_prompt_cache(llama_model, key_method="affine", value_method="fp16", key_params={"bits": 8},
                              window=8)
    ours = logits_run(llama_model, cache, chunk=64, steps=4)
    ref = logits_run(llama_model, make_prompt_cache(llama_model, "fp16"), chunk=64, steps=4)
    assert mx.array_equal(mx.argmax(ours, -1), mx.argmax(ref, -1)).item()
    assert cache[0].compressed_values.data.keys() == {"x"} and "codes" in cache[0].compressed_keys.data


@pytest.mark.parametrize("kwargs", [
    dict(method="turboquant", bits=4),
    dict(method="turboquant", key_params={"bits": 4}, value_params={"bits": 3}),
    dict(method="turboquant_prod", bits=4),
    dict(method=None, key_method="qjl", value_method="affine", value_params={"bits": 4}),
    dict(method=None, key_method="turboquant", value_method="affine", key_params={"bits": 4}),
])
def test_plugin_methods_through_the_cache(llama_model, kwargs):
    """Every installed method serves the tiny llama through the cache: prefill in chunks, decode, compressed
    storage that is smaller than fp16, logits close to the fp16 cache's (teacher forced on the same tokens)."""
    forced = mx.arange(8) * 11 % 256
    ref = logits_run(llama_model, make_prompt_cache(llama_model, "fp16", window=8), chunk=64, steps=8, forced=forced)
    cache = make_prompt_cache(llama_model, window=8, flush=1, **kwargs)
    ours = logits_run(llama_model, cache, chunk=64, steps=8, forced=forced)
    layer = cache[0]
    # tokens leave the window in blocks of flush_tokens (QJL: its 32-token outlier groups, so 192 of 196)
    block = layer.config.flush_tokens
    assert layer.compressed_keys.length == block * ((PROMPT.size + 8 - 4 - 8) // block)
    assert block == (32 if kwargs.get("key_method") == "qjl" else 1)
    stored = layer.compressed_keys.nbytes + layer.compressed_values.nbytes
    assert stored < 0.5 * 2 * 2 * 2 * 64 * layer.compressed_keys.capacity
    rel = (mx.linalg.norm(ours - ref) / mx.linalg.norm(ref)).item()
    # measured 0.07-0.19; a wrong rotation, sketch or merge gives errors of order 1
    assert mx.all(mx.isfinite(ours)).item() and rel < 0.3, rel


def test_decode_uses_one_fused_attend_call_over_all_parts(monkeypatch):
    """Where the chosen attend implementation offers ``attend_dense`` (kvq_metal's tensor-core kernel), a decode
    step makes one call with the compressed tokens and the uncompressed sinks and window (exactly those tokens),
    and the cache returns its result; ``None`` from it falls back to attending the parts."""
    from kvq.attention import dense_attend, merge_parts
    from kvq.plugins import registry

    config = make_config("affine", bits=4, group_size=32, sinks=4, window=16, flush=1)
    reference, cache = KVQCache(config), KVQCache(config)
    k = mx.random.normal((1, 2, 60, 64), key=mx.random.key(0)).astype(mx.float16)
    v = mx.random.normal((1, 2, 60, 64), key=mx.random.key(1)).astype(mx.float16)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(2)).astype(mx.float16)
    reference.update_and_fetch(k, v)
    cache.update_and_fetch(k, v)
    want = reference.attend(q, 0.125)
    impl = registry().implementations[("affine", "mlx")]
    calls = []

    def attend_dense(queries, keys, values, scale, dense):
        calls.append(dense)
        if len(calls) > 1:
            return None
        parts = [impl.kvq_attend(queries, keys, values, scale, None),
                 dense_attend(queries, dense.sink_keys, dense.sink_values, scale),
                 dense_attend(queries, dense.window_keys, dense.window_values, scale)]
        return merge_parts(parts)

    monkeypatch.setattr(impl, "attend_dense", attend_dense, raising=False)
    got = cache.attend(q, 0.125)
    (dense,) = calls
    assert mx.array_equal(dense.sink_keys, k[:, :, :4]) and mx.array_equal(dense.sink_values, v[:, :, :4])
    assert mx.array_equal(dense.window_keys, k[:, :, -16:]) and mx.array_equal(dense.window_values, v[:, :, -16:])
    assert mx.allclose(got, want, atol=1e-3) and got.dtype == q.dtype
    assert mx.array_equal(cache.attend(q, 0.125), want) and len(calls) == 2  # None: the parts
    cache.attend(mx.concatenate([q, q], axis=2), 0.125, mask="causal")  # prefill rows: never fused
    assert len(calls) == 2


class _BoundImpl:
    """A stand-in for a kernel implementation with ``bind_dense``: records every binding and step."""

    def __init__(self, impl):
        self.impl, self.binds, self.steps = impl, [], 0

    def bind_dense(self, queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values):
        from kvq.attention import dense_attend, merge_parts

        self.binds.append(keys.num_tokens)

        def step(q, wk, wv):
            self.steps += 1
            parts = [self.impl.kvq_attend(q, keys, values, scale, None), dense_attend(q, sink_keys, sink_values, scale),
                     dense_attend(q, wk, wv, scale)]
            return merge_parts(parts)[0].astype(q.dtype)

        return step


def test_decode_binds_once_per_compressed_state_and_replays(monkeypatch):
    """The decode hot path is decided once per layer (issue #22): the first decode step binds (``bind_dense``),
    the following steps only replay the bound step with the window as it is; a window flush, a trim into the
    compressed tokens, a registry change or other queries bind again, and a copy binds its own. Every step's output
    equals attending the parts (kernels off)."""
    from kvq.plugins import registry

    config = make_config("affine", bits=4, group_size=32, sinks=4, window=16, flush=4)
    impl = registry().implementations[("affine", "mlx")]
    bound = _BoundImpl(impl)
    monkeypatch.setattr(impl, "bind_dense", bound.bind_dense, raising=False)
    cache, reference = KVQCache(config), KVQCache(config)
    k = mx.random.normal((1, 2, 80, 64), key=mx.random.key(5)).astype(mx.float16)
    v = mx.random.normal((1, 2, 80, 64), key=mx.random.key(6)).astype(mx.float16)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(7)).astype(mx.float16)
    for c in (cache, reference):
        c.update_and_fetch(k[:, :, :40], v[:, :, :40])
    monkeypatch.setattr(reference, "_fused_attend", lambda *a: None)  # the reference attends its parts
    compressed = []
    for t in range(40, 52):
        for c in (cache, reference):
            c.update_and_fetch(k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert mx.allclose(cache.attend(q, 0.125), reference.attend(q, 0.125), atol=2e-3)
        compressed.append(cache.compressed_keys.length)
    # one binding per compressed length (flushes of 4 tokens), one step per decode token
    assert bound.binds == sorted(set(compressed)) == [20, 24, 28, 32] and bound.steps == 12
    cache.trim(1)  # within the window: the binding stays
    cache.attend(q, 0.125)
    assert len(bound.binds) == 4
    cache.trim(cache.window.length + 2)  # into the compressed tokens: bound again (at the next token)
    cache.update_and_fetch(k[:, :, 60:61], v[:, :, 60:61])
    cache.attend(q, 0.125)
    assert bound.binds[-1] == compressed[-1] - 2 and len(bound.binds) == 5
    cache.attend(q.astype(mx.float32), 0.125)  # other queries: bound again
    copy_ = copy.deepcopy(cache)
    assert copy_._bound is None and len(bound.binds) == 6
    copy_.attend(q, 0.125)
    assert len(bound.binds) == 7
    registry().generation += 1  # a plugin registered or removed
    cache.attend(q, 0.125)
    assert len(bound.binds) == 8


def test_flush_blocks_leave_the_window_together_and_attention_is_unchanged(tmp_path):
    """``flush=N``: the window grows to ``window + N - 1`` tokens by appends, then its oldest tokens are
    compressed together; the stored tokens are the same as a cache that compresses exactly those tokens, and
    attention matches an uncompressed reference on the held tokens (fp16 method: lossless). Saved and loaded
    with the setting."""
    cache = KVQCache(make_config("fp16", sinks=2, window=8, flush=4))
    k = mx.random.normal((1, 2, 30, 64), key=mx.random.key(3)).astype(mx.float16)
    v = mx.random.normal((1, 2, 30, 64), key=mx.random.key(4)).astype(mx.float16)
    cache.update_and_fetch(k[:, :, :12], v[:, :, :12])  # prefill: 2 sinks, then 10 tokens fit the window
    assert (cache.sinks.length, cache.compressed_keys.length, cache.window.length) == (2, 0, 10)
    lengths = []
    for t in range(12, 30):
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        lengths.append((cache.compressed_keys.length, cache.window.length))
    assert lengths[:6] == [(0, 11), (4, 8), (4, 9), (4, 10), (4, 11), (8, 8)]  # blocks of 4 leave together
    assert all(8 <= w <= 11 for _, w in lengths) and lengths[-1][0] + lengths[-1][1] + 2 == 30
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(5)).astype(mx.float16)
    from conftest import reference_attention

    want, _ = reference_attention(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), 0.125)
    assert mx.allclose(cache.attend(q, 0.125).astype(mx.float32), want, atol=2e-3)
    file = str(tmp_path / "flush.safetensors")
    mlx_cache.save_prompt_cache(file, [cache])
    (loaded,) = load_prompt_cache(file)
    assert loaded.config.flush == 4 and loaded.window.length == cache.window.length
    assert mx.array_equal(loaded.attend(q, 0.125), cache.attend(q, 0.125))
    with pytest.raises(ValueError, match="flush must be an int >= 1"):
        make_config("fp16", flush=0)


def test_a_plugin_with_only_quantize_and_dequantize_serves_the_cache(llama_model, registered):
    """The example plugin (``absmax8``: no ``kvq_attend``) decodes through the cache once tokens are compressed:
    kvq attends over its codes one dequantized block at a time; a method that can neither attend nor
    dequantize is refused when the cache is made, naming what is missing."""
    import importlib
    import sys
    from pathlib import Path

    import attrs

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "kvq-example-plugin" / "src"))
    try:
        example = importlib.import_module("kvq_example_plugin")
    finally:
        sys.path.pop(0)
    if "absmax8" not in kvq.registry().methods:  # not installed in this environment: register it for this test
        example.kvq_register(registered)
    forced = mx.arange(8) * 11 % 256
    ref = logits_run(llama_model, make_prompt_cache(llama_model, "fp16", window=8), chunk=64, steps=8, forced=forced)
    cache = make_prompt_cache(llama_model, "absmax8", sinks=0, window=0, flush=1)
    ours = logits_run(llama_model, cache, chunk=64, steps=8, forced=forced)
    assert cache[0].compressed_keys.length == PROMPT.size + 8 and "codes" in cache[0].compressed_keys.data
    rel = (mx.linalg.norm(ours - ref) / mx.linalg.norm(ref)).item()
    assert rel < 0.02, rel  # 8-bit codes; a wrong scale or merge gives errors of order 1

    @attrs.frozen
    class CodesOnlyParams(example.Absmax8Params):
        method = "codes_only"

    class CodesOnly:
        method, backend = "codes_only", "mlx"

        def supports(self, problem):
            return True

        def cost(self, problem):
            return 1.0

        def kvq_quantize(self, x, params):
            return example.Absmax8MLX().kvq_quantize(x, params)

    registered(kvq.Method("codes_only", CodesOnlyParams, "quantize only (test)"), CodesOnly())
    with pytest.raises(ValueError, match="method 'codes_only' cannot serve the keys: no installed implementation "
                                         "offers kvq_attend, a pure-MLX scores, or kvq_dequantize"):
        make_prompt_cache(llama_model, "codes_only")


def test_batch_rows_in_decode_take_the_fused_path(monkeypatch):
    """A BatchKVQCache row in decode passes its own query start, which is its newest token: the row goes to the
    fused decode path (issue #22: through mlx-lm's BatchGenerator kvq never reached the kernel, 0.045x fp16 on an
    H200); a row whose query is not its newest token (a padded prefill) does not."""
    from kvq.cache import BatchKVQCache

    calls = []
    original = KVQCache._fused_attend

    def spy(self, queries, scale):
        calls.append(self)
        return original(self, queries, scale)  # None on the CPU: the parts path answers

    monkeypatch.setattr(KVQCache, "_fused_attend", spy)
    config = make_config("turboquant", bits=4, sinks=2, window=4)
    rows = [KVQCache(config) for _ in range(3)]
    batch = BatchKVQCache(rows)
    keys = mx.random.normal((3, 2, 12, 64), key=mx.random.key(0))
    batch.update_and_fetch(keys, keys)
    batch.attend(mx.random.normal((3, 4, 12, 64), key=mx.random.key(1)), 0.125)
    assert calls == []  # prefill: 12 queries
    step = mx.random.normal((3, 2, 1, 64), key=mx.random.key(2))
    batch.update_and_fetch(step, step)
    out = batch.attend(mx.random.normal((3, 4, 1, 64), key=mx.random.key(3)), 0.125)
    assert calls == rows and out.shape == (3, 4, 1, 64)
    calls.clear()
    rows[0].attend(mx.random.normal((1, 4, 1, 64), key=mx.random.key(4)), 0.125, query_start=5)
    assert calls == []  # an earlier position: not the newest token


@pytest.mark.parametrize("model", [None, "llama", nn.Module()], ids=["None", "str", "bare-module"])
def test_make_prompt_cache_names_what_is_not_a_model(model):
    """Not an mlx-lm model: a TypeError saying what is needed (before: an AttributeError about .layers)."""
    with pytest.raises(TypeError, match="model must be an mlx-lm model"):
        make_prompt_cache(model, "affine", bits=4)
