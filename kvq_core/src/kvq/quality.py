"""How close a compressed cache stays to the reference (mlx-lm's KVCache), and how many bytes it really holds.

Shared by ``kvq generate``, ``kvq demo`` and evaluation code:

* :func:`teacher_forced_logprobs`: next-token log-probabilities of a model with a given cache along a fixed token
  sequence (the reference cache's greedy output), one decode step per token, as generation would run them;
* :func:`kl_divergence` and :func:`compare_to_reference`: KL(reference || method) and top-1 agreement on those
  same tokens;
* :func:`settle`, :func:`cache_nbytes` and :func:`filled_cache_bytes`: bytes resident, measured with
  ``mx.get_active_memory`` (docs/DESIGN.md, "The cache": memory is measured, never inferred from byte sums).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence

import attrs
import mlx.core as mx
import numpy as np


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities over the last axis, computed in float32.

    :param logits: ``[..., V]`` float array of any float dtype.
    :return: float32 ``[..., V]``.
    """
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def kl_divergence(reference: mx.array | np.ndarray, other: mx.array | np.ndarray) -> np.ndarray:
    """KL(reference || other) in nats, per row, from log-probabilities.

    :param reference: ``[..., V]`` log-probabilities of the reference (mlx-lm's KVCache).
    :param other: ``[..., V]`` log-probabilities of the method under test, same shape.
    :return: float64 ``[...]`` array (>= 0 up to rounding).
    :raises ValueError: the shapes differ.
    """
    p, q = np.asarray(reference, np.float64), np.asarray(other, np.float64)
    if p.shape != q.shape:
        raise ValueError(f"log-probabilities of shape {p.shape} and {q.shape} cannot be compared")
    return np.sum(np.exp(p) * (p - q), axis=-1)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens that ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@attrs.frozen
class Comparison:
    """A method's next-token distributions against the reference's, on the reference's tokens.

    :param kl: KL(reference || method) in nats, one per generated position.
    :param agree: whether the method's top-1 token equals the reference's token, one per position.
    """

    kl: tuple[float, ...]
    agree: tuple[bool, ...]

    @property
    def mean_kl(self) -> float:
        """Mean KL over positions (nats); 0.0 for no positions."""
        return float(np.mean(self.kl)) if self.kl else 0.0

    @property
    def agreement(self) -> int:
        """Positions where the method's greedy choice is the reference's token."""
        return sum(self.agree)

    def __len__(self) -> int:
        return len(self.kl)


def teacher_forced_logprobs(model, cache: list, first_token: int, tokens: Sequence[int]) -> Iterator[mx.array]:
    """Log-probabilities of each token of ``tokens``, feeding the sequence one token per decode step.

    The cache must already hold the prompt except its last token, ``first_token``. Step ``i`` feeds
    ``first_token`` (``i = 0``) or ``tokens[i - 1]`` and yields the distribution that predicts ``tokens[i]``, so
    a compressed cache sees exactly what it would see while generating those tokens itself.

    :param model: an mlx-lm model. :param cache: its prompt cache (updated in place).
    :param tokens: the forced tokens (e.g. the reference cache's greedy output).
    :return: an iterator of evaluated float32 ``[V]`` log-probabilities, one per token of ``tokens``.
    """
    inputs = [first_token, *tokens[:-1]] if len(tokens) else []
    for token in inputs:
        logprobs = log_softmax(model(mx.array([[token]]), cache=cache)[0, -1])
        mx.eval(logprobs)
        yield logprobs


def compare_to_reference(model, cache: list, first_token: int, tokens: Sequence[int],
                         reference_logprobs: Sequence[np.ndarray]) -> Comparison:
    """Teacher-force ``tokens`` through ``cache`` and compare each step with the reference distribution.

    :param reference_logprobs: ``[V]`` log-probabilities of the reference at each position of ``tokens`` (the
        ones it chose ``tokens`` from, greedily).
    :return: :class:`Comparison` with one entry per token.
    :raises ValueError: ``reference_logprobs`` and ``tokens`` differ in length.
    """
    if len(reference_logprobs) != len(tokens):
        raise ValueError(f"{len(reference_logprobs)} reference distributions for {len(tokens)} tokens")
    kl, agree = [], []
    steps = teacher_forced_logprobs(model, cache, first_token, tokens)
    for token, reference, logprobs in zip(tokens, reference_logprobs, steps):
        kl.append(float(kl_divergence(reference, np.array(logprobs))))
        agree.append(int(mx.argmax(logprobs).item()) == token)
    return Comparison(tuple(kl), tuple(agree))


def settle() -> int:
    """Bytes of MLX arrays alive now (``mx.get_active_memory``), after collecting garbage.

    Run it before and after filling a cache, with nothing else allocated in between kept alive: the difference
    is what the cache holds. (MLX's buffer cache is emptied too, so that ``mx.get_cache_memory`` is 0 afterwards.)
    """
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    return mx.get_active_memory()


def cache_nbytes(cache: list) -> int:
    """Sum of the layers' ``nbytes`` (for kvq caches: codes, side data, sinks and window, as allocated)."""
    return sum(int(getattr(layer, "nbytes", 0)) for layer in cache)


def kv_layout(model) -> tuple[int, int, int]:
    """``(num_kv_heads, key_head_dim, value_head_dim)`` of an mlx-lm model, from ``model.args``; under tensor
    parallelism ``num_kv_heads`` is this rank's share (:func:`kvq.distributed.kv_head_range`).

    :raises ValueError: the model has no ``args`` with ``num_attention_heads`` (not an mlx-lm transformer).
    """
    from .distributed import kv_head_range

    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    if not heads:
        raise ValueError(f"cannot read the attention layout of {type(model).__name__} (no args.num_attention_heads)")
    shard = kv_head_range(model)
    kv_heads = (getattr(args, "num_key_value_heads", None) or heads) if shard is None else shard[1] - shard[0]
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    return kv_heads, head_dim, getattr(args, "v_head_dim", None) or head_dim


def filled_cache_bytes(model, num_tokens: int, method: str = "fp16", **cache_options) -> tuple[int, int]:
    """Bytes of a kvq cache for ``model`` holding ``num_tokens`` tokens, filled with zeros instead of running it.

    Sizes do not depend on the values stored, so this measures what a cache of that method would hold after a
    run of the same length (one batch row), without the cost of the run.

    :param method, cache_options: as :func:`kvq.make_prompt_cache` (default: every token in ``fp16``).
    :return: ``(nbytes, measured)``: the caches' ``nbytes`` and the growth of ``mx.get_active_memory``.
    :raises ValueError: as :func:`kvq.make_prompt_cache`, or :func:`kv_layout`.
    """
    from .cache import KVQCache, make_prompt_cache

    kv_heads, key_dim, value_dim = kv_layout(model)
    cache = make_prompt_cache(model, method, **cache_options)
    before = settle()
    for layer in cache:
        if isinstance(layer, KVQCache):
            keys = mx.zeros((1, kv_heads, num_tokens, key_dim), mx.float32)
            layer.update_and_fetch(keys, mx.zeros((1, kv_heads, num_tokens, value_dim), mx.float32))
            # no attention follows: drop what the update kept for the chunk's queries (its float32 tokens), which
            # the measured bytes counted (3x nbytes for an fp16 cache of 1156 tokens: kvq demo showed 8.8x)
            layer.release_chunk()
            mx.eval(layer.state)
            del keys
    measured = settle() - before
    return cache_nbytes(cache), measured
