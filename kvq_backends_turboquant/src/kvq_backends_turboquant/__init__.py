"""kvq plugin: TurboQuant KV-cache compression (Zandieh et al., TurboQuant, arXiv 2504.19874).

Three methods, each with a pure-MLX implementation (:class:`~kvq_backends_turboquant.impl.TurboQuantMLX`,
:class:`~kvq_backends_turboquant.rvq_impl.TurboQuantRVQMLX`):

* ``turboquant`` (TurboQuant-mse): random rotation (randomized Hadamard, or dense QR), then a per-coordinate
  Lloyd-Max quantizer for the exact coordinate distribution of a rotated unit vector, plus the vector's norm.
  Encoded fields, all ``[B, H_kv, T, ...]``: ``codes`` uint32 ``[..., ceil((D_pad - k) * bits / 32)]``,
  ``outlier_codes`` uint32 (only when ``outlier_channels = k > 0``), ``norms`` ``[B, H_kv, T]`` float16/32.
  With ``outlier_select="data"`` the outlier channels are chosen per layer and KV head from data and the two
  channel sets are separate TurboQuant instances (adds ``outlier_norms``; :mod:`~kvq_backends_turboquant.outliers`).
* ``turboquant_prod`` (TurboQuant-prod): the MSE stage at ``bits - 1`` plus a 1-bit QJL sketch of the residual;
  inner products are unbiased. Adds ``signs`` uint32 ``[..., D_pad / 32]`` and ``residual_norms`` ``[B, H_kv, T]``.
* ``turboquant_rvq``: the same rotation, a stage-1 Lloyd-Max code (``bits``) and a stage-2 Lloyd-Max code of the
  stage-1 residual (``residual_bits``) per coordinate, one norm per vector (:mod:`~kvq_backends_turboquant.rvq`).
  Fields ``codes`` uint32 ``[..., ceil(D_pad * bits / 32)]``, ``residual_codes`` uint32
  ``[..., ceil(D_pad * residual_bits / 32)]``, ``norms`` ``[B, H_kv, T]``.

``D_pad`` is the rotation size, ``params.rotated_dim(head_dim)``: head_dim rounded up to the smallest Hadamard size
``m · 2^k`` (``m`` in 1, 12, 20, 28: 80, 96 and 112 are their own), or to the next power of two where that stores
no more words. A vector with a NaN or ±inf coordinate is stored with a NaN norm (:class:`kvq.contract.Quantizes`).
Parameters: :class:`TurboQuantParams`, :class:`TurboQuantProdParams`, :class:`TurboQuantRVQParams`; their
``accounting(head_dim)`` gives the exact bits per coordinate.
Fused kernels (Metal and CUDA, built on kvq_metal's dialect and decode-attention kernels) serve ``turboquant`` and
``turboquant_rvq`` on GPUs: :mod:`~kvq_backends_turboquant.kernels`.
"""

from __future__ import annotations

import kvq

from .impl import TurboQuantMLX
from .kernels import implementations as kernel_implementations
from .params import TurboQuantParams, TurboQuantProdParams
from .rvq import TurboQuantRVQParams
from .rvq_impl import TurboQuantRVQMLX

SOURCE = "Zandieh et al., TurboQuant, arXiv 2504.19874"

TURBOQUANT = kvq.Method(
    "turboquant", TurboQuantParams,
    "random rotation + Lloyd-Max codebook per coordinate + norm (TurboQuant-mse), bits 1-4", source=SOURCE,
    scale_keys=True)
TURBOQUANT_PROD = kvq.Method(
    "turboquant_prod", TurboQuantProdParams,
    "TurboQuant-mse at bits-1 + 1-bit QJL sketch of the residual: unbiased inner products, bits 1-4",
    source=SOURCE)
TURBOQUANT_RVQ = kvq.Method(
    "turboquant_rvq", TurboQuantRVQParams,
    "TurboQuant rotation + Lloyd-Max code + Lloyd-Max code of its residual per coordinate + norm, bits 1-4 each",
    source=SOURCE + "; residual VQ, Juang & Gray, ICASSP 1982")

__all__ = ["TURBOQUANT", "TURBOQUANT_PROD", "TURBOQUANT_RVQ", "TurboQuantMLX", "TurboQuantParams",
           "TurboQuantProdParams", "TurboQuantRVQMLX", "TurboQuantRVQParams", "kvq_register"]


def kvq_register(register):
    """Entry point ``turboquant``: the three methods, their pure-MLX implementations and the kernel implementations
    of ``turboquant`` and ``turboquant_rvq`` (``metal`` and ``cuda``; :mod:`~kvq_backends_turboquant.kernels`)."""
    for obj in (TURBOQUANT, TURBOQUANT_PROD, TURBOQUANT_RVQ, TurboQuantMLX("turboquant"),
                TurboQuantMLX("turboquant_prod"), TurboQuantRVQMLX(), *kernel_implementations()):
        register(obj)
