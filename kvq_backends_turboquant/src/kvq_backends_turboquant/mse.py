"""TurboQuant-mse in pure MLX: normalise, rotate, Lloyd-Max quantize each coordinate, pack densely.

Zandieh et al., TurboQuant (arXiv 2504.19874), algorithm 1: ``x̃ = ‖x‖ · Πᵀ c[idx]`` with ``idx_j`` the nearest
centroid of ``(Π x/‖x‖)_j``. Norms are computed in float32 (a key of norm 700 has ``‖k‖² ≈ 5e5``, beyond
float16) and stored as ``params.norm_dtype``. These helpers work on rotated unit vectors ``y``
``[B, H, T, D_pad]`` float32 (``D_pad``: ``params.rotated_dim(D)``); :mod:`kvq_backends_turboquant.impl` wraps
them into the kvq ops.

Non-finite input (kvq's policy: :class:`kvq.contract.Quantizes`): a vector with a NaN or ±inf coordinate gets a
NaN norm (:func:`normalise`), so it decodes to NaN in every coordinate and its scores and weighted values are NaN,
as an fp16 cache would propagate it; its codes are whatever the encoder makes of NaN, and no other vector changes.
"""

from __future__ import annotations

import mlx.core as mx

from kvq import packing

from .codebook import codebook
from .rotation import power_of_two_dim, rotation

#: Largest finite float16; float16 norms saturate here instead of becoming inf.
FLOAT16_MAX = 65504.0
_TINY = 1e-30


def rotation_of(params, head_dim: int):
    """The :class:`~kvq_backends_turboquant.rotation.Rotation` that ``params`` uses for ``head_dim``."""
    return rotation(params.rotation, params.rotated_dim(head_dim), params.seed)


def non_finite_to_nan(norms: mx.array, x: mx.array) -> mx.array:
    """``norms`` ``[...]`` with NaN where the vector ``x`` ``[..., D]`` has a NaN or ±inf coordinate (lazy, no host
    synchronisation; finite vectors keep their norms bit for bit)."""
    return mx.where(mx.all(mx.isfinite(x), axis=-1), norms, float("nan"))


def normalise(x: mx.array) -> tuple[mx.array, mx.array]:
    """``(x / ‖x‖, ‖x‖)`` in float32: ``x`` ``[..., D]`` of any float dtype -> ``[..., D]`` and ``[...]``.

    A zero vector gives a zero unit vector (and decodes to zero), never NaN. A vector with a non-finite coordinate
    gets a NaN norm (and a NaN unit vector), whatever its other coordinates: it decodes to NaN.
    """
    x = x.astype(mx.float32)
    norms = non_finite_to_nan(mx.sqrt(mx.sum(x * x, axis=-1)), x)
    return x / mx.maximum(norms, _TINY)[..., None], norms


def store_norms(norms: mx.array, params) -> mx.array:
    """Float32 norms ``[...]`` -> ``params.norm_dtype`` (float16 saturates at 65504 rather than overflow; NaN stays
    NaN: ``mx.minimum`` propagates it)."""
    if params.norm_dtype == "float16":
        return mx.minimum(norms, FLOAT16_MAX).astype(mx.float16)
    return norms


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """:func:`kvq.packing.pack`, also for blocks of 0 tokens (which it cannot reshape): uint32
    ``[..., ceil(N * bits / 32)]``."""
    if codes.size == 0:
        return mx.zeros(codes.shape[:-1] + (packing.packed_words(codes.shape[-1], bits),), mx.uint32)
    return packing.pack(codes, bits)


def encode_rotated(y: mx.array, params, head_dim: int) -> tuple[dict[str, mx.array], mx.array]:
    """Quantize rotated unit vectors ``y`` float32 ``[B, H, T, D_pad]``.

    :return: ``(fields, y_hat)``: ``{field: uint32 [B, H, T, ceil(n * b / 32)]}`` for each stored group of
        ``params.groups`` (``outlier_codes``, ``codes``), and the reconstruction ``c[idx]`` float32 like ``y``
        (lazy: it costs nothing unless used).
    """
    fields, parts, start = {}, [], 0
    for name, count, bits in params.groups(head_dim):
        if count and bits:
            book = codebook(y.shape[-1], bits)
            codes = book.encode(y[..., start:start + count])
            fields[name] = pack_codes(codes, bits)
            parts.append(book.decode(codes))
        elif count:
            parts.append(mx.zeros(y.shape[:-1] + (count,), mx.float32))
        start += count
    return fields, _join(parts)


def decode_rotated(data, params, head_dim: int) -> mx.array:
    """``c[idx]`` of the stored codes: float32 ``[B, H, T, D_pad]`` unit vectors in the rotated domain.

    :param data: the fields of an Encoded (``norms`` gives the leading shape). Groups of 0 bits (the MSE stage of
        ``turboquant_prod`` at 1 bit) decode to zeros.
    :raises ValueError: codes stored at another rotation size (:func:`check_stored_width`).
    """
    dim, parts = params.rotated_dim(head_dim), []
    lead = data["norms"].shape
    for name, count, bits in params.groups(head_dim):
        if count and bits:
            check_stored_width(data, name, params, head_dim)
            parts.append(codebook(dim, bits).decode_packed(data[name], count))
        elif count:
            parts.append(mx.zeros(lead + (count,), mx.float32))
    return _join(parts)


def check_stored_width(data, name: str, params, head_dim: int) -> None:
    """Check that field ``name`` holds the words per token that ``params`` stores at ``head_dim``: codes written at
    another rotation size (a prompt-cache file of kvq 0.1.0, which padded every head_dim to a power of two, e.g.
    head_dim 80 and 96 to 128) would otherwise decode silently wrong. Shapes only: no host synchronisation.

    :raises ValueError: the widths differ (the message says which file to recompute).
    """
    dim = params.rotated_dim(head_dim)
    want, got = params.stored_words(dim)[name], data[name].shape[-1]
    if got != want:
        raise ValueError(f"{params.method}: stored {name!r} hold {got} uint32 words per token, but head_dim {head_dim} "
                         f"with these parameters rotates at {dim} coordinates and stores {want}: the codes were "
                         f"written at another rotation size (kvq 0.1.0 padded head_dim {head_dim} to "
                         f"{power_of_two_dim(head_dim)}); recompute this prompt cache with this kvq")


def _join(parts):
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def quantize(x: mx.array, params) -> tuple[dict[str, mx.array], mx.array, mx.array]:
    """Normalise, rotate and quantize ``x`` ``[B, H, T, D]`` (any float dtype).

    :return: ``(fields, y, y_hat)``: the packed code fields plus ``norms`` ``[B, H, T]`` (``params.norm_dtype``),
        the rotated unit vectors ``y`` and their reconstruction ``y_hat`` (float32 ``[B, H, T, D_pad]``;
        ``turboquant_prod`` sketches ``y - y_hat``).
    """
    D = x.shape[-1]
    unit, norms = normalise(x)
    y = rotation_of(params, D).forward(unit)
    fields, y_hat = encode_rotated(y, params, D)
    fields["norms"] = store_norms(norms, params)
    return fields, y, y_hat
