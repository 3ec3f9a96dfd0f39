"""Real keys and values of a model: run it over text and record what every layer's KV cache receives.

The keys are recorded as the cache stores them (after RoPE), which is what ``quantize`` will see. Each sequence of
``seq_len`` tokens is a separate forward pass starting at position 0, through mlx-lm's own ``KVCache`` objects
passed as ``prompt_cache`` (read back up to their ``offset``); the language-model head is skipped when the model
exposes its decoder stack as ``model.model``.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
from tqdm.auto import tqdm


@attrs.frozen
class Recording:
    """Keys and values of every attention layer over the recorded tokens.

    :param keys: per layer, float32 ``[H_kv, N, D]`` (``N`` tokens from all sequences, concatenated).
    :param values: per layer, float32 ``[H_kv, N, D_v]``.
    :param layers: indices into ``model.layers`` of the recorded (plain ``KVCache``) layers; ``keys[j]`` belongs
        to layer ``layers[j]``.
    """

    keys: list
    values: list
    layers: tuple

    @property
    def num_tokens(self) -> int:
        """``N``."""
        return self.keys[0].shape[1] if self.keys else 0


def sequences(token_ids: list[int], seq_len: int, max_tokens: int | None = None) -> list[list[int]]:
    """Cut ``token_ids`` into consecutive sequences of ``seq_len`` tokens (a shorter last one is kept if it has at
    least 16 tokens), using at most ``max_tokens`` tokens.

    :raises ValueError: ``seq_len < 1``, or fewer than 16 tokens to use.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1; got {seq_len}")
    ids = token_ids[:max_tokens] if max_tokens else token_ids
    chunks = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    chunks = [c for c in chunks if len(c) >= min(16, seq_len)]
    if not chunks:
        raise ValueError(f"the text has {len(ids)} tokens; at least 16 are needed")
    return chunks


def record(model, token_ids: list[int], seq_len: int = 1024, max_tokens: int | None = None,
           progress: bool = True) -> Recording:
    """Run ``model`` over ``token_ids`` in sequences of ``seq_len`` tokens and record every layer's keys/values.

    :param model: an mlx-lm model (``model.layers``; float32 is fastest on CPU).
    :param token_ids: the tokenised text.
    :param max_tokens: use only the first ``max_tokens`` tokens (``None``: all).
    :param progress: show a tqdm bar over the sequences.
    :return: :class:`Recording` (float32 arrays, evaluated).
    :raises ValueError: too few tokens, or a model with no layer that uses a plain ``KVCache``.
    """
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    chunks = sequences(token_ids, seq_len, max_tokens)
    stack = getattr(model, "model", model)  # skip the vocabulary projection when we can
    keys, values, layers = None, None, ()
    for chunk in tqdm(chunks, desc="recording keys/values", unit="seq", disable=not progress):
        cache = make_prompt_cache(model)
        mx.eval(stack(mx.array(chunk)[None], cache=cache))
        if keys is None:
            layers = tuple(i for i, c in enumerate(cache) if type(c) is KVCache)
            if not layers:
                raise ValueError("the model has no attention layer with a plain KVCache to record")
            keys, values = [[] for _ in layers], [[] for _ in layers]
        for j, i in enumerate(layers):
            c = cache[i]  # its arrays are preallocated in steps: only the first ``offset`` tokens are real
            keys[j].append(c.keys[0, :, : c.offset].astype(mx.float32))
            values[j].append(c.values[0, :, : c.offset].astype(mx.float32))
    keys = [mx.concatenate(k, axis=1) for k in keys]
    values = [mx.concatenate(v, axis=1) for v in values]
    mx.eval(keys, values)
    return Recording(keys, values, layers)
