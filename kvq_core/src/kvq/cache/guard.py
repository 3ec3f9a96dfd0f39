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

The rule is :func:`first_block` (device arrays, for ``R`` layers' blocks at once: one layer's is ``R = 1``).
:func:`guard_layer` waits for them; a prefill chunk's first compression does not (:func:`decide_ahead`, settled by
:func:`settle` when the chunk attends: :meth:`kvq.cache.KVQCache.settle`), and the rows of a batch that start a
prefill together decide theirs in one graph (:func:`decide_ahead_rows`, :class:`SharedFirstBlocks`).
"""

from __future__ import annotations

import functools
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


class _Finite:
    """First blocks of keys as the statistics read them, ``[R, B, H_kv, T, D]``: ``R`` layers' blocks (rows of a
    batch, each a layer of its own; 1 for one layer), decided apart, each part made once: ``x`` float32 with
    non-finite values as 0, ``whole`` its per-channel mean over tokens (float32 ``[R, B, H_kv, 1, D]``), ``varying``
    (made when first read) ``x`` less ``whole``. Built op by op, a first block's statistics made the same float32
    copy ten times: 213 graph nodes a layer for the host to build and the device to run (issue #51); a batch's rows
    had their own graph each (:func:`decide_ahead_rows`)."""

    def __init__(self, blocks: mx.array) -> None:
        self.x = _finite32(blocks)
        self.whole = mx.mean(self.x, axis=-2, keepdims=True)

    @functools.cached_property
    def varying(self) -> mx.array:
        """How the keys vary: ``x`` less its per-channel mean over the block. The outlier and scale checks read this,
        not the offsets."""
        return self.x - self.whole

    def mean(self, channels: tuple[int, ...] | None) -> mx.array:
        """:func:`key_mean` of the block."""
        return _masked(self.whole, channels)


def _masked(mean: mx.array, channels: tuple[int, ...] | None) -> mx.array:
    """``mean`` ``[..., D]`` with zeros outside ``channels`` (all of it where ``None``)."""
    if channels is None:
        return mean
    keep = np.zeros(mean.shape[-1], bool)
    keep[list(channels)] = True
    return mx.where(mx.array(keep), mean, 0.0)


def offset_energy(keys: mx.array, channels: tuple[int, ...] | None = None) -> float:
    """The share of ``keys``' energy that is their per-channel mean over tokens: ``sum_h |mean_t k_h|^2 /
    sum_h mean_t |k_h|^2`` for ``keys`` ``[B, H_kv, T, D]`` (float32, non-finite values as 0); 0 for no tokens.
    1 means every key is the same vector; independent zero-mean keys give about ``1 / T``. With ``channels``, the
    mean's energy in those channels only (the whole keys' energy below the line)."""
    if keys.shape[2] == 0:
        return 0.0
    block = _Finite(keys[None])
    return _energy_share(block.x, block.mean(channels)).item()


def _energy_share(x: mx.array, mean: mx.array) -> mx.array:
    """:func:`offset_energy` of each of ``R`` blocks of finite float32 keys ``x`` ``[R, B, H_kv, T, D]`` with their
    (masked) mean ``[R, B, H_kv, 1, D]``: float32 ``[R]``, not evaluated."""
    total = mx.sum(mx.mean(mx.sum(x * x, axis=-1), axis=-1), axis=(1, 2))
    return mx.sum(mean * mean, axis=(1, 2, 3, 4)) / mx.maximum(total, 1e-30)


def key_mean(keys: mx.array, channels: tuple[int, ...] | None = None) -> mx.array:
    """The per-channel mean of ``keys`` ``[B, H_kv, T, D]`` over tokens: float32 ``[B, H_kv, 1, D]`` (non-finite
    values as 0); with ``channels``, zero outside them. :raises ValueError: no tokens."""
    if keys.shape[2] == 0:
        raise ValueError("keys: a mean needs at least one token")
    return _masked(mx.mean(_finite32(keys), axis=2, keepdims=True), channels)


def channel_concentration(keys: mx.array) -> float:
    """The largest share of one channel in the energy of ``keys`` ``[B, H_kv, T, D]`` once centred (their mean over
    tokens subtracted), over heads: ``max_h max_d sum_t c_hd^2 / sum_t |c_h|^2`` (float32; 0 for no tokens).
    ``1 / D`` when the varying energy is spread evenly; 1 when it is all in one channel."""
    return 0.0 if keys.shape[2] == 0 else _concentration(_Finite(keys[None]).varying).item()


def _concentration(varying: mx.array) -> mx.array:
    """:func:`channel_concentration` of each of ``R`` blocks, from their :attr:`_Finite.varying` ``[R, B, H_kv, T,
    D]``: float32 ``[R]``, not evaluated."""
    per_channel = mx.sum(varying * varying, axis=(1, 3))  # [R, H_kv, D]
    share = mx.max(per_channel, axis=-1) / mx.maximum(mx.sum(per_channel, axis=-1), 1e-30)
    return mx.max(share, axis=-1)


def channel_spread(keys: mx.array) -> mx.array:
    """How unequal the energy of ``keys`` ``[B, H_kv, T, D]`` is over channels, per row and head: ``D * sum_c E_c /
    (sum_c sqrt(E_c))^2``, ``E_c`` a channel's mean square over tokens (float32 ``[B, H_kv, 1, 1]``; non-finite
    values as 0). 1 where every channel holds the same energy, ``D`` where one holds it all."""
    return _spread(_channel_energy(_finite32(keys)))


def _spread(energy: mx.array) -> mx.array:
    """:func:`channel_spread` of channel energies ``[..., B, H_kv, 1, D]`` (:func:`_channel_energy`; any leading
    axes): ``[..., B, H_kv, 1, 1]``."""
    root = mx.sum(mx.sqrt(energy), axis=-1, keepdims=True)
    return energy.shape[-1] * mx.sum(energy, axis=-1, keepdims=True) / mx.maximum(root * root, 1e-30)


def _channel_energy(x: mx.array) -> mx.array:
    """Each channel's mean square over tokens of finite float32 keys ``x`` ``[..., B, H_kv, T, D]`` (:func:`_finite32`;
    any leading axes), float32 ``[..., B, H_kv, 1, D]``, at least ``1e-4`` of the head's mean channel (a silent
    channel is scaled as a quiet one, not divided by 0)."""
    energy = mx.mean(x * x, axis=-2, keepdims=True)
    return mx.maximum(energy, 1e-4 * mx.mean(energy, axis=-1, keepdims=True) + 1e-30)


def key_scales(keys: mx.array) -> mx.array | None:
    """Per-channel scales of ``keys`` ``[B, H_kv, T, D]`` (a first block, centred where the layer is): float32
    ``[B, H_kv, 1, D]``, powers of two, ``E_c ** (1/4)`` over its geometric mean per head, rounded in ``log2``, for
    the heads whose keys *vary* with a :func:`channel_spread` (of the block less its per-channel mean over tokens) of
    at least :data:`SCALE_SPREAD_LIMIT`, and 1 for the others; ``None`` where no head is scaled. A per-channel offset
    alone scales nothing: queries follow such offsets (module docstring). Dividing keys by it leaves each channel
    with about the square root of its energy (SmoothQuant's migration, Xiao et al., arXiv 2211.10438, with alpha 1/2
    of the keys' own energy)."""
    block = _Finite(keys[None])
    heads = _scaled_heads(block.varying)
    return _scales(block.x, heads)[0] if bool(mx.any(heads)) else None


def _scaled_heads(varying: mx.array) -> mx.array:
    """Which heads of a block :func:`key_scales` scales, from its :attr:`_Finite.varying` (``[..., B, H_kv, T, D]``:
    any leading axes): bool ``[..., B, H_kv, 1, 1]``, not evaluated. It reads the keys less their own per-channel
    mean, so keys centred by any per-channel mean give the same heads (up to float32 rounding)."""
    return _spread(_channel_energy(_finite32(varying))) >= SCALE_SPREAD_LIMIT


def _scales(x: mx.array, heads: mx.array) -> mx.array:
    """:func:`key_scales` of finite float32 keys ``x`` ``[..., B, H_kv, T, D]`` (:func:`_finite32`; less the layer's
    mean where it is centred) for the scaled ``heads`` ``[..., B, H_kv, 1, 1]`` (:func:`_scaled_heads`): float32
    ``[..., B, H_kv, 1, D]``, not evaluated."""
    root = mx.power(_channel_energy(x), 0.25)
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


def applies(config, keys: mx.array) -> bool:
    """Whether :func:`guard_layer` checks a first block of ``keys`` ``[B, H_kv, T, D]`` (or blocks ``[R, B, H_kv, T,
    D]``) at all: not under ``outlier_layers="off"``, not for keys stored at 8 bits or more (:func:`guarded`), not for
    a block of fewer than :data:`MIN_TOKENS` tokens."""
    return config.outlier_layers != "off" and guarded(config.key_params) and keys.shape[-2] >= MIN_TOKENS


@attrs.frozen
class FirstBlock:
    """What ``R`` layers' first compressed blocks say, as device arrays (:func:`first_block`; not evaluated): the
    three decisions of :func:`guard_layer` per layer, and what they are made of. One layer's are row 0 of ``R = 1``;
    a batch's rows (each a layer of its own) are decided in one graph (:func:`decide_ahead_rows`).

    :ivar centre: bool ``[R]``: the keys are centred (:func:`offset_energy` of ``config.still_channels`` at least
        :data:`STILL_CENTER_LIMIT`; of the whole mean, without them, at least :data:`CENTER_LIMIT`).
    :ivar outlier: bool ``[R]``: an outlier layer (:func:`channel_concentration` at least
        :data:`CONCENTRATION_LIMIT`).
    :ivar share: float32 ``[R]``, that concentration (the warning names it).
    :ivar heads: which heads :func:`key_scales` scales, bool ``[R, B, H_kv, 1, 1]``, or ``None`` where the key method
        is never scaled (:func:`scales_keys`).
    :ivar scaled: bool ``[R]``, any of a row's ``heads``, or ``None`` alike.
    """

    centre: mx.array
    outlier: mx.array
    share: mx.array
    heads: mx.array | None
    scaled: mx.array | None
    #: The decisions as Python values, made by the first :meth:`decided` (every row's at once).
    _host: dict = attrs.field(factory=dict, init=False, eq=False, repr=False)

    def arrays(self) -> list:
        """The arrays to evaluate."""
        return [x for x in (self.centre, self.outlier, self.share, self.heads, self.scaled) if x is not None]

    def decided(self, row: int = 0) -> tuple[bool, bool, bool]:
        """``(centre, outlier, scaled)`` of block ``row`` as Python bools. The first call evaluates the arrays (one
        wait for the device, none where they have run already) and keeps every row's values: a batch's rows read
        theirs without evaluating again."""
        host = self._host
        if not host:
            mx.eval(*self.arrays())
            host.update(centre=self.centre.tolist(), outlier=self.outlier.tolist(), share=self.share.tolist(),
                        scaled=None if self.scaled is None else self.scaled.tolist())
        scaled = host["scaled"] is not None and host["scaled"][row]
        return bool(host["centre"][row]), bool(host["outlier"][row]), bool(scaled)

    def concentration(self, row: int = 0) -> float:
        """:attr:`share` of block ``row`` as a float (:meth:`decided` first)."""
        self.decided(row)
        return float(self._host["share"][row])


def first_block(config, block: _Finite) -> FirstBlock:
    """The statistics of first compressed blocks of keys (``block``: :class:`_Finite` of ``R`` layers' keys ``[R, B,
    H_kv, T, D]``) and the decisions made of them (:class:`FirstBlock`), on the device and not evaluated: the one
    statement of the guard's rule, which :func:`guard_layer` (waiting for it) and :func:`decide_ahead_rows` (not
    waiting) both read."""
    limit = CENTER_LIMIT if config.still_channels is None else STILL_CENTER_LIMIT
    share = _concentration(block.varying)
    heads = _scaled_heads(block.varying) if scales_keys(config.key_params) else None
    return FirstBlock(centre=_energy_share(block.x, block.mean(config.still_channels)) >= limit,
                      outlier=share >= CONCENTRATION_LIMIT, share=share, heads=heads,
                      scaled=None if heads is None else mx.any(heads, axis=(1, 2, 3, 4)))


def _rounded(mean: mx.array, dtype: mx.Dtype) -> mx.array:
    """A float32 key ``mean`` with values of the keys' 16-bit dtype (``dtype``; float16 for float32 keys), held as
    float32: the sinks' and window's dtype holds it exactly (the fused kernels score those tokens centred in that
    dtype)."""
    return mean.astype(mx.float16 if dtype == mx.float32 else dtype).astype(mx.float32)


def guard_layer(config, keys: mx.array):
    """What a layer does about the keys ``[B, H_kv, T, D]`` of the first block it compresses: ``(config, mean,
    scales)``, from :func:`first_block`'s decisions, waiting for the device once.

    ``mean`` is :func:`key_mean` (of ``config.still_channels`` where known) where the keys are to be centred, with
    values of the keys' 16-bit dtype (float16 for float32 keys, :func:`_rounded`), else ``None``. ``config`` (a
    :class:`kvq.cache.CacheConfig`) is unchanged unless the layer is an outlier layer; then an
    :class:`OutlierLayerWarning` naming the layer, ``outlier_layer`` set, and under ``"upgrade"`` both sides'
    parameters replaced by :func:`safe_params`. ``scales`` is :func:`key_scales` of the keys less ``mean`` where the
    (returned) key method may be scaled (:func:`scales_keys`), else ``None``. Nothing is done (``(config, None,
    None)``) where the guard does not apply (:func:`applies`).

    :func:`decide_ahead`'s block, waited for and settled where it is stored (:func:`settle` with ``stored_ahead``
    off); a chunk's first compression need not wait: :func:`decide_ahead` and :func:`settle`.
    """
    ahead = decide_ahead(config, keys)
    return (config, None, None) if ahead is None else settle(config, ahead, stored_ahead=False)


@attrs.frozen
class Ahead:
    """A first block's decisions still on the device (:func:`decide_ahead`), with the mean and scales a layer may
    compress and attend with meanwhile: ``mean`` float32 ``[B, H_kv, 1, D]``, :func:`guard_layer`'s mean where the
    block is centred and zeros where not; ``scales`` float32 ``[B, H_kv, 1, D]``, :func:`key_scales` of the keys less
    ``mean`` (ones for the heads not scaled, so all ones where none is), or ``None`` where the key method is never
    scaled. ``row``: the block's row of ``block`` (a batch's rows share one :class:`FirstBlock`)."""

    block: FirstBlock
    mean: mx.array
    scales: mx.array | None
    row: int = 0


def decide_ahead(config, keys: mx.array) -> Ahead | None:
    """:func:`guard_layer` of a chunk's first compression, the update not waiting for the device (issue #51): the
    first block's decisions are queued (``mx.async_eval``) and the layer goes on with a mean and scales that hold
    every outcome but one (:class:`Ahead`): keys less a mean of zeros, divided by scales of ones, are the keys
    themselves, bit for bit (:mod:`kvq.cache.centring`: a float32 subtraction of 0 and product by 1, rounded back to
    the keys' dtype; queries times 1; log-sum-exps plus 0; a device that flushes float32 subnormals to zero would
    zero keys below 1.2e-38), so codes and attention are those of the decided layer. The layer settles
    (:func:`settle`) once its chunk's attention is built and queued, reading the decisions, by then made or nearly;
    a chunk with learned sink logits settles before it attends (on a GPU it decodes its keys otherwise while the
    mean is there). The outcome it cannot hold is an outlier layer under ``"upgrade"``, whose method changes:
    :func:`settle` says so, and the layer stores the chunk again. ``None`` where the guard does not apply
    (:func:`applies`).

    Why: the first block's keys come from the layer's projection of the chunk, so deciding on them waits for the
    device to run every layer before; the host then builds the layer's update and attention while the device idles.
    On an H100 that wait was 2.3 ms per layer in a prefill's first chunk, about a fifth of an 8K prefill on
    random:llama3-8b (``benchmarks/results/prefill/2026-12-07-h100-host-profile-d05440f``).
    """
    ahead = decide_ahead_rows(config, keys[None])
    return None if ahead is None else ahead[0]


def decide_ahead_rows(config, blocks: mx.array) -> list[Ahead] | None:
    """:func:`decide_ahead` of ``R`` layers' first blocks at once, ``blocks`` ``[R, B, H_kv, T, D]`` (the rows of a
    batch starting their prefill together, each a layer of its own with ``config``): one graph and one queue for all
    of them instead of one per row, each row's :class:`Ahead` what :func:`decide_ahead` of its block alone gives (the
    same statistics, reduced over the same axes: ``tests/test_guard_ahead.py`` compares them bit for bit). ``None``
    where the guard does not apply (:func:`applies`).

    Why: a batch's prefill (mlx-lm's ``BatchGenerator``: 8 prompts of 2,048, each row's first chunk its first
    compression) built and queued each row's statistics apart, about 40 graph nodes a row and layer that the host
    builds and MLX encodes while the device waits (issue #51: kvq's prefill there was 0.70x fp16's on an H100)."""
    if not applies(config, blocks):
        return None
    block = _Finite(blocks)
    decisions = first_block(config, block)
    mx.async_eval(*decisions.arrays())
    centre = decisions.centre.reshape(-1, 1, 1, 1, 1)
    mean = mx.where(centre, _rounded(block.mean(config.still_channels), blocks.dtype), 0.0)
    scales = None if decisions.heads is None else _scales(_finite32(block.x - mean), decisions.heads)
    means = _each_row(mean)
    scales = [None] * len(means) if scales is None else _each_row(scales)
    return [Ahead(decisions, m, s, r) for r, (m, s) in enumerate(zip(means, scales))]


def _each_row(x: mx.array) -> list:
    """``x`` ``[R, ...]`` as ``R`` arrays ``[...]``: one split of views (a reshape for one row), not a slice each."""
    if x.shape[0] == 1:
        return [x.reshape(x.shape[1:])]
    return [part.squeeze(0) for part in mx.split(x, x.shape[0], axis=0)]


class SharedFirstBlocks:
    """The first blocks of a batch's rows that start a prefill together, ``blocks`` ``[R, B, H_kv, T, D]``, decided in
    one graph (:func:`decide_ahead_rows`) when the first of them asks (:meth:`decide`): each row is a layer of its
    own, and its chunk's update asks with its configuration as it stands then."""

    def __init__(self, blocks: mx.array) -> None:
        self.blocks = blocks
        self._config = None
        self._aheads: list[Ahead] | None = None

    def decide(self, row: int, config, shape: tuple) -> Ahead | None:
        """Row ``row``'s :class:`Ahead` (what :func:`decide_ahead` of its block gives), or ``None`` (the row then
        decides alone) where the guard does not apply, where ``config`` is not the configuration the rows were
        decided with (its still channels included: they set the centring rule, and ``CacheConfig`` equality leaves
        them out), or where the row's first block is not of ``shape`` ``[B, H_kv, T, D]``, the blocks' (what the
        batch read from the chunk is not what the row compresses first)."""
        if self._config is None:
            self._config, self._aheads = config, decide_ahead_rows(config, self.blocks)
        same = (config == self._config and config.still_channels == self._config.still_channels
                and tuple(shape) == tuple(self.blocks.shape[1:]))
        return self._aheads[row] if self._aheads is not None and same else None


def settle(config, ahead: Ahead, failed: Exception | None = None, stored_ahead: bool = True):
    """What the guard decided for the block :func:`decide_ahead` went on with, from its decisions (evaluated by now,
    or waited for): ``(config, mean, scales)`` as :func:`guard_layer` returns them, the arrays ``ahead`` holds where
    they are used (its mean where the block is centred, its scales where a head is scaled and the returned key method
    may be scaled) and ``None`` where not; or ``None`` where the layer is an outlier layer under ``"upgrade"`` whose
    block was ``stored_ahead`` (its chunk must be stored again, with :func:`guard_layer`). An outlier layer warns
    here.

    :param failed: the error that storing an outlier layer's chunk again raised: the layer keeps its method (the
        chunk as stored), marked an outlier layer, with an :class:`OutlierLayerWarning` that says so and why.
    :param stored_ahead: whether the block was stored with ``ahead``'s mean and scales before settling (a chunk's
        first compression); off (:func:`guard_layer`), an outlier layer under ``"upgrade"`` gets its 8-bit
        configuration here, the block not stored yet.
    """
    centre, outlier, scaled = ahead.block.decided(ahead.row)
    if outlier:
        if stored_ahead and config.outlier_layers == "upgrade" and failed is None:
            return None
        config = _outlier_layer(config, ahead.block.concentration(ahead.row), failed)
    scaled = scaled and scales_keys(config.key_params)
    return config, ahead.mean if centre else None, ahead.scales if scaled else None


def _outlier_layer(config, share: float, failed: Exception | None = None):
    """``config`` for an outlier layer whose keys hold ``share`` of their varying energy in one channel: warns (an
    :class:`OutlierLayerWarning` naming the layer) and, under ``"upgrade"``, stores both sides with
    :func:`safe_params`; where storing them so ``failed`` (:func:`settle`), keeps the method and says why."""
    layer = "a layer" if config.layer is None else f"layer {config.layer}"
    method = config.key_params.method + (f":{config.key_params.bits}" if hasattr(config.key_params, "bits") else "")
    found = (f"kvq: {layer}'s keys hold {share:.0%} of their varying energy in one channel (outlier channels, as "
             f"in Qwen2.5), which {method} keys cannot hold without breaking that layer's attention")
    if failed is not None:
        warnings.warn(f"{found}; storing it with {SAFE_METHOD}:{SAFE_BITS} failed ({type(failed).__name__}: "
                      f"{failed}), so it keeps {method}", OutlierLayerWarning, stacklevel=4)
        return attrs.evolve(config, outlier_layer=True)
    if config.outlier_layers == "warn":
        warnings.warn(f"{found}; outlier_layers='upgrade' (the default) would store it with affine:8",
                      OutlierLayerWarning, stacklevel=4)
        return attrs.evolve(config, outlier_layer=True)
    warnings.warn(f"{found}: it is stored with {SAFE_METHOD}:{SAFE_BITS} (keys and values) instead; "
                  f"outlier_layers='off' keeps {method}", OutlierLayerWarning, stacklevel=4)
    safe = safe_params()
    return attrs.evolve(config, key_params=safe, value_params=safe, outlier_layer=True)
