"""Key channel scales (issue #53, :mod:`kvq.cache.guard`): a head whose key channels hold very unequal energy (gemma-3's
q/k-normed keys) stores ``k / s`` and attends with ``q * s``, ``s`` powers of two chosen from the first block: the same
scores, exactly, for the uncompressed tokens; a smaller quantization error for the compressed ones; the scales kept
with the cache, its files and a batch's packed rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvq.attention import dense_attend
from kvq.cache import KVQCache, load_prompt_cache, make_config, save_prompt_cache
from kvq.cache.centring import KeyTransform
from kvq.cache.guard import SCALE_SPREAD_LIMIT, channel_spread, key_scales
from kvq.evaluation.attention_error import dense_kv

from conftest import fused_and_parts_decode, gpu_chunk_rule

B, H, D, T = 1, 2, 64, 320
#: 16 loud channels at 4x the others' standard deviation: spread 64 * (16 * 16 + 48) / (16 * 4 + 48)^2 = 1.55
LOUD = 16


def profiled_keys(seed: int = 0, loud: float = 4.0, heads=(0, 1)):
    """Keys ``[1, 2, 320, 64]`` whose first :data:`LOUD` channels have standard deviation ``loud`` (the others 1) in
    the KV heads ``heads`` (the others all 1), and values."""
    kk, kv = mx.random.split(mx.random.key(seed))
    profile = mx.where(mx.arange(D) < LOUD, loud, 1.0)
    per_head = mx.stack([profile if h in heads else mx.ones((D,)) for h in range(H)])[None, :, None, :]
    return mx.random.normal((B, H, T, D), key=kk) * per_head, mx.random.normal((B, H, T, D), key=kv)


def filled(keys, values, method="turboquant", bits=3, policy="upgrade", **kwargs) -> KVQCache:
    cache = KVQCache(make_config(method, bits=bits, outlier_layers=policy, flush=32, **kwargs).for_layer(2))
    cache.update_and_fetch(keys, values)
    cache.release_chunk()
    return cache


def relative(out, ref) -> float:
    return float(mx.linalg.norm(out - ref) / mx.linalg.norm(ref))


def test_scales_are_powers_of_two_from_the_channel_energy():
    """Energy 16 in 16 channels and 1 in 48: spread 1.55, fourth roots 2 and 1 over their geometric mean 2^0.25,
    rounded in log2 to 2 and 1; a head of equal channels (spread about 1) keeps 1, and a block where no head
    reaches the limit gives no scales."""
    keys, _ = profiled_keys(heads=(0,))
    spread = np.array(channel_spread(keys)).ravel()
    assert spread[0] == pytest.approx(64 * 304 / 112**2, rel=0.03) and spread[0] >= SCALE_SPREAD_LIMIT
    assert spread[1] == pytest.approx(1.0, abs=0.05)
    scales = np.array(key_scales(keys))
    assert scales.shape == (B, H, 1, D) and scales.dtype == np.float32
    np.testing.assert_array_equal(scales[0, 0, 0], np.where(np.arange(D) < LOUD, 2.0, 1.0))
    np.testing.assert_array_equal(scales[0, 1, 0], np.ones(D))  # this head is left as it is
    assert key_scales(mx.random.normal((B, H, T, D))) is None
    # a silent channel is scaled as a quiet one, not divided by zero
    silent = keys * mx.where(mx.arange(D) == 20, 0.0, 1.0)
    assert np.isfinite(np.array(key_scales(silent))).all()


def test_an_offset_alone_scales_nothing():
    """Keys whose loud channels are a constant per-channel offset (16 channels at +6, every channel varying alike):
    spread 1.94 as stored (64 * (16 * 37 + 48) / (16 * 37 ** 0.5 + 48) ** 2), but the varying part's is 1, so no
    head is scaled; the same variation on top of that offset still scales exactly the heads it scaled without it.
    (Models' queries follow such offsets: scaling by them moved SmolLM2's error onto the channels its scores weigh
    most, module docstring of kvq.cache.guard.)"""
    offset = mx.where(mx.arange(D) < LOUD, 6.0, 0.0)
    flat = mx.random.normal((B, H, T, D), key=mx.random.key(3)) + offset
    assert float(mx.min(channel_spread(flat))) > 1.9  # as stored: well over the limit
    assert key_scales(flat) is None
    varying, _ = profiled_keys(heads=(0,))
    np.testing.assert_array_equal(np.array(key_scales(varying + offset)) > 1.0, np.array(key_scales(varying)) > 1.0)


def test_a_scaled_layer_attends_exactly_its_decoded_keys():
    """Attention over the stored ``k / s`` with ``q * s`` equals attention over the decoded keys multiplied back
    (within float32 rounding: scores of uncompressed tokens are bit for bit those of unscaled keys), for decode and
    for a chunk of queries, through the pure-MLX parts."""
    keys, values = profiled_keys()
    cache = filled(keys, values, kernels="off")
    assert cache.key_scale is not None and cache.key_mean is None
    q = mx.random.normal((B, 2 * H, 3, D), key=mx.random.key(5))
    decoded_k, decoded_v = dense_kv(cache)
    ref, _ = dense_attend(q, decoded_k, decoded_v, D**-0.5, None)
    np.testing.assert_allclose(np.array(cache.attend(q, D**-0.5, query_start=T)), np.array(ref), rtol=0, atol=2e-5)
    one = q[:, :, :1]
    ref, _ = dense_attend(one, decoded_k, decoded_v, D**-0.5, None)
    np.testing.assert_allclose(np.array(cache.attend(one, D**-0.5)), np.array(ref), rtol=0, atol=2e-5)


def test_transform_queries_and_dense_keys_are_exact():
    """Powers of two round nothing: ``(q * s) . (k / s)`` is ``q . k`` for float16 keys and queries, bit for bit."""
    keys, _ = profiled_keys()
    transform = KeyTransform(None, key_scales(keys))
    k = keys[:, :, :8].astype(mx.float16)
    q = mx.random.normal((B, 2 * H, 1, D)).astype(mx.float16)
    np.testing.assert_array_equal(np.array(transform.centred_dense(k) * transform.scale.astype(mx.float16)), np.array(k))
    scaled = transform.queries(q).astype(mx.float32) * mx.repeat(transform.centred_dense(k), 2, axis=1).astype(mx.float32)[:, :, :1]
    plain = q.astype(mx.float32) * mx.repeat(k, 2, axis=1).astype(mx.float32)[:, :, :1]
    np.testing.assert_array_equal(np.array(scaled), np.array(plain))


@pytest.mark.parametrize("bits", [3, 4])
def test_scaling_cuts_the_attention_error(bits):
    """Isotropic queries over keys with loud channels: the error of turboquant keys falls with the scales (measured
    at 3 bits: 0.29 plain, 0.22 scaled; at 4 bits 0.15 and 0.12); each layer's bytes grow by the scales only."""
    keys, values = profiled_keys(loud=6.0)
    scaled = filled(keys, values, bits=bits, kernels="off")
    plain = filled(keys, values, bits=bits, policy="off", kernels="off")
    assert scaled.key_scale is not None and plain.key_scale is None
    assert scaled.nbytes == plain.nbytes + B * H * D * 4
    q = mx.random.normal((B, 2 * H, 64, D), key=mx.random.key(11))
    ref, _ = dense_attend(q, keys, values, D**-0.5, None)
    errors = [relative(c.attend(q, D**-0.5, query_start=T), ref) for c in (plain, scaled)]
    assert errors[1] < 0.9 * errors[0], errors


def test_methods_that_do_not_declare_it_are_not_scaled():
    """Only a method whose declaration says ``scale_keys`` (TurboQuant) is scaled; affine and 8-bit keys are not."""
    keys, values = profiled_keys()
    assert filled(keys, values, method="affine", bits=4).key_scale is None
    assert filled(keys, values, method="turboquant", bits=4).key_scale is not None
    assert filled(keys, values, method="affine", bits=8).key_scale is None


@pytest.mark.parametrize("device_path", [False, True], ids=["parts", "dequantized"])
def test_chunked_prefill_of_a_scaled_layer_matches_token_by_token(device_path, monkeypatch):
    """The scales come from the tokens a token-by-token run holds at its first compression: chunks of 1, 16 and 320
    give the same attention (``dequantized``: the GPU's chunk path, on any device), centred and scaled at once.
    Measured: parts 7e-7 relative on the CPU (1.3e-4 on an H100, whose float16 sums round otherwise); dequantized
    1.3e-4 and 2.8e-4 (the same keys unscaled: 0.5e-4 and 1.5e-4; it sums in another order). A query left unscaled
    against scaled keys is off by about 0.1."""
    keys, values = profiled_keys()
    keys = keys + mx.zeros((D,)).at[40].add(60.0)  # an offset too: centred and scaled
    # float16 keys and values: a chunk's own tokens and the stored window are then the same numbers
    keys, values = keys.astype(mx.float16), values.astype(mx.float16)
    q = mx.random.normal((B, 2 * H, T, D), key=mx.random.key(9))
    if device_path:
        monkeypatch.setattr(KVQCache, "_prefill_on_device", gpu_chunk_rule)

    def run(chunk):
        cache = KVQCache(make_config("turboquant", bits=4, window=32, kernels="off").for_layer(0))
        rows = []
        for s in range(0, T, chunk):
            cache.update_and_fetch(keys[:, :, s : s + chunk], values[:, :, s : s + chunk])
            rows.append(cache.attend(q[:, :, s : s + chunk], D**-0.5))
        assert cache.key_scale is not None and cache.key_mean is not None
        return mx.concatenate(rows, axis=2)

    reference = run(1)
    for chunk in (16, T):
        assert relative(run(chunk), reference) < (1e-3 if device_path or mx.default_device() == mx.gpu else 1e-5), chunk


def test_scales_in_a_prompt_cache_file(tmp_path):
    """A file holds the scales; loading gives the same attention, and scales that are not powers of two, or of
    another shape, are refused as a corrupt file."""
    keys, values = profiled_keys()
    cache = filled(keys, values)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [cache])
    loaded = load_prompt_cache(path)[0]
    np.testing.assert_array_equal(np.array(loaded.key_scale), np.array(cache.key_scale))
    q = mx.random.normal((B, 2 * H, 1, D), key=mx.random.key(3))
    np.testing.assert_array_equal(np.array(loaded.attend(q, D**-0.5)), np.array(cache.attend(q, D**-0.5)))
    state = dict(cache.state)
    state["key_scale"] = state["key_scale"] * 1.5
    with pytest.raises(ValueError, match="key_scale holds values that are not positive powers of two"):
        KVQCache.from_state(state)
    state["key_scale"] = cache.key_scale[:, :1]
    with pytest.raises(ValueError, match=r"key_scale of shape \(1, 1, 1, 64\).*does not fit the layout"):
        KVQCache.from_state(state)


@pytest.mark.parametrize("loud", [[(0, 1), (), (0, 1)], [(), (), (0, 1)]], ids=["pack-scaled", "pack-plain"])
def test_scaled_and_plain_rows_pack_together(loud):
    """A scaled row or not, a plain one, and one whose first compression (scaled) comes during decode share a pack
    (the plain rows' scales are ones; with ``pack-plain`` the pack holds none until that compression): decoding
    matches the same rows unpacked, and the rows keep their own scales."""
    from kvq.cache import BatchKVQCache

    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(0)
    lengths = [40, 40, 14]  # the third row's window is not full yet: nothing compressed
    batches = []
    for _ in range(2):
        rows = []
        for i, (n, heads) in enumerate(zip(lengths, loud)):
            keys, values = profiled_keys(seed=i, heads=heads)
            row = KVQCache(config)
            row.update_and_fetch(keys[:, :, :n], values[:, :, :n])
            row.release_chunk()
            rows.append(row)
        batches.append(BatchKVQCache(rows))
    packed, plain = batches
    plain.pack = False
    assert [r.key_scale is not None for r in plain.rows] == [bool(loud[0]), False, False]
    profile = [mx.stack([mx.where(mx.arange(D) < LOUD, 4.0, 1.0) if h in heads else mx.ones((D,))
                         for h in range(H)])[:, None, :] for heads in loud]
    for step in range(12):
        k = mx.random.normal((3, H, 1, D), key=mx.random.key(100 + step)) * mx.stack(profile)
        v = mx.random.normal((3, H, 1, D), key=mx.random.key(200 + step))
        q = mx.random.normal((3, 2 * H, 1, D), key=mx.random.key(300 + step))
        outs = []
        for batch in (packed, plain):
            batch.update_and_fetch(k, v)
            outs.append(batch.attend(q, D**-0.5))
        np.testing.assert_allclose(np.array(outs[0]), np.array(outs[1]), atol=2e-5, rtol=1e-4)
    assert packed.packed
    assert [r.key_scale is not None for r in packed.rows] == [r.key_scale is not None for r in plain.rows] == \
        [bool(loud[0]), False, True]
    for ours, theirs in zip(packed.rows, plain.rows):
        if theirs.key_scale is not None:
            np.testing.assert_array_equal(np.array(ours.key_scale), np.array(theirs.key_scale))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [3, 4])
def test_a_scaled_layer_decodes_alike_through_the_fused_kernel(bits):
    """On a GPU a decode step attends sinks, window and compressed tokens in one fused kernel, from the scaled queries
    and the window divided by the scales (exact: powers of two): within 2e-3 of the parts merged in pure MLX from
    float32 queries, as a centred layer's (``test_outlier_layers``); a query left unscaled is off by about 0.1."""
    keys, values = (x.astype(mx.float16) for x in profiled_keys())
    q = mx.random.normal((B, 2 * H, 1, D), key=mx.random.key(3)).astype(mx.float16)

    def kept(cache):
        assert cache.key_scale is not None

    outs = fused_and_parts_decode("turboquant", bits, keys, values, q, kept)
    assert relative(outs["auto"], outs["float32"]) < 2e-3
    assert relative(outs["off"], outs["float32"]) < 2e-3


def test_packs_with_and_without_scales_extend_and_copy():
    """Packed rows with scales extended by packed rows without (and the other way round) keep each row's scales;
    a scaled cache that has attended deep-copies (mlx-lm copies caches for prompt reuse and batching)."""
    import copy

    from kvq.cache.packed import PackedRows

    config = make_config("turboquant", bits=4, window=12, flush=4, kernels="off").for_layer(0)

    def rows(heads_per_row):
        out = []
        for i, heads in enumerate(heads_per_row):
            keys, values = profiled_keys(seed=i, heads=heads)
            row = KVQCache(config)
            row.update_and_fetch(keys[:, :, :40], values[:, :, :40])
            row.release_chunk()
            out.append(row)
        return out

    for first, second in (([(0, 1), ()], [(), ()]), ([(), ()], [(0,), (0, 1)])):
        a, b = rows(first), rows(second)
        pack = PackedRows.pack(a)
        assert pack is not None and pack.extend(PackedRows.pack(b))
        for got, want in zip(pack.unpack(), a + b):
            assert (got.key_scale is None) == (want.key_scale is None)
            if want.key_scale is not None:
                np.testing.assert_array_equal(np.array(got.key_scale), np.array(want.key_scale))
    cache = rows([(0, 1)])[0]
    q = mx.random.normal((B, 2 * H, 1, D)).astype(mx.float16)
    cache.attend(q, D**-0.5)
    twin = copy.deepcopy(cache)
    np.testing.assert_array_equal(np.array(twin.attend(q, D**-0.5)), np.array(cache.attend(q, D**-0.5)))
