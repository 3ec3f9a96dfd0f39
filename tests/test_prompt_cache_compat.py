"""Prompt-cache files written before the attention engine (kvq at bc13595) load and decode as a fresh run does.

``tests/data/prompt_cache_bc13595_{plain,rotating}.safetensors`` were written by kvq at commit bc13595 (the last
commit before issue #49's move) for the tiny random llama of ``conftest.tiny_llama()``: a 60-token prompt fed in
chunks of 16 to turboquant:3 caches (2 sinks, window 8, flush 8), plain and with ``max_kv_size=40`` (rotating
caches whose rings have wrapped). Today's kvq must read them, hold what a fresh cache fed the same chunks holds, and
decode the same greedy tokens.

Loading itself is exact on any machine: saved again, every stored tensor is the file's, bit for bit. The fresh run
agrees to the rounding of the machine that runs the model, not bit for bit: the keys and values of layers after the
first come out of the model's own forward pass, whose float16 results MLX's CPU kernels round differently on
different CPUs. On an AMD EPYC (2026-12-06) the fresh run differed from the file in one window value by one float16
ulp, one code word (of 576) or one norm, and the logits by 0.002 (of about 1.8), while the counts, the other codes
and the greedy tokens were the same. So against the fresh run the counts are exact, floats agree to a few ulps, at
most 2% of the code words may differ, and the logits agree to 1e-2.
"""

from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np
import pytest

from kvq.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from conftest import cache_state, tiny_llama

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _greedy(model, cache, logits, steps=3):
    out = []
    for _ in range(steps):
        token = mx.argmax(logits[-1])
        logits.append(model(token.reshape(1, 1), cache=cache)[0, -1].astype(mx.float32))
        out.append(int(token))
    return out


@pytest.mark.parametrize("name, kw", [("plain", {}), ("rotating", {"max_kv_size": 40})])
def test_a_file_written_before_the_engine_loads_and_decodes_as_a_fresh_run(model, name, kw):
    prompt = mx.array([(7 * i + 3) % 256 for i in range(60)])[None]
    fresh = make_prompt_cache(model, "turboquant", bits=3, sinks=2, window=8, flush=8, **kw)
    for c in fresh:  # the guard as bc13595 had it (no still channels: kvq.cache.still came later, issue #53)
        c.config = attrs.evolve(c.config, still_channels=None)
    for a in range(0, 60, 16):
        last = model(prompt[:, a : a + 16], cache=fresh)[0, -1].astype(mx.float32)
    loaded, metadata = load_prompt_cache(str(DATA / f"prompt_cache_bc13595_{name}.safetensors"),
                                         return_metadata=True)
    assert metadata["written_by"].startswith("kvq bc13595")
    assert [type(c) for c in loaded] == [type(c) for c in fresh]
    ring = name == "rotating"
    for a, b in zip(loaded, fresh):
        _assert_close_state(cache_state(a, ring), cache_state(b, ring))
    want_logits, got_logits = [last], [last]
    want = _greedy(model, fresh, want_logits)
    got = _greedy(model, loaded, got_logits)
    assert got == want
    for a, b in zip(got_logits, want_logits):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=0, atol=1e-2)


@pytest.mark.parametrize("name", ["plain", "rotating"])
def test_a_file_written_before_the_engine_keeps_every_tensor_through_a_load(tmp_path, name):
    """Loaded and saved again, the file holds the same tensors, each bit for bit, but the layers' settings and
    checksums (their format has changed since bc13595)."""
    path = DATA / f"prompt_cache_bc13595_{name}.safetensors"
    save_prompt_cache(str(tmp_path / "again.safetensors"), load_prompt_cache(str(path)))
    before, after = mx.load(str(path)), mx.load(str(tmp_path / "again.safetensors"))
    assert before.keys() == after.keys()
    data = [k for k in before if not k.endswith((".config", ".checksum"))]
    assert len(data) >= 16 and any(k.endswith(".codes") for k in data)
    for key in data:
        assert before[key].dtype == after[key].dtype, key
        np.testing.assert_array_equal(np.array(before[key]), np.array(after[key]), err_msg=key)


def _assert_close_state(a: tuple, b: tuple) -> None:
    """Two :func:`conftest.cache_state` results: the same counts, float arrays within a few float16 ulps, and at
    most 2% of the packed code words different (the module docstring says why not bit for bit)."""
    assert a[:4] == b[:4]  # offset, sinks, compressed and window counts
    for x, y in zip(a[4], b[4]):
        assert (x is None) == (y is None)
        if x is not None:
            np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), rtol=4e-3, atol=4e-3)
    for p, q in zip(a[5:], b[5:]):
        assert p.keys() == q.keys()
        for name in p:
            assert p[name].shape == q[name].shape and p[name].dtype == q[name].dtype, name
            if np.issubdtype(p[name].dtype, np.floating):
                np.testing.assert_allclose(p[name].astype(np.float32), q[name].astype(np.float32), rtol=4e-3,
                                           atol=1e-4, err_msg=name)
            else:
                assert (p[name] != q[name]).mean() <= 0.02, (name, int((p[name] != q[name]).sum()))
