"""Shared fixtures: a random generator, the tiny random llama, and registering fake plugins."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

import kvq

# the CLI's note for Linux CPUs without OpenBLAS (kvq.install_hints.blas_hint) would change what tests read on stderr
# depending on how pytest was started; tests/test_install_hints.py checks the note itself
os.environ["KVQ_NO_BLAS_HINT"] = "1"


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)


@pytest.fixture
def registered():
    """Register objects for one test: ``registered(obj, ...)``; they are unregistered afterwards."""
    added = []

    def add(*objs):
        for obj in objs:
            added.append(kvq.register(obj))
        return objs[0] if len(objs) == 1 else objs

    yield add
    for obj in reversed(added):
        kvq.unregister(obj)


@pytest.fixture
def no_model_work(monkeypatch):
    """Building or loading a model fails the test (for checks that must come before any model work)."""
    import kvq.models
    from kvq.bench import random_model

    def refuse(*args, **kwargs):
        raise AssertionError("model work started before the input was checked")

    monkeypatch.setattr(kvq.models, "load", refuse)
    monkeypatch.setattr(random_model, "build_random_model", refuse)


def has_gpu() -> bool:
    return mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())


def pytest_collection_modifyitems(config, items):
    if not has_gpu():
        skip = pytest.mark.skip(reason="needs an MLX GPU back end (Metal or CUDA)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if os.environ.get("KVQ_BIG_TESTS") != "1":
        skip = pytest.mark.skip(reason="downloads and converts a model of hundreds of MB: set KVQ_BIG_TESTS=1")
        for item in items:
            if "big" in item.keywords:
                item.add_marker(skip)


def config_folder(folder, **config):
    """``folder`` (created) holding only an mlx-lm ``config.json``: a llama with head_dim 64 and 1024 positions,
    ``config`` overriding it. No weights, so nothing may load it: for commands that must fail or decide before
    loading a model."""
    import json

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64,
        "max_position_embeddings": 1024, **config}))
    return folder


def gguf_block_weights(i: int, normal, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int) -> dict:
    """The attention and MLP tensors of GGUF block ``i`` of a llama-family model, named as llama.cpp writes them
    (norms left to the caller: each architecture has its own), each ``normal(*shape)``."""
    return {
        f"blk.{i}.attn_q.weight": normal(heads * head_dim, hidden),
        f"blk.{i}.attn_k.weight": normal(kv_heads * head_dim, hidden),
        f"blk.{i}.attn_v.weight": normal(kv_heads * head_dim, hidden),
        f"blk.{i}.attn_output.weight": normal(hidden, heads * head_dim),
        f"blk.{i}.ffn_gate.weight": normal(ffn, hidden),
        f"blk.{i}.ffn_up.weight": normal(ffn, hidden),
        f"blk.{i}.ffn_down.weight": normal(hidden, ffn),
    }


def tiny_llama(hidden=256, layers=2, heads=4, kv_heads=2, vocab=256, dtype=mx.float16, seed=0, head_dim=None):
    """A random llama from an mlx-lm config dict (no download); head_dim defaults to hidden // heads."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs.from_dict(dict(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=2 * hidden,
        num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5, vocab_size=vocab,
        rope_theta=10000.0, tie_word_embeddings=False, head_dim=head_dim))
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def llama_model():
    return tiny_llama()


def fake_kernel_class():
    """``FakeKernel``: a second implementation of ``affine`` (backend ``"fake-kernel"``) on every device, cheapest
    by the cost model, so only a measured table can rule it out (tests of selection, autotune, bench ops)."""
    from kvq.baselines.affine import AffineMLX

    class FakeKernel(AffineMLX):
        backend = "fake-kernel"

        def supports(self, problem):
            return True

        def cost(self, problem):
            return 0.0

    return FakeKernel


@pytest.fixture(scope="module")
def private_codebook_cache(tmp_path_factory):
    """Codebooks go to a temporary KVQ_CACHE_DIR, not the user's cache (``pytestmark = usefixtures(...)``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVQ_CACHE_DIR", str(tmp_path_factory.mktemp("kvq-cache")))
        yield


def unit_vectors(n, d, seed):
    """float32 ``[1, 1, n, d]`` random unit vectors (numpy's generator seeded with ``seed``)."""
    x = np.random.default_rng(seed).standard_normal((1, 1, n, d))
    return mx.array((x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32))


def reference_attention(q, k, v, scale, mask=None):
    """Textbook softmax attention with GQA head repetition: ``(out [B, H_q, T_q, D_v], lse [B, H_q, T_q])`` from
    uncompressed (or dequantized) ``k``, ``v`` ``[B, H_kv, T, D]``; ``mask`` boolean, True = may attend."""
    rep = q.shape[1] // k.shape[1]
    s = (q * scale) @ mx.repeat(k, rep, axis=1).swapaxes(-1, -2)
    if mask is not None:
        s = mx.where(mask, s, -mx.inf)
    return mx.softmax(s, axis=-1) @ mx.repeat(v, rep, axis=1), mx.logsumexp(s, axis=-1)


def batch_greedy(model, prompts, max_tokens: int, prefill_step_size: int = 16) -> list[list[int]]:
    """Greedy tokens for ``prompts`` (lists of token ids) generated together through mlx-lm's ``BatchGenerator``
    (the server's path: merge, extend, filter and extract of the model's caches), ``max_tokens`` each, in prompt
    order. Bounded: stops after ``10 * max_tokens`` steps whatever the generator does."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[], prefill_step_size=prefill_step_size,
                         sampler=lambda x: mx.argmax(x, -1))
    uids = gen.insert(prompts, [max_tokens] * len(prompts))
    got = {u: [] for u in uids}
    for _ in range(10 * max_tokens):
        responses = gen.next_generated()
        if not responses:
            break
        for r in responses:
            got[r.uid].append(int(r.token))
    gen.close()
    return [got[u] for u in uids]


def cache_state(cache, ring: bool = False) -> tuple:
    """A kvq cache's tokens as stored, as numpy: offset, sinks, compressed and window counts, the window's tokens
    (``None`` when empty) and each side's compressed codes and side data (``{}`` when empty); ``ring``: a rotating
    cache's ring read oldest first (its logical order, whatever slot the ring has wrapped to)."""
    def part(store):
        if not store.length:
            return {}
        if ring:
            return {k: np.array(a) for k, a in store.ordered().data.items()}
        return {k: np.array(a[:, :, : store.length]) for k, a in store.data.items()}

    window = tuple(np.array(a[:, :, : cache.window.length]) if cache.window.length else None
                   for a in (cache.window.keys, cache.window.values))
    return (cache.offset, cache.sinks.length, cache.compressed_keys.length, cache.window.length, window,
            part(cache.compressed_keys), part(cache.compressed_values))


def layer_held(cache) -> dict:
    """What a kvq layer decided and stored, as numpy (bfloat16 as float32, exactly): its methods and whether it is an
    outlier layer, offset, resident bytes, key mean and scales, each side's compressed fields, and the sinks' and
    window's tokens: the tests that compare a layer with one that stored the same tokens otherwise
    (:func:`assert_same_held`)."""
    def host(x):
        return np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)

    arrays = {f"{side}.{name}": host(value)
              for side, store in (("k", cache.compressed_keys), ("v", cache.compressed_values)) if store.length
              for name, value in store.view().data.items()}
    for name, (k, v) in (("sinks", cache.sinks.view()), ("window", cache.window.view())):
        if k is not None:
            arrays[name] = host(mx.concatenate([k, v], axis=-1))
    return {"method": cache.config.key_params.method,
            "values": cache.config.value_params.method, "outlier": cache.config.outlier_layer, "offset": cache.offset,
            "nbytes": cache.nbytes, "mean": None if cache.key_mean is None else np.array(cache.key_mean),
            "scale": None if cache.key_scale is None else np.array(cache.key_scale), **arrays}


def assert_same_held(ours: dict, theirs: dict) -> None:
    """Two :func:`layer_held` results are equal: every field, every array bit for bit."""
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(ours[name], value, err_msg=name)
        else:
            assert ours[name] == value, name


def same_state(a: tuple, b: tuple) -> bool:
    """Whether two :func:`cache_state` results are equal: counts, and every array bit for bit."""
    if a[:4] != b[:4]:
        return False
    for x, y in zip(a[4], b[4]):
        if (x is None) != (y is None) or (x is not None and not np.array_equal(x, y)):
            return False
    return all(p.keys() == q.keys() and all(np.array_equal(p[n], q[n]) for n in p) for p, q in zip(a[5:], b[5:]))


def fused_and_parts_decode(method: str, bits: int, keys, values, queries, kept) -> dict:
    """One decode step of ``queries`` (float16 ``[B, H_q, 1, D]``) over a layer that stored ``keys``/``values``
    (``window=32``), through the fused kernel (``"auto"``) and the pure-MLX parts (``"off"``), and the parts from
    float32 queries (``"float32"``, the reference), each float32. ``kept(cache)`` asserts what the layer must hold
    (a key mean, key scales); a GPU back end must serve the fused path. Skips where kvq_metal has no GPU."""
    kvq_metal = pytest.importorskip("kvq_metal")
    if kvq_metal.gpu_backend() is None:
        pytest.skip("no Metal or CUDA device")
    from kvq.cache import KVQCache, make_config

    scale = queries.shape[-1] ** -0.5
    outs = {}
    for kernels in ("auto", "off"):
        cache = KVQCache(make_config(method, bits=bits, window=32, kernels=kernels).for_layer(0))
        cache.update_and_fetch(keys, values)
        cache.release_chunk()
        kept(cache)
        if kernels == "auto":
            assert cache._fused_attend(queries, scale) is not None  # the fused path serves this layer
        outs[kernels] = cache.attend(queries, scale).astype(mx.float32)
        if kernels == "off":  # the parts merged in float32: the reference
            outs["float32"] = cache.attend(queries.astype(mx.float32), scale)
    return outs


def gpu_chunk_rule(self, queries) -> bool:
    """``KVQCache._prefill_on_device`` as a GPU answers it, its device check left out (``KVQCache._chunk_fused``):
    monkeypatched in, the CPU takes the GPU's chunk path (a decoded copy, one fused attention) wherever a GPU
    would, nothing compressed included."""
    return self._chunk_fused()
