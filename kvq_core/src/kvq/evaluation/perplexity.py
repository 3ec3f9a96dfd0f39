"""Teacher-forced scoring of text windows, and the quality metrics against the reference run.

Protocol (../shared/REFERENCE_VALUES.md): a window of the text is ``context`` tokens, prefilled into the cache in
chunks of 512, and the ``score_tokens`` that follow are fed in one forward pass; the log-probabilities at those
positions score the tokens after each of them (teacher forcing). Metrics over all scored tokens of all windows:
perplexity, mean KL(reference || method) of the next-token distributions, and top-1 agreement.

A window starts as every text the model reads does: with the BOS token where the tokenizer adds one
(:func:`kvq.textdata.bos_ids`; Gemma 3, whose loss on a 512-token excerpt is 2.33 with it and 3.44 without), in
place of the window's first text token, so a window keeps ``context + score_tokens + 1`` tokens and the BOS, first of
the prefilled context, is never scored. SmolLM2's and Qwen2's tokenizers add none: their windows are unchanged.

Each scored token is seen as decoding would see it: a kvq cache gives every query of a chunk what a token-by-token
run would show it (the sinks, the tokens compressed by then, the newest ``window`` .. ``window + flush - 1``
uncompressed; :meth:`kvq.cache.KVQCache.attend`), so scoring 256 tokens in one forward pass equals scoring them
one at a time (KL below 1e-4, tests/test_prefill_chunks.py). Before kvq 0.1.0's chunk semantics (2026-12-01) a
chunk's queries read compressed copies of their own recent neighbours, which made scores worse than decoding's.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx.utils import tree_flatten


def state_arrays(cache: list) -> list[mx.array]:
    """Every array a list of caches holds (to evaluate them, as mlx-lm's prefill does)."""
    return [v for c in cache for _, v in tree_flatten(c.state) if isinstance(v, mx.array)]


def window_offsets(num_tokens: int, length: int, windows: int) -> list[int]:
    """Fixed, evenly spaced window starts: ``(i + 1) / (windows + 1)`` of the way through the usable text.

    :raises ValueError: the text has fewer than ``length`` tokens.
    """
    if num_tokens < length:
        raise ValueError(f"the text has {num_tokens} tokens; a window needs {length} (context + scored + 1)")
    return [(i + 1) * (num_tokens - length) // (windows + 1) for i in range(windows)]


def score(model, cache: list, ids: mx.array) -> mx.array:
    """Log-probabilities ``[T, vocab]`` (float32) after each token of ``ids``, in one forward pass."""
    logits = model(ids[None], cache=cache)[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    return logprobs


def token_metrics(reference: mx.array, logprobs: mx.array, targets: mx.array) -> dict[str, mx.array]:
    """Per scored token: negative log-likelihood, KL(reference || method) and top-1 agreement.

    :param reference: ``[T, vocab]`` log-probabilities of the reference run; ``logprobs`` the method's.
    :param targets: ``[T]`` the tokens that follow.
    """
    nll = -mx.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
    kl = (mx.exp(reference) * (reference - logprobs)).sum(axis=-1)
    agree = mx.argmax(reference, axis=-1) == mx.argmax(logprobs, axis=-1)
    return {"nll": nll, "kl": kl, "top1": agree}


def summarize(per_window: list[dict[str, mx.array]], reference_nll: list[mx.array]) -> dict:
    """Pooled metrics over windows: perplexity, its change vs the reference, mean KL, top-1 agreement."""
    nll = mx.concatenate([w["nll"] for w in per_window])
    ppl = math.exp(nll.mean().item())
    ref_ppl = math.exp(mx.concatenate(reference_nll).mean().item())
    return {
        "ppl": ppl,
        "ppl_change": ppl / ref_ppl - 1.0,
        "kl": mx.concatenate([w["kl"] for w in per_window]).mean().item(),
        "top1_agreement": mx.concatenate([w["top1"] for w in per_window]).astype(mx.float32).mean().item(),
        "ppl_per_window": [math.exp(w["nll"].mean().item()) for w in per_window],
    }
