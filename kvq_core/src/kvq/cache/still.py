"""The key channels that RoPE keeps still over a horizon: where a fixed key mean stays the keys' mean.

A centred layer (:mod:`kvq.cache.guard`) subtracts one mean, taken from the first block it compresses, from every
key it will ever compress. Keys reach the cache after RoPE, which turns each pair of channels by an angle that grows
with the position at the pair's own frequency: an offset in a fast pair averages out within the block, one in a
slow pair stays put for the whole context, and one in between moves away from the block's mean as the context
grows. Measured (``benchmarks/investigations/centring_drift.py``): on SmolLM2-135M (RoPE base 100,000, head_dim 64)
the first block's mean removes about half of the keys' energy near the block but *adds* energy from 4K tokens on
(ratios 0.96-1.54 in all 30 layers at 4-8K); on gemma-3-270m's global layers (base 1,000,000, head_dim 256) and
Qwen2.5's, the offsets sit in pairs that turn less than half a radian in 32K tokens.

:func:`still_channels` asks the layer's own RoPE module which channels turn less than :data:`MAX_ANGLE` between
position 0 and the horizon (the most tokens the layer can hold: a sliding-window layer's window, else the model's
context length), by rotating each channel's unit vector to both positions: any RoPE variant (traditional or not,
partial, scaled, YaRN) answers for itself, with no table of models. The guard then centres only those channels,
whose mean holds for every token the layer can hold.
"""

from __future__ import annotations

import math
import weakref

import mlx.core as mx
import numpy as np

from .model_args import head_dims

#: Largest angle (radians) a channel may turn between position 0 and the horizon to count as still: a mean turned
#: by ``a`` leaves ``2 (1 - cos a)`` of its energy, 0.24 at 0.5 rad (the mean still removes three quarters).
MAX_ANGLE = 0.5
#: Horizon of a layer whose model does not say its context length.
DEFAULT_HORIZON = 131072


def still_channels(rope, head_dim: int, horizon: int) -> tuple[int, ...] | None:
    """The channels of ``head_dim``-wide keys that ``rope`` turns by at most :data:`MAX_ANGLE` between position 0 and
    position ``horizon``, ascending; ``None`` where ``rope`` cannot be probed (no RoPE module, or one that does not
    take ``rope(x [B, H, L, D], offset=int)``).

    :param rope: the attention's RoPE module (mlx-lm's ``self_attn.rope``), or ``None``.
    :param horizon: positions (tokens) the layer can hold, >= 1.
    """
    if rope is None or not callable(rope):
        return None
    basis = mx.eye(head_dim, dtype=mx.float32)[None, :, None, :]  # [1, D, 1, D]: channel c's unit vector as head c
    # positions 1, 2, 4, ... and the horizon: an angle read at one position alone is known only modulo 2 pi (a fast
    # pair can land near a whole turn); doubling from 1, each read <= MAX_ANGLE bounds the next below pi
    positions = [1 << k for k in range(max(1, int(horizon)).bit_length()) if 1 << k < horizon] + [int(horizon)]
    try:
        start = rope(basis, offset=0)
        still = np.ones(head_dim, bool)
        for position in positions:
            end = rope(basis, offset=position)
            cos = mx.sum(start * end, axis=-1) / mx.maximum(
                mx.linalg.norm(start, axis=-1) * mx.linalg.norm(end, axis=-1), 1e-30)
            cos = np.array(cos.astype(mx.float32)).reshape(-1)
            if cos.shape != (head_dim,) or not np.all(np.isfinite(cos)):
                return None
            still &= cos >= math.cos(MAX_ANGLE)
    except Exception:  # a RoPE of another signature: centring falls back to the whole mean (guard.CENTER_LIMIT)
        return None
    return tuple(int(c) for c in np.nonzero(still)[0])


def layer_still_channels(model, horizons: list[int | None]) -> list[tuple[int, ...] | None]:
    """:func:`still_channels` of each layer of an mlx-lm ``model`` (``model.layers[i].self_attn.rope``, head_dim from
    ``model.args``), over its horizon in ``horizons``: an int (a sliding window's size, ``max_kv_size``), ``0`` for
    the model's context length (``args.max_position_embeddings``, else :data:`DEFAULT_HORIZON`), ``None`` for a
    layer not asked about. ``None`` for a layer whose RoPE or head_dim is not found, and for every layer where the
    model's layers and ``horizons`` do not pair up. Asked once per model and horizons while the model lives (each
    layer's probe is about 20 small RoPE calls read back to the host)."""
    key = (id(model), tuple(horizons))
    if key in _FOUND:  # a server makes caches for every request: the model's RoPE is probed once
        return list(_FOUND[key])
    found = _probe_layers(model, horizons)
    try:
        weakref.finalize(model, _forget, id(model))  # a later model at the same address starts afresh
    except TypeError:
        return found
    _FOUND[key] = tuple(found)
    return found


#: :func:`layer_still_channels`' answers, by ``(id(model), horizons)`` while the model lives.
_FOUND: dict[tuple, tuple] = {}


def _forget(model_id: int) -> None:
    for key in [k for k in _FOUND if k[0] == model_id]:
        del _FOUND[key]


def _probe_layers(model, horizons: list[int | None]) -> list[tuple[int, ...] | None]:
    layers = getattr(model, "layers", None)
    args = getattr(model, "args", None)
    if layers is None or len(layers) != len(horizons):
        return [None] * len(horizons)
    head_dim = (head_dims(model) or (None,))[0]
    context = getattr(args, "max_position_embeddings", None) or DEFAULT_HORIZON
    found = []
    for layer, horizon in zip(layers, horizons):
        rope = getattr(getattr(layer, "self_attn", None), "rope", None)
        usable = horizon is not None and head_dim and rope is not None
        found.append(still_channels(rope, head_dim, horizon or context) if usable else None)
    return found
