"""Text that every Python install has: the Python language reference (``pydoc_data.topics``).

It is kvq's default evaluation and calibration text, so results are reproducible on a machine with no network.
The protocol of ../shared/REFERENCE_VALUES.md: topics sorted by key, joined by blank lines.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def language_reference() -> str:
    """The Python language reference text: ``pydoc_data.topics`` topics sorted by key, joined by blank lines.

    :return: about 0.9 MB of English text (its length depends on the Python version).
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def encode_text(tokenizer, text: str, special_tokens: bool = False) -> list[int]:
    """Token ids of ``text``, for texts longer than the model's context on purpose (evaluation and benchmark
    windows and calibration sequences are cut from them): transformers' warning that the sequence exceeds the
    model's maximum length, which would read as an error here, is silenced for this call only.

    :param tokenizer: an mlx-lm tokenizer (``encode(text, add_special_tokens=...)``).
    :param special_tokens: add the tokenizer's special tokens (a BOS token) as ``tokenizer.encode(text)`` does.
    :return: the ids as a list of ints.
    """
    try:
        from transformers.utils import logging
    except ImportError:  # a tokenizer without transformers: nothing to silence
        return list(tokenizer.encode(text, add_special_tokens=special_tokens))
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        return list(tokenizer.encode(text, add_special_tokens=special_tokens))
    finally:
        logging.set_verbosity(level)


def bos_ids(tokenizer) -> list[int]:
    """The tokens the tokenizer puts in front of a text it encodes: ``[bos_token_id]`` where it adds a BOS token
    (Gemma's, Llama's), else ``[]`` (SmolLM2's and Qwen2's add none).

    Asked of the tokenizer by encoding a short text with and without special tokens, since that is what a user's
    prompt gets; transformers' ``add_bos_token`` attribute does not always say it (a tokenizer.json whose
    post-processor adds the BOS reports False).

    :param tokenizer: an mlx-lm tokenizer or a Hugging Face one.
    :return: one id, or none.
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    with_special = encode_text(tokenizer, "a", special_tokens=True)
    plain = encode_text(tokenizer, "a")
    adds = with_special[:1] == [bos] and plain[:1] != [bos]
    return [int(bos)] if adds else []
