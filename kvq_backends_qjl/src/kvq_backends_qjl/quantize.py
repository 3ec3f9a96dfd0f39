"""QJL quantize (keys -> sign sketches and norms) and its estimate-only dequantize, in pure MLX.

Source: Zandieh, Daliri, Han, "QJL: 1-Bit Quantized JL Transform for KV Cache Quantization with Zero
Overhead", arXiv 2406.03482: the sign sketch, and the outlier-channel handling of the paper and its code
(top-k channels by norm per group of tokens, sketched apart with their own norm).

Non-finite input (kvq's policy, :class:`kvq.contract.Quantizes`): a key with a NaN or ±inf coordinate gets NaN
norms (inlier and outlier), so its estimate and its scores are NaN, as an fp16 cache would give; when a group's
outlier channels are chosen, non-finite coordinates count as 0, so the other keys of the group are encoded as if
the bad coordinates were 0.
"""

from __future__ import annotations

import mlx.core as mx
from kvq import Encoded
from kvq.validate import float_array

from .params import QJLParams
from .signs import pack_signs, unpack_signs
from .sketch import MAIN_STREAM, OUTLIER_STREAM, Sketch, make_sketch

#: Largest finite float16: norms are clamped to it before storage (a norm of 700 is far below).
FLOAT16_MAX = 65504.0


def main_sketch(params: QJLParams, head_dim: int) -> Sketch:
    """The ``[m, head_dim]`` sketch of inlier channels for ``params``."""
    return make_sketch(head_dim, params.sketch_dim_for(head_dim), params.sketch, params.seed, MAIN_STREAM)


def outlier_sketch(params: QJLParams) -> Sketch:
    """The ``[outlier_sketch_dim, outlier_channels]`` sketch of outlier coordinates (needs outlier_channels > 0)."""
    return make_sketch(params.outlier_channels, params.resolved_outlier_sketch_dim, params.sketch, params.seed,
                       OUTLIER_STREAM)


def outlier_indices(x: mx.array, group_size: int, count: int) -> mx.array:
    """Per group of ``group_size`` tokens, the ``count`` channels of largest norm over the group.

    :param x: float32 ``[B, H, T, D]``; NaN and ±inf coordinates count as 0.
    :return: uint8 (uint16 for D > 256) ``[B, H, T, count]``, ascending within a token; every token carries
        its group's indices (groups start at token 0; the last may be shorter).
    """
    B, H, T, D = x.shape
    x = mx.where(mx.isfinite(x), x, 0.0)
    pad = (-T) % group_size
    # zero padding tokens add nothing to a channel's energy
    padded = mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) if pad else x
    energy = mx.sum(mx.square(padded.reshape(B, H, (T + pad) // group_size, group_size, D)), axis=3)  # [B, H, G, D]
    top = mx.argpartition(-energy, kth=count - 1, axis=-1)[..., :count]
    top = mx.sort(top, axis=-1).astype(mx.uint8 if D <= 256 else mx.uint16)
    return mx.repeat(top, group_size, axis=2)[:, :, :T]


def _norms(x: mx.array, finite: mx.array) -> mx.array:
    """float32 ``[..., n]`` -> float16 ``[...]`` Euclidean norms (computed in float32, clamped to fp16 range), NaN
    where ``finite`` (bool ``[...]``, the whole key's coordinates all finite) is False."""
    norms = mx.minimum(mx.sqrt(mx.sum(mx.square(x), axis=-1)), FLOAT16_MAX)
    return mx.where(finite, norms, float("nan")).astype(mx.float16)


def quantize(x: mx.array, params: QJLParams) -> Encoded:
    """Encode keys ``x`` as QJL sign sketches plus norms (and the outlier channels' own sketch).

    :param x: keys ``[B, H_kv, T, D]``, float16, bfloat16 or float32; computed in float32.
    :param params: :class:`QJLParams`.
    :return: :class:`kvq.Encoded` with ``signs`` uint8 ``[B, H, T, m/8]`` and ``norms`` float16 ``[B, H, T]``
        (of the inlier part, which is the masked key itself, so it is never negative), and with outlier
        channels ``outlier_indices`` ``[B, H, T, k]``, ``outlier_signs`` uint8 ``[B, H, T, m_o/8]`` and
        ``outlier_norms`` float16 ``[B, H, T]``.
    :raises TypeError: ``x`` not a float ``mx.array``, or ``params`` not :class:`QJLParams`.
    :raises ValueError: ``x`` not rank 4, or a head_dim that ``params`` does not support.
    """
    x = float_array("x", x).astype(mx.float32)
    if not isinstance(params, QJLParams):
        raise TypeError(f"params must be QJLParams for method 'qjl'; got {params!r}")
    D = x.shape[-1]
    params.check_head_dim(D)
    data, finite = {}, mx.all(mx.isfinite(x), axis=-1)
    k = params.outlier_channels
    if k:
        idx = outlier_indices(x, params.group_size, k)
        outliers = mx.take_along_axis(x, idx.astype(mx.int32), axis=-1)  # [B, H, T, k]
        # zero the outlier channels: the inlier part and its norm come from the masked key itself
        x = mx.put_along_axis(x, idx.astype(mx.int32), mx.zeros_like(outliers), axis=-1)
        data["outlier_indices"] = idx
        data["outlier_signs"] = pack_signs(outliers @ outlier_sketch(params).matrix.T)
        data["outlier_norms"] = _norms(outliers, finite)
    data = {"signs": pack_signs(x @ main_sketch(params, D).matrix.T), "norms": _norms(x, finite), **data}
    return Encoded(params, data, D)


def outlier_estimate(encoded: Encoded) -> mx.array:
    """Estimate of each token's outlier coordinates: ``c_o/m_o · ‖k_out‖ · S_oᵀ sign(S_o k_out)``.

    :return: float32 ``[B, H, T, k]``, in the channel order of ``encoded.data["outlier_indices"]``.
    """
    d, sketch = encoded.data, outlier_sketch(encoded.params)
    weight = sketch.estimator_scale * d["outlier_norms"].astype(mx.float32)[..., None]
    return weight * (unpack_signs(d["outlier_signs"]) @ sketch.matrix)


def dequantize(encoded: Encoded, dtype=mx.float32) -> mx.array:
    """An unbiased ESTIMATE of the keys, not a reconstruction: ``c/m · ‖k_in‖ · Sᵀ sign(S k_in)`` plus the
    outlier estimate scattered into its channels (``c = sqrt(π/2)`` for a Gaussian sketch; see
    :mod:`kvq_backends_qjl.sketch`). Its inner product with a query is exactly the score that attention uses;
    its error per coordinate is large (QJL keeps ~1 bit of a key's direction per sketch row).

    :param encoded: what :func:`quantize` returned (possibly sliced along tokens).
    :param dtype: dtype of the result.
    :return: ``[B, H, T, D]`` of ``dtype``.
    """
    d, D = encoded.data, encoded.head_dim
    sketch = main_sketch(encoded.params, D)
    weight = sketch.estimator_scale * d["norms"].astype(mx.float32)[..., None]
    keys = weight * (unpack_signs(d["signs"]) @ sketch.matrix)
    if encoded.params.outlier_channels:
        idx = d["outlier_indices"].astype(mx.int32)
        # the sketch of inliers also spreads noise over the outlier channels; the outlier part adds to it
        keys = keys + mx.put_along_axis(mx.zeros_like(keys), idx, outlier_estimate(encoded), axis=-1)
    return keys.astype(dtype)
