"""Prefill a prompt into caches without generating: what ``mlx_lm.cache_prompt`` does for mlx-lm's caches, for any
caches (kvq's or mlx-lm's), so that a prompt can be saved (:func:`kvq.save_prompt_cache`) and continued later."""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from .prefill import release_shared_mask

#: Tokens per forward pass: mlx-lm's ``prefill_step_size`` default (``generate_step``, ``cache_prompt``).
PREFILL_STEP = 2048


def prefill_prompt(model, cache: list, prompt: Sequence[int] | mx.array, *, step: int = PREFILL_STEP,
                   on_chunk: Callable[[int], None] | None = None) -> list:
    """Run ``prompt`` through ``model`` into ``cache``, ``step`` tokens per forward pass, as mlx-lm's
    ``generate_step`` prefills: each chunk's cache state is evaluated before the next, the logits never are (the
    vocabulary projection of a prompt is not computed), and MLX's buffer cache is emptied after each chunk, as
    ``generate_step`` does. A decode that starts with the prefill's temporaries still cached can wait for the device
    at every step on MLX's CUDA back end (32 sequences of 32K tokens on an H100: the next step's build took 20 ms
    against 2.5 ms once the cache was emptied; ``benchmarks/results/host/README.md``, where the leads in MLX's
    allocator are listed). Every token of ``prompt`` is stored (``generate_step`` keeps the last one back
    for its first decode step; here the cache ends at the prompt's end, as ``mlx_lm.cache_prompt`` leaves it), so
    ``cache[0].offset`` grows by ``len(prompt)``; an empty prompt changes nothing. What the chunks' layers shared
    (:func:`kvq.cache.prefill.release_shared_mask`) is dropped at the end, as no decode step may follow.

    Example (save a long document once, ask about it later)::

        cache = kvq.make_prompt_cache(model, "turboquant", bits=4)
        kvq.prefill_prompt(model, cache, tokenizer.encode(document))
        kvq.save_prompt_cache("document.safetensors", cache)

    :param model: an mlx-lm model. :param cache: one cache per layer (``kvq.make_prompt_cache``'s, or mlx-lm's).
    :param prompt: token ids: a sequence of ints, or a 1-D integer ``mx.array`` or numpy array.
    :param step: tokens per forward pass (>= 1).
    :param on_chunk: called after each chunk with the number of its tokens (a progress bar's update).
    :return: ``cache``.
    :raises ValueError: ``step`` below 1, or ``prompt`` not 1-D or not integers.
    :raises TypeError: ``prompt`` is text (a ``str`` or ``bytes``), not token ids.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an integer >= 1 (tokens per forward pass); got {step!r}")
    if isinstance(prompt, (str, bytes)):
        raise TypeError(f"prompt must be token ids, not text ({type(prompt).__name__}): encode it first, e.g. "
                        f"prefill_prompt(model, cache, tokenizer.encode(text))")
    if isinstance(prompt, mx.array):
        ids = prompt
    elif isinstance(prompt, np.ndarray):
        ids = mx.array(prompt)
    else:
        ids = mx.array(list(prompt), dtype=mx.int32)
    if ids.ndim != 1 or not mx.issubdtype(ids.dtype, mx.integer):
        raise ValueError(f"prompt must be a 1-D sequence of integer token ids; got shape {tuple(ids.shape)}, "
                         f"{ids.dtype}")
    for first in range(0, ids.size, step):
        model(ids[None, first : first + step], cache=cache)
        mx.eval([c.state for c in cache])
        mx.clear_cache()
        if on_chunk is not None:
            on_chunk(min(step, ids.size - first))
    release_shared_mask()
    return cache
