"""Layers whose keys no low-bit method survives: found from the first block a layer compresses, stored at 8 bits.

Some models' keys carry large constant offsets in a few channels (Qwen2.5: the k_proj bias, kept nearly constant
by slow RoPE frequencies; key norms near 280 in layer 0 against about 20 elsewhere). A quantizer's error scales
with the whole vector (TurboQuant normalises by the norm; affine's scales span the offsets), while attention sees
only what varies between keys: on Qwen2.5-Coder-0.5B-Instruct, turboquant:4 makes layer 0's attention output
136% wrong and affine:4 86%, against 10-25% in ordinary layers (issue #20, ``benchmarks/results/outliers``).

The sign is measurable from keys alone: the share of the keys' energy that is the per-channel mean over the
block's tokens (:func:`offset_energy`). In that model it is 0.95-1.00 in the broken layers (0, 1, 2, 4, 8) and
0.46-0.81 in the others; in SmolLM2-135M at most 0.76 (``benchmarks/results/outliers``). A layer at or above
:data:`OFFSET_ENERGY_LIMIT` is "an outlier layer": with ``CacheConfig.outlier_layers="upgrade"`` (the default)
its keys and values are stored with
affine 8-bit (8-bit keys keep Qwen2.5's perplexity within 1%; values follow so the layer keeps one method and its
fused kernels), with a warning naming the layer; ``"warn"`` only warns; ``"off"`` does neither. The cost is in
the bytes the cache reports and saves (the layer's parameters change), never hidden.
"""

from __future__ import annotations

import warnings

import attrs
import mlx.core as mx

#: Share of the keys' energy in their per-channel mean at or above which a layer is an outlier layer.
OFFSET_ENERGY_LIMIT = 0.9
#: Tokens the first compressed block must hold for the check (with fewer, ``1 / T`` of independent keys' energy is
#: their mean already: a window + flush below this leaves the layer unchecked).
MIN_TOKENS = 16
#: ``CacheConfig.outlier_layers`` values.
POLICIES = ("upgrade", "warn", "off")
#: What an outlier layer is stored with under ``"upgrade"``.
SAFE_METHOD, SAFE_BITS = "affine", 8


def check_policy(policy) -> str:
    """:raises ValueError: ``policy`` (``outlier_layers``) not one of :data:`POLICIES` (named with the allowed
    values)."""
    if policy not in POLICIES:
        raise ValueError(f"outlier_layers must be one of {', '.join(POLICIES)}; got {policy!r}")
    return policy


class OutlierLayerWarning(UserWarning):
    """A layer's keys carry offsets that the configured method cannot hold (see :mod:`kvq.cache.guard`)."""


def offset_energy(keys: mx.array) -> float:
    """The share of ``keys``' energy that is their per-channel mean over tokens: ``sum_h |mean_t k_h|^2 /
    sum_h mean_t |k_h|^2`` for ``keys`` ``[B, H_kv, T, D]`` (float32, non-finite values as 0); 0 for no tokens.
    1 means every key is the same vector; independent zero-mean keys give about ``1 / T``."""
    if keys.shape[2] == 0:
        return 0.0
    x = keys.astype(mx.float32)
    x = mx.where(mx.isfinite(x), x, 0.0)
    mean = mx.mean(x, axis=2)
    total = mx.sum(mx.mean(mx.sum(x * x, axis=-1), axis=2))
    return float(mx.sum(mean * mean) / mx.maximum(total, 1e-30))


def guarded(params) -> bool:
    """Whether the guard applies to keys with ``params``: a method below 8 bits (``bits`` under 8, or no
    ``bits`` at all, as QJL's sketch); not to ``fp16`` or 8-bit affine."""
    if params.method == "fp16":
        return False
    bits = getattr(params, "bits", None)
    return bits is None or bits < SAFE_BITS


def safe_params():
    """The parameters an outlier layer is stored with: affine 8-bit, group size chosen from head_dim."""
    from ..plugins import registry

    return registry().method(SAFE_METHOD).make_params(bits=SAFE_BITS)


def guard_layer(config, keys: mx.array):
    """``config`` (a :class:`kvq.cache.CacheConfig`) after checking the keys of the first block its layer
    compresses: unchanged unless the layer is an outlier layer and ``config.outlier_layers`` is not ``"off"``;
    then an :class:`OutlierLayerWarning` naming the layer, ``outlier_layer`` set, and under ``"upgrade"`` both
    sides' parameters replaced by :func:`safe_params`. A block of fewer than :data:`MIN_TOKENS` tokens is not
    checked."""
    if config.outlier_layers == "off" or not guarded(config.key_params) or keys.shape[2] < MIN_TOKENS:
        return config
    share = offset_energy(keys)
    if share < OFFSET_ENERGY_LIMIT:
        return config
    layer = "a layer" if config.layer is None else f"layer {config.layer}"
    method = config.key_params.method + (f":{config.key_params.bits}" if hasattr(config.key_params, "bits") else "")
    found = (f"kvq: {layer}'s keys hold {share:.0%} of their energy in constant per-channel offsets (outlier "
             f"channels, as in Qwen2.5), which {method} keys cannot hold without breaking that layer's attention")
    if config.outlier_layers == "warn":
        warnings.warn(f"{found}; outlier_layers='upgrade' (the default) would store it with affine:8",
                      OutlierLayerWarning, stacklevel=3)
        return attrs.evolve(config, outlier_layer=True)
    warnings.warn(f"{found}: it is stored with {SAFE_METHOD}:{SAFE_BITS} (keys and values) instead; "
                  f"outlier_layers='off' keeps {method}", OutlierLayerWarning, stacklevel=3)
    safe = safe_params()
    return attrs.evolve(config, key_params=safe, value_params=safe, outlier_layer=True)
