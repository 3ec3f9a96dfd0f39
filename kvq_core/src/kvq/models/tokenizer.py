"""Rebuild a Hugging Face tokenizer (`tokenizer.json`, `tokenizer_config.json`) from a GGUF file's metadata.

Two kinds of vocabulary are supported:

- byte-level BPE (`tokenizer.ggml.model == "gpt2"`): the pre-tokenizer is chosen by `tokenizer.ggml.pre`, following
  llama.cpp's table (llama-vocab.cpp), so that text splits exactly as it did for the original Hugging Face tokenizer;
- SentencePiece BPE (`"llama"`: pieces, scores and token types, as Gemma's): rebuilt as the BPE that transformers'
  SentencePiece converters write (convert_slow_tokenizer.py, GemmaConverter): merges derived from the scores,
  spaces as `▁`, unknown characters as `<0xNN>` byte tokens (byte fallback).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from . import ModelError

# GGUF token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED ones are added but not special
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
# SentencePiece's whitespace symbol (U+2581)
SPM_SPACE = "\u2581"

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


def _post_processor(metadata: dict[str, Any], tokens: list[str],
                    first: processors.PostProcessor | None = None) -> processors.PostProcessor | None:
    """`first` (byte-level offsets, or None), plus a BOS token in front when the GGUF asks for one."""
    if not metadata.get("tokenizer.ggml.add_bos_token", False):
        return first
    bos = tokens[metadata["tokenizer.ggml.bos_token_id"]]
    template = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, metadata["tokenizer.ggml.bos_token_id"])],
    )
    return template if first is None else processors.Sequence([first, template])


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Add CONTROL tokens as special and USER_DEFINED ones as ordinary added tokens, keeping their vocabulary ids;
    both are matched in the raw text before normalisation and pre-tokenisation."""
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types)
               if t == TOKEN_TYPE_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types)
            if t == TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """Build a BPE tokenizer from GGUF metadata: byte-level BPE, or SentencePiece BPE.

    Args:
        metadata: GGUF key/value metadata as plain Python values (lists for arrays).

    Returns:
        A `tokenizers.Tokenizer` with the GGUF's vocabulary, merges and special tokens.

    Raises:
        ModelError: the vocabulary is neither byte-level BPE nor SentencePiece BPE, or its pre-tokenizer is unknown.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "llama":
        return build_spm_tokenizer(metadata)
    if kind != "gpt2":
        raise ModelError(f"unsupported GGUF tokenizer {kind!r} (supported: byte-level BPE 'gpt2', SentencePiece "
                         "BPE 'llama')")
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
    tokenizer.post_processor = _post_processor(metadata, tokens, processors.ByteLevel(trim_offsets=False))
    _add_special_tokens(tokenizer, tokens, list(metadata.get("tokenizer.ggml.token_type", [])))
    return tokenizer


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The BPE merges of a SentencePiece BPE vocabulary, best first.

    SentencePiece's BPE stores no merges: it repeatedly joins the adjacent pair whose concatenation is the
    highest-scoring normal piece. Its equivalent merge list (as transformers' `generate_merges` derives it) holds
    (left, right) for every way of cutting a normal piece into two normal pieces, ranked by the joined piece's score,
    highest first; among the cuts of one piece, by the pieces' ids.

    Args:
        tokens, scores, types: the GGUF's `tokenizer.ggml.tokens`, `.scores` and `.token_type`, one entry per id.

    Returns:
        (left, right) pairs in merge order.
    """
    vocab = {token: i for i, token in enumerate(tokens) if types[i] == TOKEN_TYPE_NORMAL}
    ranked = []
    for piece, index in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_spm_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """Build a Hugging Face BPE tokenizer equal to a GGUF's SentencePiece BPE vocabulary (Gemma's, Llama 2's).

    Spaces become `▁` (with a `▁` put in front of the text when `tokenizer.ggml.add_space_prefix` is true, as
    SentencePiece's add_dummy_prefix does; Gemma's GGUF says false), characters outside the vocabulary become their
    UTF-8 bytes' `<0xNN>` tokens, and the decoder reverses both.

    Args:
        metadata: GGUF key/value metadata as plain Python values (lists for arrays).

    Returns:
        A `tokenizers.Tokenizer` with the GGUF's vocabulary, derived merges (:func:`spm_merges`) and special tokens.
    """
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type", [TOKEN_TYPE_NORMAL] * len(tokens)))
    merges = spm_merges(tokens, list(metadata["tokenizer.ggml.scores"]), types)
    unknown = metadata.get("tokenizer.ggml.unknown_token_id")
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None if unknown is None else tokens[unknown],
                                     fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", SPM_SPACE)]
    decode = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if metadata.get("tokenizer.ggml.add_space_prefix", True):  # SentencePiece's default, llama.cpp's too
        steps.insert(0, normalizers.Prepend(SPM_SPACE))
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.normalizer = normalizers.Sequence(steps) if len(steps) > 1 else steps[0]
    tokenizer.decoder = decoders.Sequence(decode)
    tokenizer.post_processor = _post_processor(metadata, tokens)
    _add_special_tokens(tokenizer, tokens, types)
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
