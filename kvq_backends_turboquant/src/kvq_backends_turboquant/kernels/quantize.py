"""Fused normalise + randomized Hadamard + Lloyd-Max quantize + dense pack (TurboQuant-mse encode), its inverse
(unpack + centroids + inverse Hadamard + norm), and TurboQuant-prod's encode (the same, then the residual's QJL
signs and norm: :func:`quantize_prod`).

TurboQuant (Zandieh et al., arXiv 2504.19874), algorithm 1, with the randomized Hadamard rotation
``y = H diag(s) x / ‖x‖ / sqrt(D_pad)``. One SIMD group (32 lanes) encodes one vector: each lane holds
``E = D_pad / 32`` consecutive coordinates in registers; the fast Walsh-Hadamard butterflies run in registers for
strides below ``E`` and across lanes with SIMD shuffles above; the code of each coordinate is the number of
Lloyd-Max cell boundaries below it (as :meth:`kvq_backends_turboquant.codebook.Codebook.encode` computes it);
each lane packs its ``E`` codes into one ``E * bits``-bit chunk and lane ``w`` assembles output word ``w`` from
the chunks that overlap it (shuffles, no atomics). Nothing but the codes and the norm is written: the
intermediate memory of the pure-MLX encoder (the ``[N, D, 2^b - 1]`` comparison and the float32 rotated
vectors) never exists.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx

from kvq_metal.dialect import size_input
from kvq_metal.kernel_files import load

#: Vectors per thread group (one SIMD group each).
VECTORS_PER_GROUP = 4
#: Largest float16 value; float16 norms saturate here, as the pure-MLX encoder stores them.
FLOAT16_MAX = 65504.0

#: The kernels (kernel files beside this module; :mod:`kvq_metal.kernel_files`).
QUANTIZE = load(Path(__file__).with_name("tq_quantize.kvq"))
QUANTIZE_PROD = load(Path(__file__).with_name("tq_prod_quantize.kvq"))
DEQUANTIZE = load(Path(__file__).with_name("tq_dequantize.kvq"))


def supported(head_dim: int, dim: int, bits: int) -> bool:
    """Whether the fused encoder serves ``head_dim`` rotated at ``dim`` coordinates with ``bits`` (1..4): ``dim`` a
    power of two in 32..256 (the warp's butterflies and lane layout; MLX's other Hadamard sizes, 80 = 20 · 4 and
    the like, are left to pure MLX) and ``head_dim <= dim``."""
    return 32 <= dim <= 256 and dim & (dim - 1) == 0 and 1 <= bits <= 4 and head_dim <= dim


def _rows(shape) -> tuple[tuple, int, int]:
    """``(leading shape, vectors n, thread groups)`` of an array of vectors ``[..., D]``: the kernels see ``n``
    rows, :data:`VECTORS_PER_GROUP` per thread group."""
    lead = tuple(shape[:-1])
    n = 1
    for s in lead:
        n *= s
    return lead, n, max(1, -(-n // VECTORS_PER_GROUP))


def quantize(x: mx.array, signs: mx.array, boundaries: mx.array, bits: int, norm_dtype, backend: str):
    """Encode ``x`` ``[..., D]`` (float16/bfloat16/float32) with the randomized Hadamard rotation (kernel
    ``tq_quantize.kvq``; pure-MLX reference :meth:`kvq_backends_turboquant.impl.TurboQuantMLX.kvq_quantize`).

    :param signs: float32 ``[D_pad]`` ±1 (their length is the rotation size). :param boundaries: float32
        ``[2**bits - 1]`` ascending cell edges.
    :param norm_dtype: ``mx.float16`` (saturating at 65504) or ``mx.float32``.
    :return: ``(codes uint32 [..., D_pad * bits / 32], norms [...] of norm_dtype)``. A vector with a NaN or ±inf
        coordinate gets a NaN norm (kvq's policy, :class:`kvq.contract.Quantizes`), as the pure-MLX encoder
        stores it.
    :raises ValueError: a shape or width :func:`supported` rejects.
    """
    codes, norms = _encode(QUANTIZE, ("x", "signs", "bounds"), ("codes", "norms"), x, [signs, boundaries], bits,
                           norm_dtype, backend, ())
    return codes, norms


def quantize_prod(x: mx.array, signs: mx.array, boundaries: mx.array, centroids: mx.array, sketch: mx.array,
                  bits: int, norm_dtype, backend: str):
    """TurboQuant-prod's encode of ``x`` ``[..., D]`` in one launch (kernel ``tq_prod_quantize.kvq``; pure-MLX
    reference :meth:`kvq_backends_turboquant.impl.TurboQuantMLX.kvq_quantize` with prod parameters): the MSE stage
    as :func:`quantize` at ``bits`` (the prod parameters' ``bits - 1``), then the residual of the rotated unit
    vector, its norm and the signs of ``S r`` (TurboQuant, arXiv 2504.19874, algorithm 2).

    :param signs: the rotation's float32 ``[D_pad]`` ±1, as :func:`quantize` takes them (not the residual's sign
        bits). :param boundaries: float32 ``[2**bits - 1]`` of the stage's codebook, ``centroids`` its float32
        ``[2**bits]``. :param sketch: ``S`` float32 ``[D_pad, D_pad]``. :param norm_dtype: as :func:`quantize`.
    :return: ``(codes uint32 [..., D_pad * bits / 32], norms [...], residual sign bits uint32 [..., D_pad / 32] (the
        field ``signs`` of a turboquant_prod Encoded), residual norms [...])``, norms of ``norm_dtype``. Sign bits
        come from the kernel's own float32 sums: a projection within rounding of 0 may take the other sign than pure
        MLX's matmul.
    :raises ValueError: a shape or width :func:`supported` rejects.
    """
    dim = signs.shape[0]
    return _encode(QUANTIZE_PROD, ("x", "signs", "bounds", "cents", "sk"), ("codes", "norms", "rsigns", "rnorms"),
                   x, [signs, boundaries, centroids, sketch], bits, norm_dtype, backend,
                   ((dim // 32, mx.uint32), (None, norm_dtype)))


def _encode(source, input_names: tuple, output_names: tuple, x: mx.array, inputs: list, bits: int, norm_dtype,
            backend: str, extra: tuple) -> tuple:
    """Launch an encoder of this module (``tq_quantize.kvq`` or ``tq_prod_quantize.kvq``) over the vectors of ``x``
    ``[..., D]``: inputs ``x`` and ``inputs`` (the rotation's signs first, whose length is the rotation size),
    outputs the codes and norms, then ``extra`` ones (``(words per vector or None for one value, dtype)``), each
    shaped like ``x``'s leading axes.

    :raises ValueError: a shape or width :func:`supported` rejects."""
    D, dim = x.shape[-1], inputs[0].shape[0]
    if not supported(D, dim, bits):
        raise ValueError(f"fused quantize serves head_dim rotated at a power of two in 32..256 and bits 1..4; got "
                         f"{D} at {dim}, {bits}")
    lead, n, groups = _rows(x.shape)
    widths = ((dim * bits // 32, mx.uint32), (None, norm_dtype), *extra)
    kern = source.kernel(backend, input_names, output_names)
    outs = kern(inputs=[x.reshape(n, D), *inputs],
                template=[("D", D), ("DP", dim), ("BITS", bits), ("VPG", VECTORS_PER_GROUP),
                          ("NORM_F16", norm_dtype == mx.float16), ("OUT_T", norm_dtype)],
                grid=(32 * VECTORS_PER_GROUP * groups, 1, 1), threadgroup=(32 * VECTORS_PER_GROUP, 1, 1),
                output_shapes=[(n,) if w is None else (n, w) for w, _ in widths],
                output_dtypes=[d for _, d in widths])
    return tuple(o.reshape(lead) if w is None else o.reshape(*lead, w) for o, (w, _) in zip(outs, widths))


def dequantize(codes: mx.array, norms: mx.array, signs: mx.array, centroids: mx.array, bits: int, head_dim: int,
               dtype, backend: str) -> mx.array:
    """Inverse of :func:`quantize`: ``‖x‖ · diag(s) H c[codes] / sqrt(D_pad)`` with the padding dropped (kernel
    ``tq_dequantize.kvq``; pure-MLX reference :meth:`kvq_backends_turboquant.impl.TurboQuantMLX.kvq_dequantize`).

    :return: ``[..., head_dim]`` of ``dtype`` (NaN for a vector whose stored norm is NaN).
    :raises ValueError: as :func:`quantize`.
    """
    out = dequantize_into(codes, norms, signs, centroids, bits, head_dim, dtype, backend, 0, 0)
    return out.reshape(*codes.shape[:-1], head_dim)  # (codes of one vector, [W]: [head_dim])


def dequantize_into(codes: mx.array, norms: mx.array, signs: mx.array, centroids: mx.array, bits: int,
                    head_dim: int, dtype, backend: str, before: int, after: int) -> mx.array:
    """:func:`dequantize` of ``codes`` ``[..., T, W]`` into a buffer with ``before`` columns ahead of each row's
    ``T`` decoded vectors and ``after`` behind them, left unwritten for the caller to fill (a prefill chunk's
    sinks and window beside its decoded tokens, written in place by ``mx.array`` slice assignment: no copy of the
    decoded tokens to join them, issue #51).

    :param before, after: columns (>= 0) around each row's decoded vectors; ``0, 0`` is :func:`dequantize`.
    :return: ``[..., before + T + after, head_dim]`` of ``dtype``; its ``before`` and ``after`` columns hold
        whatever the allocator gave until the caller writes them.
    :raises ValueError: as :func:`quantize`, or ``before`` / ``after`` negative.
    """
    dim = signs.shape[0]
    if not supported(head_dim, dim, bits):
        raise ValueError(f"fused dequantize serves head_dim rotated at a power of two in 32..256 and bits 1..4; "
                         f"got {head_dim} at {dim}, {bits}")
    lead, n, groups = _rows(codes.shape)
    T, rows = (lead[-1] if lead else 1), math.prod(lead[:-1])
    kern = DEQUANTIZE.kernel(backend, ("codes", "norms", "signs", "centroids", "before", "after"), ("out",))
    (out,) = kern(
        inputs=[codes.reshape(rows, T, codes.shape[-1]), norms.reshape(n), signs, centroids,
                size_input(before, "before"), size_input(after, "after")],
        template=[("D", head_dim), ("DP", dim), ("BITS", bits), ("VPG", VECTORS_PER_GROUP), ("OUT_T", dtype)],
        grid=(32 * VECTORS_PER_GROUP * groups, 1, 1), threadgroup=(32 * VECTORS_PER_GROUP, 1, 1),
        output_shapes=[(rows * (before + T + after), head_dim)], output_dtypes=[dtype])
    return out.reshape(*lead[:-1], before + T + after, head_dim)
