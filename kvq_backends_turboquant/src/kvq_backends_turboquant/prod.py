"""TurboQuant-prod's second stage: a 1-bit QJL sketch of the MSE residual, for unbiased inner products.

Zandieh et al., TurboQuant (arXiv 2504.19874), algorithm 2: with ``r = y - y_hat`` the residual of the MSE stage
(here in the rotated domain, ``D_pad`` coordinates) and ``S`` ``[m, D_pad]`` i.i.d. N(0, 1) (``m = D_pad``),
store ``sign(S r)`` (packed, 1 bit each) and ``‖r‖``; then

    ``ỹ = y_hat + sqrt(π/2) / m · ‖r‖ · Sᵀ sign(S r)``,   ``E[⟨q, ỹ⟩] = ⟨q, y⟩``

for any query ``q`` (QJL, Zandieh et al., arXiv 2406.03482, lemma 3.2). Attention uses the same identity without
ever forming ``Sᵀ sign(S r)`` per token: queries are sketched once (``S q``), and weighted sums of values are
accumulated in the sketch domain and multiplied by ``Sᵀ`` once at the end.
"""

from __future__ import annotations

import math

import mlx.core as mx

from kvq import packing

from .mse import check_stored_width, pack_codes, store_norms
from .rotation import sketch_matrix


def qjl_scale(dim: int) -> float:
    """``sqrt(π/2) / m`` with ``m = dim`` sketch rows: the factor that makes the estimate unbiased."""
    return math.sqrt(math.pi / 2) / dim


def sketch_of(params, head_dim: int) -> mx.array:
    """``S``: float32 ``[D_pad, D_pad]`` i.i.d. N(0, 1), seeded by ``params.seed`` (``D_pad = params.rotated_dim``)."""
    return sketch_matrix(params.rotated_dim(head_dim), params.seed)


def encode_residual(residual: mx.array, params, head_dim: int) -> dict[str, mx.array]:
    """Sketch the residual ``r`` float32 ``[B, H, T, D_pad]`` of unit vectors.

    :return: ``{"signs": uint32 [B, H, T, D_pad / 32] (bit = 1 where (S r)_i >= 0), "residual_norms": [B, H, T]
        (params.norm_dtype)}``.
    """
    projected = residual @ sketch_of(params, head_dim).T
    signs = pack_codes((projected >= 0).astype(mx.uint32), 1)
    norms = mx.sqrt(mx.sum(residual * residual, axis=-1))
    return {"signs": signs, "residual_norms": store_norms(norms, params)}


def signs_of(data, params, head_dim: int) -> mx.array:
    """The stored signs as float32 ±1, ``[B, H, T, D_pad]``. :raises ValueError: signs of another rotation size."""
    check_stored_width(data, "signs", params, head_dim)
    bits = packing.unpack(data["signs"], 1, params.rotated_dim(head_dim))
    return bits.astype(mx.float32) * 2 - 1


def decode_residual(data, params, head_dim: int) -> mx.array:
    """The residual estimate ``sqrt(π/2)/m · ‖r‖ · Sᵀ sign(S r)``: float32 ``[B, H, T, D_pad]`` (rotated domain)."""
    dim = params.rotated_dim(head_dim)
    gamma = data["residual_norms"].astype(mx.float32)[..., None] * qjl_scale(dim)
    return gamma * (signs_of(data, params, head_dim) @ sketch_of(params, head_dim))
