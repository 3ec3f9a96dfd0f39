"""Prompt-cache files (issue #24, items 9 and 10): kvq.save_prompt_cache writes checksums, and both loaders
(kvq.load_prompt_cache and mlx-lm's own, through KVQCache.from_state) refuse a damaged file with one clear error
and never change it; files without checksums still load; ``import kvq`` changes nothing of mlx-lm's, and after
``kvq.register_with_mlx_lm()`` mlx-lm's loader reads them."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache

import kvq
from kvq.cache import BatchKVQCache, KVQCache, make_prompt_cache, patch, state

PROMPT = mx.array([(7 * i + 3) % 256 for i in range(120)])


def greedy(model, cache, prompt=PROMPT, n=6):
    gen = generate_step(prompt, model, max_tokens=n, prompt_cache=cache, sampler=lambda x: mx.argmax(x, -1),
                        prefill_step_size=48)
    return [int(t) for t, _ in gen]


def tensors(path: Path) -> dict[str, tuple[int, int]]:
    """Byte range ``[start, end)`` in the file of every tensor of a safetensors file (its header: an 8-byte
    little-endian length, then JSON with each tensor's ``data_offsets`` from the end of the header)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    return {name: (8 + length + entry["data_offsets"][0], 8 + length + entry["data_offsets"][1])
            for name, entry in header.items() if name != "__metadata__"}


def damaged(path: Path, start: int, count: int, into: Path) -> Path:
    """A copy of ``path`` with ``count`` bytes from ``start`` zeroed (or set to 0xA5 where they were zeros, so the
    bytes always change)."""
    data = bytearray(path.read_bytes())
    old = bytes(data[start : start + count])
    data[start : start + count] = bytes(len(old)) if any(old) else b"\xa5" * len(old)
    assert data != path.read_bytes()
    into.write_bytes(data)
    return into


@pytest.fixture
def saved(llama_model, tmp_path):
    """``(file, cache, tokens)``: an affine-4 cache after a prompt and 6 generated tokens, saved by kvq (flush 32:
    the 120-token prompt then leaves compressed tokens, which the default flush of 128 would keep in the window)."""
    cache = make_prompt_cache(llama_model, "affine", bits=4, window=16, flush=32)
    tokens = greedy(llama_model, cache)
    file = tmp_path / "cache.safetensors"
    kvq.save_prompt_cache(str(file), cache, {"note": "kvq"})
    return file, cache, tokens


def continuation(model, cache, tokens):
    return greedy(model, cache, mx.array(tokens[-1:]), n=6)


# -- item 9: integrity -------------------------------------------------------------------------------------
@pytest.mark.parametrize("loader", ["kvq", "mlx-lm"])
def test_an_untouched_file_loads_and_continues_bit_identically(llama_model, saved, loader):
    file, cache, tokens = saved
    if loader == "kvq":
        loaded, meta = kvq.load_prompt_cache(str(file), return_metadata=True)
        assert meta == {"note": "kvq"}  # kvq's checksum is not handed back as the caller's metadata
    else:
        loaded, meta = mlx_cache.load_prompt_cache(str(file), return_metadata=True)
        assert meta["note"] == "kvq"
    assert all(isinstance(c, KVQCache) for c in loaded)
    for a, b in zip(cache, loaded):
        ours, theirs = dict(tree_flatten(a.state)), dict(tree_flatten(b.state))
        assert ours.keys() == theirs.keys()
        for name, x in ours.items():
            y = theirs[name]
            assert x == y if not isinstance(x, mx.array) else mx.array_equal(x, y) and x.dtype == y.dtype, name
    assert continuation(llama_model, loaded, tokens) == continuation(llama_model, cache, tokens)


def test_1000_zeroed_bytes_in_the_tensor_data_are_refused_by_both_loaders(saved, tmp_path):
    """The issue's case: 1,000 bytes zeroed in the middle of the tensor data."""
    file = saved[0]
    spans = tensors(file)
    start, end = min(s for s, _ in spans.values()), max(e for _, e in spans.values())
    bad = damaged(file, (start + end) // 2 - 500, 1000, tmp_path / "bad.safetensors")
    before = bad.read_bytes()
    with pytest.raises(ValueError, match=rf"^{bad}: .*do not match the checksum saved with them: the file is "
                                         "corrupt"):
        kvq.load_prompt_cache(str(bad))
    with pytest.raises(ValueError, match="do not match the checksum saved with them: the file is corrupt"):
        mlx_cache.load_prompt_cache(str(bad))  # KVQCache.from_state checks its layer
    assert bad.read_bytes() == before  # the file itself is never modified


def test_damage_to_any_tensor_is_refused_by_both_loaders(saved, tmp_path):
    """Every tensor of the file in turn (codes, scales, sinks, window, the configuration string, the offset, the
    checksums themselves): up to 1,000 bytes inside it are damaged."""
    file = saved[0]
    spans = tensors(file)
    assert {"0.keys.codes", "0.config", "0.offset", "0.checksum", "1.window_values"} <= set(spans)
    for name, (start, end) in spans.items():
        count = min(1000, end - start)
        bad = damaged(file, start + (end - start - count) // 2, count, tmp_path / "bad.safetensors")
        before = bad.read_bytes()
        with pytest.raises(ValueError, match=rf"^{bad}: .*checksum") as error:
            kvq.load_prompt_cache(str(bad))
        assert "corrupt" in str(error.value), name
        with pytest.raises(ValueError):  # from_state, or mlx-lm's own decoding of a damaged string
            mlx_cache.load_prompt_cache(str(bad))
        assert bad.read_bytes() == before, name


@pytest.mark.parametrize("keep", ["4 bytes", "half the header", "the header", "all but the last byte"])
def test_a_truncated_file_is_refused_naming_the_file(saved, tmp_path, keep):
    file = saved[0]
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    size = {"4 bytes": 4, "half the header": 8 + length // 2, "the header": 8 + length,
            "all but the last byte": len(data) - 1}[keep]
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:size])
    with pytest.raises(ValueError, match=rf"^{cut}: not a prompt-cache file that loads: it cannot be read "
                                         r"\(truncated or damaged\?\)"):
        kvq.load_prompt_cache(str(cut))
    assert cut.read_bytes() == data[:size]


@pytest.mark.parametrize("old, new", [('"0.note":"kvq"', '"0.note":"kvX"'), ('"KVQCache"', '"KVQCachf"')])
def test_changed_metadata_is_refused(saved, tmp_path, old, new):
    """The metadata (the caller's, the class names, how scalars are stored) is covered too."""
    data = saved[0].read_bytes()
    assert data.count(old.encode()) >= 1
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data.replace(old.encode(), new.encode(), 1))
    with pytest.raises(ValueError, match=rf"^{bad}: .*checksum"):
        kvq.load_prompt_cache(str(bad))


def test_layers_that_are_not_kvqs_are_covered_by_the_files_checksum(llama_model, tmp_path):
    """A model's sliding-window layers keep mlx-lm's caches: kvq.load_prompt_cache checks them too (mlx-lm's own
    loader gives kvq no hook into other caches)."""
    cache = [make_prompt_cache(llama_model, "affine", bits=4, window=16)[0], mlx_cache.KVCache()]
    tokens = greedy(llama_model, cache)
    file = tmp_path / "mixed.safetensors"
    kvq.save_prompt_cache(str(file), cache)
    loaded = kvq.load_prompt_cache(str(file))
    assert [type(c) for c in loaded] == [KVQCache, mlx_cache.KVCache]
    assert continuation(llama_model, loaded, tokens) == continuation(llama_model, cache, tokens)
    start, end = tensors(file)["1.0"]  # the KVCache's keys
    bad = damaged(file, (start + end) // 2, 1000, tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match=rf"^{bad}: .*checksum"):
        kvq.load_prompt_cache(str(bad))


def test_batch_caches_carry_a_checksum_per_row(llama_model, tmp_path):
    rows = [make_prompt_cache(llama_model, "affine", bits=8, window=8, flush=8) for _ in range(2)]  # codes in both
    for i, row in enumerate(rows):
        greedy(llama_model, row, PROMPT[: 40 + 30 * i], n=2)
    batch = [BatchKVQCache.merge([a, b]) for a, b in zip(*rows)]
    file = tmp_path / "batch.safetensors"
    kvq.save_prompt_cache(str(file), batch)
    for loaded in (kvq.load_prompt_cache(str(file)), mlx_cache.load_prompt_cache(str(file))):
        assert [[r.offset for r in c.rows] for c in loaded] == [[r.offset for r in c.rows] for c in batch]
    start, end = tensors(file)["0.rows.1.keys.codes"]
    bad = damaged(file, start, min(1000, end - start), tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="checksum"):
        mlx_cache.load_prompt_cache(str(bad))


def test_bfloat16_caches_round_trip_and_are_checked(tmp_path):
    from conftest import tiny_llama

    model = tiny_llama(dtype=mx.bfloat16)
    cache = make_prompt_cache(model, "affine", bits=4, window=16)
    tokens = greedy(model, cache)
    assert cache[0].window_keys.dtype == mx.bfloat16
    file = tmp_path / "bf16.safetensors"
    kvq.save_prompt_cache(str(file), cache)
    loaded = mlx_cache.load_prompt_cache(str(file))
    assert continuation(model, loaded, tokens) == continuation(model, cache, tokens)
    start, end = tensors(file)["0.window_keys"]
    bad = damaged(file, start, min(1000, end - start), tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="checksum"):
        mlx_cache.load_prompt_cache(str(bad))


def test_files_saved_without_checksums_still_load(llama_model, tmp_path):
    """mlx-lm's save_prompt_cache (and kvq before it wrote checksums) stores none: such files load with both
    loaders, unchecked."""
    cache = make_prompt_cache(llama_model, "affine", bits=4, window=16)
    tokens = greedy(llama_model, cache)
    file = tmp_path / "plain.safetensors"
    mlx_cache.save_prompt_cache(str(file), cache, {"note": "mlx-lm"})
    assert not any(name.endswith("checksum") for name in tensors(file))
    want = continuation(llama_model, cache, tokens)
    for loaded in (kvq.load_prompt_cache(str(file)), mlx_cache.load_prompt_cache(str(file))):
        assert continuation(llama_model, loaded, tokens) == want


def test_expect_refuses_a_file_of_mlx_lms_own_caches(llama_model, tmp_path):
    """``expect=`` asks for kvq layers of a method: a file of mlx-lm's KVCaches holds none and is refused (it
    passed: every kvq layer matched, there being none)."""
    from mlx_lm.models.cache import KVCache

    cache = [KVCache() for _ in llama_model.layers]
    greedy(llama_model, cache, n=2)
    file = tmp_path / "mlx.safetensors"
    mlx_cache.save_prompt_cache(str(file), cache)
    with pytest.raises(ValueError, match=r"mlx.safetensors: holds no kvq cache layer \(KVCache\)"):
        kvq.load_prompt_cache(str(file), expect=kvq.cache.make_config("turboquant", bits=4))
    assert len(kvq.load_prompt_cache(str(file))) == len(cache)  # without expect= it loads


def test_checksums_are_computed_on_save_and_load_only(llama_model, saved, monkeypatch):
    """Generation evaluates every cache's state each prefill chunk: nothing there may hash."""
    file, cache, tokens = saved
    loaded = kvq.load_prompt_cache(str(file))

    def refuse(array):
        raise AssertionError("hashed on the decode path")

    monkeypatch.setattr(state, "array_digest", refuse)
    greedy(llama_model, loaded, PROMPT[:100], n=4)
    greedy(llama_model, make_prompt_cache(llama_model, "affine", bits=4), n=4)


def test_missing_file_and_reserved_metadata_key(saved, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        kvq.load_prompt_cache(str(tmp_path / "nowhere.safetensors"))
    with pytest.raises(IsADirectoryError, match="is a directory"):  # not "does not exist" (a new user's path)
        kvq.load_prompt_cache(str(tmp_path))
    with pytest.raises(ValueError, match="'kvq_checksum' is kvq's"):
        kvq.save_prompt_cache(str(tmp_path / "x.safetensors"), saved[1], {"kvq_checksum": "mine"})
    with pytest.raises(ValueError, match="metadata: safetensors stores strings only .*'turn': 1"):
        kvq.save_prompt_cache(str(tmp_path / "x.safetensors"), saved[1], {"turn": 1})


def test_a_name_saved_without_its_suffix_loads_by_the_same_name(saved, tmp_path):
    """save_prompt_cache("chat", ...) writes chat.safetensors (as mlx-lm's does); load_prompt_cache("chat") reads
    it (a new user's round trip had failed with "does not exist")."""
    cache = saved[1]
    kvq.save_prompt_cache(str(tmp_path / "chat"), cache, {"note": "bare"})
    assert (tmp_path / "chat.safetensors").is_file() and not (tmp_path / "chat").exists()
    loaded, metadata = kvq.load_prompt_cache(str(tmp_path / "chat"), return_metadata=True)
    assert metadata == {"note": "bare"} and len(loaded) == len(cache)
    mine, theirs = dict(tree_flatten(loaded[0].state)), dict(tree_flatten(cache[0].state))
    assert mine.keys() == theirs.keys()
    assert all(mx.array_equal(v, theirs[k]).item() for k, v in mine.items() if isinstance(v, mx.array))


# -- item 10: mlx-lm's loader in a fresh process (issue #50: after the documented call, not an import hook) ----
FRESH = """
import sys
{first}
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache, llama

mx.random.seed(0)  # tests/conftest.py's tiny_llama()
args = llama.ModelArgs.from_dict(dict(model_type="llama", hidden_size=256, num_hidden_layers=2,
    intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
    rope_theta=10000.0, tie_word_embeddings=False, head_dim=None))
model = llama.Model(args)
model.set_dtype(mx.float16)
loaded = mlx_cache.load_prompt_cache(sys.argv[1])
gen = generate_step(mx.array([int(sys.argv[2])]), model, max_tokens=6, prompt_cache=loaded,
                    sampler=lambda x: mx.argmax(x, -1), prefill_step_size=48)
print([type(c).__name__ for c in loaded], [int(t) for t, _ in gen])
"""


REGISTER = "import kvq\nkvq.register_with_mlx_lm()"


@pytest.mark.parametrize("first", [REGISTER, "import mlx_lm\n" + REGISTER])
@pytest.mark.parametrize("saver", ["kvq", "mlx-lm"])
def test_mlx_lms_loader_reads_kvq_files_after_register_with_mlx_lm(llama_model, saved, tmp_path, first, saver):
    """A fresh process that only ran ``kvq.register_with_mlx_lm()`` (before or after importing mlx-lm): mlx-lm's
    load_prompt_cache finds kvq's classes, and generation from the loaded caches runs through kvq's attention
    (mlx-lm's would get the caches' stand-ins and fail) and continues exactly as the original cache does."""
    file, cache, tokens = saved
    if saver == "mlx-lm":
        file = tmp_path / "plain.safetensors"
        mlx_cache.save_prompt_cache(str(file), cache)
    want = continuation(llama_model, cache, tokens)
    done = subprocess.run([sys.executable, "-c", FRESH.format(first=first), str(file), str(tokens[-1])],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"['KVQCache', 'KVQCache'] {want}"


def test_kvq_cache_is_an_attribute_and_import_kvq_stays_light():
    code = ("import sys, kvq\nprint('mlx_lm' in sys.modules, 'kvq.cache' in sys.modules)\n"
            "print(kvq.cache.__name__, kvq.cache.make_config is kvq.cache.make_config, kvq.models.__name__, "
            "kvq.distributed.__name__)\n"
            "import mlx_lm.models.cache as c\nprint(hasattr(c, 'KVQCache'))\n"
            "kvq.register_with_mlx_lm()\nprint(c.KVQCache is kvq.KVQCache, c.BatchKVQCache.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["False False", "kvq.cache True kvq.models kvq.distributed", "False",
                                "True kvq.cache.batch"]


IMPORT_ONLY = """
import sys
{before}
finders = list(sys.meta_path)
import kvq
assert sys.meta_path == finders, (finders, sys.meta_path)
import kvq.cache  # imports mlx-lm, whose transformers adds a finder of its own
import mlx_lm.models.cache as mlx_cache
assert not [f for f in sys.meta_path if type(f).__module__.startswith("kvq")], sys.meta_path
assert sys.meta_path == finders or not {before!r}, (finders, sys.meta_path)
assert not [n for n in ("KVQCache", "RotatingKVQCache", "BatchKVQCache") if hasattr(mlx_cache, n)]
from mlx_lm.models import base, llama
assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention  # attention not patched
assert mlx_cache.make_prompt_cache.__module__ == "mlx_lm.models.cache", mlx_cache.make_prompt_cache
try:
    mlx_cache.load_prompt_cache(sys.argv[1])
except KeyError as error:  # mlx-lm looks the class name up in its globals
    print("refused:", error)
kvq.register_with_mlx_lm()
kvq.register_with_mlx_lm()  # idempotent
print([type(c).__name__ for c in mlx_cache.load_prompt_cache(sys.argv[1])])
"""


@pytest.mark.parametrize("before", ["", "import mlx_lm.models.cache"])
def test_import_kvq_changes_nothing_of_mlx_lms_until_the_documented_call(saved, before):
    """Issue #50: ``import kvq`` and ``import kvq.cache`` (before or after mlx-lm's cache module) add no finder to
    ``sys.meta_path`` (transformers, imported by mlx-lm, adds its own) and set nothing in mlx-lm, whose loader
    cannot read a kvq file then; ``kvq.register_with_mlx_lm()`` (twice) lets it."""
    done = subprocess.run([sys.executable, "-c", IMPORT_ONLY.format(before=before), str(saved[0])],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-3000:]
    refused, loaded = done.stdout.strip().splitlines()
    assert refused.startswith("refused:") and "KVQCache" in refused
    assert loaded == "['KVQCache', 'KVQCache']"


def test_patch_state_after_load_is_kvqs(llama_model, saved):
    """mlx-lm's loader gives kvq one moment to route attention: KVQCache.from_state patches the loaded models."""
    patch.unpatch()
    try:
        mlx_cache.load_prompt_cache(str(saved[0]))
        assert patch.is_patched("mlx_lm.models.llama")
    finally:
        patch.patch()


def test_a_file_of_a_method_not_installed_says_its_plugin_is_needed(llama_model, tmp_path):
    """A prompt-cache file written with a plugin's method, loaded where the plugin is absent: the error says the
    plugin must be installed or registered (before: only "method must be one of ...; got 'absmax8'")."""
    import importlib

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples" / "kvq-example-plugin" / "src"))
    try:
        example = importlib.import_module("kvq_example_plugin")
    finally:
        sys.path.pop(0)
    if "absmax8" in kvq.registry().methods:
        pytest.skip("the example plugin is installed in this environment")
    kvq.register(example)
    try:
        cache = make_prompt_cache(llama_model, "absmax8", sinks=0, window=0, flush=1)
        greedy(llama_model, cache, n=2)
        kvq.save_prompt_cache(str(tmp_path / "absmax8.safetensors"), cache)
    finally:
        kvq.unregister(example)
    with pytest.raises(ValueError, match=r"got 'absmax8'; the plugin that wrote it must be installed \(or "
                                         r"kvq.register-ed\) to load it"):
        kvq.load_prompt_cache(str(tmp_path / "absmax8.safetensors"))


def test_state_config_follows_the_cache_when_it_changes():
    """``state``'s configuration JSON is made once and reused (mlx-lm reads ``state`` after every chunk of every
    layer), yet always says what the cache holds now: its layout once tokens arrive, a replaced configuration (an
    outlier layer's upgrade replaces ``config``) at once."""
    import attrs

    cache = KVQCache(kvq.cache.make_config("turboquant", bits=3, window=8, flush=4))
    empty = cache.state["config"]
    assert json.loads(empty)["layout"] is None and cache.state["config"] is empty  # reused while nothing changed
    keys = mx.ones((1, 2, 3, 64), mx.float16)
    cache.update_and_fetch(keys, keys)
    assert json.loads(cache.state["config"])["layout"] == [1, 2, 64, 64, "float16"]
    cache.config = attrs.evolve(cache.config, window=16)
    assert json.loads(cache.state["config"])["window"] == 16


def test_prefill_prompt_saves_a_prompt_that_continues_as_a_generation_would(llama_model, tmp_path):
    """``kvq.prefill_prompt`` stores every token of the prompt (``cache_prompt``'s behaviour, not ``generate_step``'s,
    which keeps the last one back) in chunks; saved and loaded, the cache continues exactly as one that prefilled
    the prompt inside mlx-lm's ``generate_step``: the same greedy tokens after the same last prompt token. Bad
    arguments are refused by name."""
    prompt = [int(t) for t in PROMPT.tolist()]
    cache = make_prompt_cache(llama_model, "turboquant", bits=3, window=16, flush=32)
    assert kvq.prefill_prompt(llama_model, cache, prompt[:-1], step=48) is cache
    assert [c.offset for c in cache] == [len(prompt) - 1] * len(cache)
    file = tmp_path / "prompt.safetensors"
    kvq.save_prompt_cache(str(file), cache)
    loaded = kvq.load_prompt_cache(str(file))
    reference = make_prompt_cache(llama_model, "turboquant", bits=3, window=16, flush=32)
    assert greedy(llama_model, loaded, mx.array(prompt[-1:])) == greedy(llama_model, reference)
    seen = []
    numpy_ids = make_prompt_cache(llama_model, "affine")
    kvq.prefill_prompt(llama_model, numpy_ids, np.array(prompt), step=50, on_chunk=seen.append)
    assert seen == [50, 50, len(prompt) - 100] and numpy_ids[0].offset == len(prompt)
    offsets = [c.offset for c in cache]
    kvq.prefill_prompt(llama_model, cache, [])  # an empty prompt (kvq generate's of one token) changes nothing
    kvq.prefill_prompt(llama_model, cache, np.array([], np.int64))
    assert [c.offset for c in cache] == offsets
    for bad, match in ((dict(step=0), "step must be an integer >= 1"), (dict(prompt=[[1, 2]]), "1-D"),
                       (dict(prompt=mx.array([1.0, 2.0])), "integer token ids")):
        with pytest.raises(ValueError, match=match):
            kvq.prefill_prompt(llama_model, cache, **{"prompt": prompt, **bad})
    with pytest.raises(TypeError, match=r"prompt must be token ids, not text \(str\).*tokenizer.encode"):
        kvq.prefill_prompt(llama_model, cache, "hello world")  # a user's natural mistake: MLX's own error named no argument
    assert [c.offset for c in cache] == offsets
