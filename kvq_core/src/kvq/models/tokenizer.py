"""Rebuild a Hugging Face tokenizer (`tokenizer.json`, `tokenizer_config.json`) from a GGUF file's metadata.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are supported. The pre-tokenizer is chosen by
`tokenizer.ggml.pre`, following llama.cpp's table (llama-vocab.cpp), so that text splits exactly as it did for the
original Hugging Face tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from . import ModelError

# GGUF token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED ones are added but not special
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Llama 3's split pattern (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3)
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Qwen2's pattern (its tokenizer.json; llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2): Llama 3's with single digits
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
GPT2_FAMILY = ("gpt2", "gpt-2", "default")
# GPT-2's pattern after splitting every digit on its own (llama.cpp: STARCODER, REFACT, SMOLLM, CODESHELL)
DIGITS_FAMILY = ("smollm", "starcoder", "refact", "codeshell")
LLAMA3_FAMILY = ("llama-bpe", "llama3")
QWEN2_FAMILY = ("qwen2",)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The Hugging Face pre-tokenizer for llama.cpp's pre-tokenizer name `pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in GPT2_FAMILY:
        return byte_level
    if pre in DIGITS_FAMILY:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in LLAMA3_FAMILY + QWEN2_FAMILY:
        pattern = LLAMA3_PATTERN if pre in LLAMA3_FAMILY else QWEN2_PATTERN
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    known = ", ".join(GPT2_FAMILY + DIGITS_FAMILY + LLAMA3_FAMILY + QWEN2_FAMILY)
    raise ModelError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {known})")


def _post_processor(metadata: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """Byte-level offsets, plus a BOS token in front when the GGUF asks for one."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    if not metadata.get("tokenizer.ggml.add_bos_token", False):
        return byte_level
    bos = tokens[metadata["tokenizer.ggml.bos_token_id"]]
    template = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, metadata["tokenizer.ggml.bos_token_id"])],
    )
    return processors.Sequence([byte_level, template])


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """Build a byte-level BPE tokenizer from GGUF metadata.

    Args:
        metadata: GGUF key/value metadata as plain Python values (lists for arrays).

    Returns:
        A `tokenizers.Tokenizer` with the GGUF's vocabulary, merges and special tokens.

    Raises:
        ModelError: the vocabulary is not byte-level BPE, or its pre-tokenizer is unknown.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelError(f"unsupported GGUF tokenizer {kind!r} (only byte-level BPE, 'gpt2', is supported)")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    # llama.cpp splits a merge at the first space after its first character
    merges = [(m[: m.index(" ", 1)], m[m.index(" ", 1) + 1:]) for m in metadata["tokenizer.ggml.merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    if pre in QWEN2_FAMILY:
        tokenizer.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(metadata, tokens)
    # Special and user-defined tokens keep their vocabulary ids; they are matched before pre-tokenization
    types = list(metadata.get("tokenizer.ggml.token_type", []))
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types)
               if t == TOKEN_TYPE_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types)
            if t == TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)
    return tokenizer


def tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """The `tokenizer_config.json` contents: special tokens, chat template, maximum length.

    Args:
        metadata: GGUF key/value metadata as plain Python values.

    Returns:
        A JSON-serialisable dict for transformers' `PreTrainedTokenizerFast`.
    """
    tokens = metadata["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
    }
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[f"{role}_token"] = tokens[token_id]
    architecture = metadata.get("general.architecture", "")
    if f"{architecture}.context_length" in metadata:
        config["model_max_length"] = int(metadata[f"{architecture}.context_length"])
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def write_tokenizer(metadata: dict[str, Any], out_dir: Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out_dir`.

    Args:
        metadata: GGUF key/value metadata as plain Python values.
        out_dir: an existing folder.

    Raises:
        ModelError: the GGUF's tokenizer is not supported (see `build_tokenizer`).
    """
    build_tokenizer(metadata).save(str(out_dir / "tokenizer.json"))
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8") as file:
        json.dump(tokenizer_config(metadata), file, indent=2, ensure_ascii=False)
