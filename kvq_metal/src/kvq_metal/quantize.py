"""Fused normalise + randomized Hadamard + Lloyd-Max quantize + dense pack (TurboQuant-mse encode), and its
inverse (unpack + centroids + inverse Hadamard + norm).

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

import mlx.core as mx

from .dialect import kernel

#: Vectors per thread group (one SIMD group each).
VECTORS_PER_GROUP = 4
#: Largest float16 value; float16 norms saturate here, as the pure-MLX encoder stores them.
FLOAT16_MAX = 65504.0

#: Kernel text shared by the encoder and decoder: the unnormalised Walsh-Hadamard transform of a vector held by one
#: warp, ``E`` consecutive coordinates ``y[0 .. E)`` per lane: first within each lane, then across lanes by shuffles.
WARP_HADAMARD = """\
    for (int hs = 1; hs < E; hs <<= 1) {
        for (int e = 0; e < E; ++e) {
            if ((e & hs) == 0) {
                const float a = y[e];
                const float c = y[e + hs];
                y[e] = a + c;
                y[e + hs] = a - c;
            }
        }
    }
    for (int m = 1; m < 32; m <<= 1) {
        const bool upper = (lane & m) != 0;
        for (int e = 0; e < E; ++e) {
            const float other = KVQ_SHFL_XOR(y[e], m);
            y[e] = upper ? other - y[e] : y[e] + other;
        }
    }
"""

QUANTIZE_SOURCE = """
    constexpr int E = DP / 32;
    constexpr int W = DP * BITS / 32;
    constexpr int CB = E * BITS;
    constexpr int NCH = (32 + CB - 1) / CB + 1;
    const int lane = KVQ_LANE;
    const int64_t v = (int64_t)KVQ_TG_X * VPG + KVQ_WARP;
    const bool live = v < x_shape[0];
    float y[E];
    float ss = 0.0f;
    for (int e = 0; e < E; ++e) {
        const int j = lane * E + e;
        y[e] = (live && j < D) ? KVQ_F32(x[v * D + j]) : 0.0f;
        ss += y[e] * y[e];
    }
    for (int off = 16; off > 0; off >>= 1) ss += KVQ_SHFL_XOR(ss, off);
    const float norm = KVQ_SQRT(ss);
    const float inv = 1.0f / KVQ_FMAX(norm, 1e-30f);
    for (int e = 0; e < E; ++e) y[e] *= inv * signs[lane * E + e];
""" + WARP_HADAMARD + """\
    const float hscale = 1.0f / KVQ_SQRT((float)DP);
    uint chunk = 0u;
    for (int e = 0; e < E; ++e) {
        const float u = y[e] * hscale;
        uint code = 0u;
        for (int k = 0; k < (1 << BITS) - 1; ++k) code += (u > bounds[k]) ? 1u : 0u;
        chunk |= code << (e * BITS);
    }
    const int first = (lane * 32) / CB;
    kvq_u64 word = 0;
    for (int k = 0; k < NCH; ++k) {
        const int src = min(first + k, 31);
        const uint c = KVQ_SHFL(chunk, src);
        const int off = (first + k) * CB - lane * 32;
        if (first + k < 32 && off < 32 && off > -CB) {
            word |= off >= 0 ? ((kvq_u64)c << off) : ((kvq_u64)c >> (-off));
        }
    }
    if (live && lane < W) codes[v * W + lane] = (uint32_t)(word & 0xffffffffull);
    if (live && lane == 0) norms[v] = OUT_T(NORM_F16 ? KVQ_FMIN(norm, 65504.0f) : norm);
"""

DEQUANTIZE_SOURCE = """
    constexpr int E = DP / 32;
    constexpr int W = DP * BITS / 32;
    constexpr uint MASK = (1u << BITS) - 1u;
    const int lane = KVQ_LANE;
    const int64_t v = (int64_t)KVQ_TG_X * VPG + KVQ_WARP;
    const bool live = v < codes_shape[0];
    const int bit0 = lane * E * BITS;
    const int w0 = bit0 >> 5;
    const int sh = bit0 & 31;
    kvq_u64 bits = 0;
    if (live) {
        bits = codes[v * W + w0];
        if (sh + E * BITS > 32) bits |= ((kvq_u64)codes[v * W + w0 + 1]) << 32;
    }
    bits >>= sh;
    float y[E];
    for (int e = 0; e < E; ++e) y[e] = centroids[(uint)(bits >> (e * BITS)) & MASK];
""" + WARP_HADAMARD + """\
    const float scale = live ? KVQ_F32(norms[v]) / KVQ_SQRT((float)DP) : 0.0f;
    for (int e = 0; e < E; ++e) {
        const int j = lane * E + e;
        if (live && j < D) out[v * D + j] = OUT_T(y[e] * scale * signs[j]);
    }
"""


def supported(head_dim: int, bits: int) -> bool:
    """Whether the fused encoder serves ``head_dim`` (padded to 32..256) and ``bits`` (1..4)."""
    dim = 1 << max(1, (head_dim - 1).bit_length())
    return 32 <= dim <= 256 and 1 <= bits <= 4 and head_dim <= dim


def _padded(head_dim: int) -> int:
    return 1 << max(1, (head_dim - 1).bit_length())


def quantize(x: mx.array, signs: mx.array, boundaries: mx.array, bits: int, norm_dtype, backend: str):
    """Encode ``x`` ``[..., D]`` (float16/bfloat16/float32) with the randomized Hadamard rotation.

    :param signs: float32 ``[D_pad]`` ±1. :param boundaries: float32 ``[2**bits - 1]`` ascending cell edges.
    :param norm_dtype: ``mx.float16`` (saturating at 65504) or ``mx.float32``.
    :return: ``(codes uint32 [..., D_pad * bits / 32], norms [...] of norm_dtype)``.
    :raises ValueError: a shape or width :func:`supported` rejects.
    """
    D = x.shape[-1]
    if not supported(D, bits):
        raise ValueError(f"fused quantize serves head_dim padded to 32..256 and bits 1..4; got {D}, {bits}")
    dim, lead = _padded(D), x.shape[:-1]
    n = 1
    for s in lead:
        n *= s
    kern = kernel("tq_quantize", backend, ("x", "signs", "bounds"), ("codes", "norms"), QUANTIZE_SOURCE)
    groups = max(1, -(-n // VECTORS_PER_GROUP))
    codes, norms = kern(
        inputs=[x.reshape(n, D), signs, boundaries],
        template=[("D", D), ("DP", dim), ("BITS", bits), ("VPG", VECTORS_PER_GROUP),
                  ("NORM_F16", norm_dtype == mx.float16), ("OUT_T", norm_dtype)],
        grid=(32 * VECTORS_PER_GROUP * groups, 1, 1), threadgroup=(32 * VECTORS_PER_GROUP, 1, 1),
        output_shapes=[(n, dim * bits // 32), (n,)], output_dtypes=[mx.uint32, norm_dtype])
    return codes.reshape(*lead, dim * bits // 32), norms.reshape(lead)


def dequantize(codes: mx.array, norms: mx.array, signs: mx.array, centroids: mx.array, bits: int, head_dim: int,
               dtype, backend: str) -> mx.array:
    """Inverse of :func:`quantize`: ``‖x‖ · diag(s) H c[codes] / sqrt(D_pad)`` with the padding dropped.

    :return: ``[..., head_dim]`` of ``dtype``. :raises ValueError: as :func:`quantize`.
    """
    if not supported(head_dim, bits):
        raise ValueError(f"fused dequantize serves head_dim padded to 32..256 and bits 1..4; got {head_dim}, "
                         f"{bits}")
    dim, lead = _padded(head_dim), codes.shape[:-1]
    n = 1
    for s in lead:
        n *= s
    kern = kernel("tq_dequantize", backend, ("codes", "norms", "signs", "centroids"), ("out",),
                  DEQUANTIZE_SOURCE)
    groups = max(1, -(-n // VECTORS_PER_GROUP))
    (out,) = kern(
        inputs=[codes.reshape(n, codes.shape[-1]), norms.reshape(n), signs, centroids],
        template=[("D", head_dim), ("DP", dim), ("BITS", bits), ("VPG", VECTORS_PER_GROUP),
                  ("OUT_T", dtype)],
        grid=(32 * VECTORS_PER_GROUP * groups, 1, 1), threadgroup=(32 * VECTORS_PER_GROUP, 1, 1),
        output_shapes=[(n, head_dim)], output_dtypes=[dtype])
    return out.reshape(*lead, head_dim)
