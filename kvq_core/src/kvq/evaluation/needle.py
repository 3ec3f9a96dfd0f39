"""Needle retrieval: one fact hidden at a given depth of a long user message, asked for at its end.

The haystack is text of the evaluation (tokens taken at a window's offset); the needle "The secret code is
NNNN." goes in after the first sentence or line end at or past the depth, the question follows the haystack,
and the whole is wrapped in the model's chat template (plain text when the tokenizer has none), behind the BOS
token where the tokenizer adds one (and the template does not write it). The prompt is ``context`` tokens long.
The answer is generated greedily; it counts as a match when the first number in it is the code.
"""

from __future__ import annotations

import re

import mlx.core as mx

from ..cache.prompt import prefill_prompt

#: One code per trial, in order (4 digits, so that no code is a prefix of another).
CODES = ("4817", "2093", "7361", "5902", "3648", "8125", "6379", "1584")
QUESTION = "\n\nWhat is the secret code? Answer with the number only."
MAX_NEW_TOKENS = 12
#: How far past the requested depth the needle may move to land after a sentence or line end.
SNAP_TOKENS = 64


def chat_parts(tokenizer) -> tuple[str, str]:
    """Text before and after the user's message in the model's chat template (with the generation prompt)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return "", "\nAnswer:"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], add_generation_prompt=True,
                                         tokenize=False)
    head, tail = text.split("\x00")
    return head, tail


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _snap(tokenizer, hay: list[int], position: int) -> int:
    """The first position at or after ``position`` that follows a sentence or line end (or ``position``)."""
    for i in range(max(position, 1), min(position + SNAP_TOKENS, len(hay))):
        if tokenizer.decode([hay[i - 1]]).rstrip(" ").endswith((".", "\n")):
            return i
    return position


def needle_prompt(tokenizer, text_ids: list[int], context: int, depth: float, code: str,
                  bos: list[int] = ()) -> list[int]:
    """Token ids of one trial: BOS, chat head, haystack with the needle at ``depth`` (0..1), question, chat tail.

    :param text_ids: tokens of the text to take the haystack from (at least ``context`` of them).
    :param bos: the tokens the tokenizer puts in front of a text (:func:`kvq.textdata.bos_ids`); left out where the
        chat template writes them itself.
    :return: a prompt of ``context`` tokens (the haystack is cut to fit).
    """
    head, tail = chat_parts(tokenizer)
    head_ids, question_ids = _encode(tokenizer, head), _encode(tokenizer, QUESTION + tail)
    if head_ids[: len(bos)] != list(bos):
        head_ids = list(bos) + head_ids
    needle_ids = _encode(tokenizer, f" The secret code is {code}. ")
    size = context - len(head_ids) - len(question_ids) - len(needle_ids)
    if size < 1:
        raise ValueError(f"needle: a context of {context} tokens leaves no room for a haystack")
    hay = text_ids[:size]
    at = _snap(tokenizer, hay, int(depth * size))
    return head_ids + hay[:at] + needle_ids + hay[at:] + question_ids


def greedy_answer(model, cache, prompt: list[int], chunk: int, eos: set[int]) -> list[int]:
    """Prefill ``prompt[:-1]`` in chunks, then decode greedily from its last token (at most 12 new tokens)."""
    ids = mx.array(prompt)
    prefill_prompt(model, cache, ids[:-1], step=chunk)
    token, out = ids[-1:], []
    for _ in range(MAX_NEW_TOKENS):
        logits = model(token[None], cache=cache)
        token = mx.argmax(logits[0, -1:], axis=-1)
        out.append(token.item())
        if out[-1] in eos:
            break
    return out


def is_match(answer: str, code: str) -> bool:
    """True when the first number in ``answer`` is ``code``."""
    number = re.search(r"\d+", answer)
    return number is not None and number.group() == code
