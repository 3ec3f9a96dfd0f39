"""Keys with constant offsets, unequal channels or one loud channel: centred, scaled or stored at 8 bits.

Some models' keys carry large constant offsets in a few channels (Qwen2.5: the k_proj bias, kept nearly constant
by slow RoPE frequencies; key norms near 280 in layer 0 against about 20 elsewhere). A quantizer's error scales
with the whole vector (TurboQuant normalises by the norm; affine's scales span the offsets), while attention sees
only what varies between keys: on Qwen2.5-Coder-0.5B-Instruct, turboquant:4 makes layer 0's attention output
136% wrong and affine:4 86%, against 10-25% in ordinary layers (issue #20, ``benchmarks/results/outliers``).

Three remedies, chosen per layer from the keys of the first block it compresses (the tokens a token-by-token run
holds at its first compression, so the choice does not depend on how a prompt was chunked):

- **Centring**: the layer stores ``k - mu`` for its compressed tokens, ``mu`` a per-channel mean of the block
  ``[B, H_kv, 1, D]`` (float32, kept with the cache and its files), and adds ``q . mu`` back to the compressed
  tokens' scores. Exact, not an approximation: a score's softmax is unchanged by a term every key shares, so
  attention is as if the keys were stored whole; only the quantization error shrinks, with the norm: a quantizer's
  error on each key grows with the whole vector (TurboQuant's with its norm), and is each key's own, so softmax
  does not cancel it. Qwen2.5's layers 1, 2, 4 and 8 go from 0.45-0.76 attention error at turboquant:4 to
  0.08-0.22, like ordinary layers; gemma-3-270m's global layers 5 and 11 from 0.19 and 0.13 to 0.10 and 0.05
  (turboquant:3: 0.40 and 0.64 to 0.19 and 0.14). The mean costs ``32 / T`` bits per key coordinate for ``T``
  tokens held (0.016 at 2K).

  The mean must stay the keys' mean for every token the layer will hold, and RoPE turns the keys' channel pairs
  with position (:mod:`kvq.cache.still`). Where the layer's RoPE is known (:attr:`CacheConfig.still_channels`, set
  by :func:`kvq.make_prompt_cache` from the model), ``mu`` keeps only the channels that turn less than half a
  radian over the layer's horizon, and the layer is centred when that mean holds at least
  :data:`STILL_CENTER_LIMIT` of the block's energy (:func:`offset_energy` of the still channels). Otherwise the
  whole mean is used, and only at :data:`CENTER_LIMIT` of the energy and above: an offset that large was, on every
  model measured, in slow channels, while smaller whole means drift (SmolLM2-135M's first-block means *add*
  energy to keys 4-8K tokens later, in all 30 layers: ``benchmarks/investigations/centring_drift.py``).
- **Channel scales** (a head whose key channels vary with very unequal energy: :func:`channel_spread` of the
  block less its own mean, at least :data:`SCALE_SPREAD_LIMIT`, for a method that declares ``scale_keys``:
  TurboQuant): the layer stores ``k / s`` and attends with ``q * s``, the same scores, with ``s`` per channel the
  fourth root of the block's mean square as stored, rounded to a power of two (:func:`key_scales`). A quantizer
  whose error is isotropic in the vector (TurboQuant after its rotation) gives scores an error that grows with
  ``|k|`` along every channel; dividing the loud channels down moves its error towards the channels the scores weigh
  less (the lead: ``benchmarks/investigations/key_channel_scaling.py``, ``benchmarks/results/key_scaling``). That
  holds for queries that do not favour the loud channels. A per-channel offset of the keys (a layer not centred)
  makes its channels loud too, but models' queries follow such offsets (on SmolLM2-135M the query and key channel
  energies correlate at 0.2-0.8 in most heads), so scaling them moved the error onto the channels the scores weigh
  most. The decision therefore reads only how the keys vary. Measured with ``kvq eval`` at 2K on the CPU, against
  mlx-lm's float32 KVCache, unscaled / scaled:
  - gemma-3-270m (q/k norms, head_dim 256; 11 of 18 layers scaled): turboquant:4 +1.8% / +0.9% PPL, KL 0.0063 /
    0.0036; turboquant:3 +5.9% / +2.5%.
  - SmolLM2-135M (one head of one layer): turboquant:4 KL 0.0056 / 0.0043, turboquant:3 0.022 / 0.019.

  An earlier rule judged the spread of the keys as stored. It scaled 29 of SmolLM2's 30 layers and raised their
  attention error by 17-22%.

  Rounding matters: only channels 4x louder or quieter than the head's geometric mean move. Scales left unrounded on
  every head took SmolLM2's turboquant:4 to +2.8% instead (a prototype). Powers of two also keep it exact for the
  uncompressed tokens: the fused kernels score them scaled and get the same products. The scales cost ``32 / T``
  bits per key coordinate, as the mean.
- **8 bits** (when, after centring, one channel of one head holds at least :data:`CONCENTRATION_LIMIT` of the keys'
  varying energy, :func:`channel_concentration`): an outlier layer. Qwen2.5's layer 0 (0.40; every other layer of
  Qwen2.5 and SmolLM2 at most 0.14) stays 0.90 wrong at turboquant:4 even centred. With
  ``CacheConfig.outlier_layers="upgrade"`` (the default) its keys and values are stored with affine 8-bit (values
  follow so the layer keeps one method and its fused kernels), with a warning naming the layer; ``"warn"`` only
  warns; ``"off"`` turns every remedy here off. The cost is in the bytes the cache reports and saves (the layer's
  parameters change), never hidden.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings

import attrs
import mlx.core as mx
import numpy as np

#: Share of the keys' energy in their whole per-channel mean at or above which a layer's keys are centred, where
#: the layer's still channels are unknown.
CENTER_LIMIT = 0.8
#: Share of the keys' energy in the mean of their still channels (:mod:`kvq.cache.still`) at or above which a layer's
#: keys are centred: the quantization error's energy falls by that share (0.16 bits at 0.2), for ``32 / T`` bits.
STILL_CENTER_LIMIT = 0.2
#: Share of the centred keys' energy in one channel of one head at or above which a layer is an outlier layer.
CONCENTRATION_LIMIT = 0.25
#: Key channel spread (:func:`channel_spread` of the first block's keys less their own per-channel mean over the
#: block: how they vary) of a head at or above which its keys are scaled (:func:`key_scales`). Measured per layer on
#: keys centred by their block mean (``benchmarks/investigations/key_channel_scaling.py``): gemma-3-270m's heads at
#: 1.5-3.5 gain (attention error 0.07-0.37 -> 0.05-0.13 at turboquant:4), heads at 1.05-1.35 (most of SmolLM2 and
#: Qwen2.5) gain nothing on average.
SCALE_SPREAD_LIMIT = 1.5
#: Tokens the first compressed block must hold for the checks (with fewer, ``1 / T`` of independent keys' energy is
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
    """A layer's keys carry outliers that the configured method cannot hold (see :mod:`kvq.cache.guard`)."""


def _finite32(keys: mx.array) -> mx.array:
    x = keys.astype(mx.float32)
    return mx.where(mx.isfinite(x), x, 0.0)


def offset_energy(keys: mx.array, channels: tuple[int, ...] | None = None) -> float:
    """The share of ``keys``' energy that is their per-channel mean over tokens: ``sum_h |mean_t k_h|^2 /
    sum_h mean_t |k_h|^2`` for ``keys`` ``[B, H_kv, T, D]`` (float32, non-finite values as 0); 0 for no tokens.
    1 means every key is the same vector; independent zero-mean keys give about ``1 / T``. With ``channels``, the
    mean's energy in those channels only (the whole keys' energy below the line)."""
    return 0.0 if keys.shape[2] == 0 else float(_offset_energy(keys, channels))


def _offset_energy(keys: mx.array, channels: tuple[int, ...] | None) -> mx.array:
    """:func:`offset_energy` as a float32 scalar array, not evaluated (``keys`` holds at least one token)."""
    x = _finite32(keys)
    mean = key_mean(keys, channels)
    total = mx.sum(mx.mean(mx.sum(x * x, axis=-1), axis=2))
    return mx.sum(mean * mean) / mx.maximum(total, 1e-30)


def key_mean(keys: mx.array, channels: tuple[int, ...] | None = None) -> mx.array:
    """The per-channel mean of ``keys`` ``[B, H_kv, T, D]`` over tokens: float32 ``[B, H_kv, 1, D]`` (non-finite
    values as 0); with ``channels``, zero outside them. :raises ValueError: no tokens."""
    if keys.shape[2] == 0:
        raise ValueError("keys: a mean needs at least one token")
    mean = mx.mean(_finite32(keys), axis=2, keepdims=True)
    if channels is None:
        return mean
    keep = np.zeros(keys.shape[-1], bool)
    keep[list(channels)] = True
    return mx.where(mx.array(keep), mean, 0.0)


def channel_concentration(keys: mx.array) -> float:
    """The largest share of one channel in the energy of ``keys`` ``[B, H_kv, T, D]`` once centred (their mean over
    tokens subtracted), over heads: ``max_h max_d sum_t c_hd^2 / sum_t |c_h|^2`` (float32; 0 for no tokens).
    ``1 / D`` when the varying energy is spread evenly; 1 when it is all in one channel."""
    return 0.0 if keys.shape[2] == 0 else float(_concentration(keys))


def _concentration(keys: mx.array) -> mx.array:
    """:func:`channel_concentration` as a float32 scalar array, not evaluated (``keys`` holds at least one token)."""
    centred = _varying(keys)
    per_channel = mx.sum(centred * centred, axis=(0, 2))  # [H_kv, D]
    share = mx.max(per_channel, axis=-1) / mx.maximum(mx.sum(per_channel, axis=-1), 1e-30)
    return mx.max(share)


def _varying(keys: mx.array) -> mx.array:
    """How ``keys`` ``[B, H_kv, T, D]`` vary: float32, less their per-channel mean over the block (:func:`key_mean`;
    non-finite values as 0). The outlier and scale checks read this, not the offsets."""
    return _finite32(keys) - key_mean(keys)


def channel_spread(keys: mx.array) -> mx.array:
    """How unequal the energy of ``keys`` ``[B, H_kv, T, D]`` is over channels, per row and head: ``D * sum_c E_c /
    (sum_c sqrt(E_c))^2``, ``E_c`` a channel's mean square over tokens (float32 ``[B, H_kv, 1, 1]``; non-finite
    values as 0). 1 where every channel holds the same energy, ``D`` where one holds it all."""
    energy = _channel_energy(keys)
    root = mx.sum(mx.sqrt(energy), axis=-1, keepdims=True)
    return energy.shape[-1] * mx.sum(energy, axis=-1, keepdims=True) / mx.maximum(root * root, 1e-30)


def _channel_energy(keys: mx.array) -> mx.array:
    """Each channel's mean square over tokens, float32 ``[B, H_kv, 1, D]``, at least ``1e-4`` of the head's mean
    channel (a silent channel is scaled as a quiet one, not divided by 0)."""
    x = _finite32(keys)
    energy = mx.mean(x * x, axis=2, keepdims=True)
    return mx.maximum(energy, 1e-4 * mx.mean(energy, axis=-1, keepdims=True) + 1e-30)


def key_scales(keys: mx.array) -> mx.array | None:
    """Per-channel scales of ``keys`` ``[B, H_kv, T, D]`` (a first block, centred where the layer is): float32
    ``[B, H_kv, 1, D]``, powers of two, ``E_c ** (1/4)`` over its geometric mean per head, rounded in ``log2``, for
    the heads whose keys *vary* with a :func:`channel_spread` (of the block less its per-channel mean over tokens) of
    at least :data:`SCALE_SPREAD_LIMIT`, and 1 for the others; ``None`` where no head is scaled. A per-channel offset
    alone scales nothing: queries follow such offsets (module docstring). Dividing keys by it leaves each channel
    with about the square root of its energy (SmoothQuant's migration, Xiao et al., arXiv 2211.10438, with alpha 1/2
    of the keys' own energy)."""
    heads = _scaled_heads(keys)
    return _scales(keys, heads) if bool(mx.any(heads)) else None


def _scaled_heads(keys: mx.array) -> mx.array:
    """Which heads of ``keys`` ``[B, H_kv, T, D]`` :func:`key_scales` scales: bool ``[B, H_kv, 1, 1]``, not evaluated.
    It reads the keys less their own per-channel mean, so keys centred by any per-channel mean give the same heads (up
    to float32 rounding)."""
    return channel_spread(_varying(keys)) >= SCALE_SPREAD_LIMIT


def _scales(keys: mx.array, heads: mx.array) -> mx.array:
    """:func:`key_scales` of ``keys`` for the scaled ``heads`` (:func:`_scaled_heads`), not evaluated."""
    root = mx.power(_channel_energy(keys), 0.25)
    root = root / mx.exp(mx.mean(mx.log(root), axis=-1, keepdims=True))
    return mx.where(heads, mx.power(2.0, mx.round(mx.log2(root))), 1.0).astype(mx.float32)


def scales_keys(params) -> bool:
    """Whether keys with ``params`` may be scaled (:func:`key_scales`): a guarded method (:func:`guarded`) whose
    declaration says ``scale_keys`` (:class:`kvq.Method`)."""
    if not guarded(params):
        return False
    from ..plugins import registry

    method = registry().methods.get(params.method)
    return bool(getattr(method, "scale_keys", False))


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
    """What a layer does about the keys ``[B, H_kv, T, D]`` of the first block it compresses: ``(config, mean,
    scales)``.

    ``mean`` is :func:`key_mean` (of ``config.still_channels`` where known) where the keys are to be centred
    (:func:`offset_energy` of those channels at least :data:`STILL_CENTER_LIMIT`; of the whole mean, without them,
    at least :data:`CENTER_LIMIT`), else ``None``; it is rounded to the keys' 16-bit dtype (float16 for float32 keys),
    so the sinks' and window's dtype holds it exactly (the fused kernels score those tokens centred in that dtype).
    ``config`` (a :class:`kvq.cache.CacheConfig`) is unchanged unless the layer is an outlier layer
    (:func:`channel_concentration` >= :data:`CONCENTRATION_LIMIT`); then an :class:`OutlierLayerWarning` naming
    the layer, ``outlier_layer`` set, and under ``"upgrade"`` both sides' parameters replaced by
    :func:`safe_params`. ``scales`` is :func:`key_scales` of the keys less ``mean`` where the (returned) key method
    may be scaled (:func:`scales_keys`), else ``None``. Nothing is done (``(config, None, None)``) under
    ``outlier_layers="off"``, for keys stored at 8 bits or more (:func:`guarded`), or for a block of fewer than
    :data:`MIN_TOKENS` tokens.

    The three decisions wait for the device once (the statistics evaluated together); a batch's rows wait once per
    layer for all of them (:class:`Batched`).
    """
    if config.outlier_layers == "off" or not guarded(config.key_params) or keys.shape[2] < MIN_TOKENS:
        return config, None, None
    still = config.still_channels
    limit = CENTER_LIMIT if still is None else STILL_CENTER_LIMIT
    stats = _statistics(config, keys)
    energy, share, heads = float(stats[0]), float(stats[1]), stats[2]
    mean = None
    if energy >= limit:
        mean = key_mean(keys, still).astype(mx.float16 if keys.dtype == mx.float32 else keys.dtype)
        mean = mean.astype(mx.float32)
    if share >= CONCENTRATION_LIMIT:
        config = _outlier_layer(config, share)
    scales = None
    if heads is not None and bool(stats[3]) and scales_keys(config.key_params):
        scales = _scales(keys if mean is None else _finite32(keys) - mean, heads)
    return config, mean, scales


def _statistics(config, keys: mx.array) -> list:
    """The first block's statistics :func:`guard_layer` decides on, evaluated: ``[offset energy, concentration,
    scaled heads or None, any head scaled or None]`` (float32 scalars, bool ``[B, H_kv, 1, 1]``, bool scalar). Waits
    for the device once, or not at all where a batch has evaluated them already (:class:`Batched`)."""
    if _BATCH.replay:
        shape, stats = _BATCH.replay.popleft()
        if shape != tuple(keys.shape):  # the rows replay in the order they stopped: anything else is a bug
            raise RuntimeError(f"kvq.cache.guard: a replayed first block {shape} is not this one {tuple(keys.shape)}")
        return stats
    heads = _scaled_heads(keys) if scales_keys(config.key_params) else None
    stats = [_offset_energy(keys, config.still_channels), _concentration(keys), heads,
             None if heads is None else mx.any(heads)]
    if _BATCH.collecting is not None:
        _BATCH.collecting.append((tuple(keys.shape), stats))
        raise Deferred
    mx.eval(*[x for x in stats if x is not None])  # the one wait (guard_layer's docstring)
    return stats


class Deferred(Exception):
    """Raised by :func:`guard_layer` inside :meth:`Batched.collect`: the row's first-block statistics are recorded
    and its update stops (its cache is left as it was: a chunk's update is undone when it raises)."""


class _Batch(threading.local):
    collecting: list | None = None  # statistics recorded by the rows stopped so far (inside Batched.collect)
    replay: collections.deque | None = None  # evaluated statistics, consumed in the order they were recorded


_BATCH = _Batch()


class Batched:
    """The first-block checks of a batch's rows, waiting for the device once for all of them
    (:class:`kvq.cache.BatchKVQCache`'s prefill; each wait stops the host from building ahead of the device, and a
    batch of ``B`` rows would otherwise wait ``B`` times per layer: ``benchmarks/results/batch/
    2026-12-06-prefill-guard``).

    Each row's chunk update runs inside :meth:`collect`: a row that reaches its first compression records its
    statistics there and stops (:class:`Deferred`), undone; the others finish. :meth:`replay` evaluates every
    recorded statistic in one ``mx.eval``; the stopped rows' updates then run again, in the same order, and each
    finds its statistics evaluated. The decisions are the ones each row makes alone: the statistics are computed
    from the same tokens. Only for updates that are undone when they raise (chunks of more than one token).
    """

    def __init__(self) -> None:
        self.recorded: list = []

    @contextlib.contextmanager
    def collect(self):
        """Within: :func:`guard_layer` records the statistics and raises :class:`Deferred`."""
        outer, _BATCH.collecting = _BATCH.collecting, self.recorded
        try:
            yield
        finally:
            _BATCH.collecting = outer

    @contextlib.contextmanager
    def replay(self):
        """Evaluate every recorded statistic at once; within, :func:`guard_layer` takes them in recorded order.
        :raises RuntimeError: a recorded statistic is left unused (a row did not replay what it recorded)."""
        mx.eval(*[x for _, stats in self.recorded for x in stats if x is not None])
        outer, _BATCH.replay = _BATCH.replay, collections.deque(self.recorded)
        try:
            yield
            if _BATCH.replay:
                raise RuntimeError(f"kvq.cache.guard: {len(_BATCH.replay)} recorded first blocks were not replayed")
        finally:
            _BATCH.replay = outer


def _outlier_layer(config, share: float):
    """``config`` for an outlier layer whose keys hold ``share`` of their varying energy in one channel: warns (an
    :class:`OutlierLayerWarning` naming the layer) and, under ``"upgrade"``, stores both sides with
    :func:`safe_params`."""
    layer = "a layer" if config.layer is None else f"layer {config.layer}"
    method = config.key_params.method + (f":{config.key_params.bits}" if hasattr(config.key_params, "bits") else "")
    found = (f"kvq: {layer}'s keys hold {share:.0%} of their varying energy in one channel (outlier channels, as "
             f"in Qwen2.5), which {method} keys cannot hold without breaking that layer's attention")
    if config.outlier_layers == "warn":
        warnings.warn(f"{found}; outlier_layers='upgrade' (the default) would store it with affine:8",
                      OutlierLayerWarning, stacklevel=4)
        return attrs.evolve(config, outlier_layer=True)
    warnings.warn(f"{found}: it is stored with {SAFE_METHOD}:{SAFE_BITS} (keys and values) instead; "
                  f"outlier_layers='off' keeps {method}", OutlierLayerWarning, stacklevel=4)
    safe = safe_params()
    return attrs.evolve(config, key_params=safe, value_params=safe, outlier_layer=True)
