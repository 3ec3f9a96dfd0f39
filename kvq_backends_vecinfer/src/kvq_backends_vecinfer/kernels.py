"""``vecinfer`` decode attention on kvq_metal's streams kernel (:mod:`kvq_metal.streams`).

VecInfer (Yao et al., arXiv 2510.06175) stores each key and value as ``head_dim / sub_dim`` codes indexing a
layer's k-means codebook of sub-vectors. The kernel holds both codebooks in shared memory and reads each code once:
a key's score is ``Σ_sub q'_sub · centroid[code_sub]`` with ``q' = H (s ⊙ q)`` prepared once per call, a value is
accumulated from its centroids in the rotated domain, and the output is inverse-rotated once (the pure-MLX
implementation's ``transform_queries`` / ``inverse_transform``: :mod:`kvq_backends_vecinfer.vq`). A vector stored
with the reserved pattern (non-finite input) scores NaN and weighs NaN into the output, as in pure MLX.

Served: decode (at most :data:`kvq_metal.attend.MAX_ROWS` query rows per KV head), no mask, codebooks of at most
:data:`kvq_metal.streams.MAX_TABLE` floats (``2**code_bits * sub_dim``: 8-bit codes of 4 or 8 coordinates, 9-bit
of 4), and shapes :func:`kvq_metal.streams.supported` takes; pure MLX serves the rest with the same result.

Quantize (a cache's window flush) runs the nearest-centroid search, the reserved pattern and the pack in one launch
(``vq_encode.kvq``, :func:`fused_encode`) after the transform ``H (x / s)`` in MLX, where pure MLX makes about a
dozen launches per block.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from kvq import Encoded, packing
from kvq_metal import BACKENDS, streams
from kvq_metal.base import first_use_check
from kvq_metal.common import decode_shape_ok, normal
from kvq_metal.kernel_files import load
from kvq_metal.streams_impl import StreamsKernelImpl

from . import storage, vq
from .impl import _layer
from .params import VecInferParams

#: The fused encoder (kernel file beside this module; :mod:`kvq_metal.kernel_files`).
ENCODE = load(Path(__file__).with_name("vq_encode.kvq"))
#: SIMD groups per thread group of the fused encoder (one token each).
ENCODER_WARPS = 4


def encoder_supports(params: VecInferParams, head_dim: int, dtype) -> bool:
    """Whether :func:`fused_encode` serves keys or values of ``head_dim`` and ``dtype``: float16, bfloat16 or
    float32, head_dim <= 256, and a codebook the kernel holds in threadgroup memory (``2**code_bits * sub_dim`` of
    at most :data:`kvq_metal.streams.MAX_TABLE` floats)."""
    return (dtype in (mx.float16, mx.bfloat16, mx.float32) and head_dim <= 256 and head_dim % params.sub_dim == 0
            and (1 << params.code_bits) * params.sub_dim <= streams.MAX_TABLE)


def fused_encode(x: mx.array, params: VecInferParams, backend: str) -> Encoded:
    """:meth:`kvq_backends_vecinfer.impl.VecInferMLX.kvq_quantize` with the nearest-centroid search, the reserved
    pattern and the pack in one launch of ``vq_encode.kvq`` (VecInfer, Yao et al., arXiv 2510.06175).

    :param x: keys or values ``[B, H_kv, T, D]`` (float16, bfloat16 or float32).
    :return: :class:`kvq.Encoded` with ``codes`` uint32 ``[B, H_kv, T, ceil(M * code_bits / 32)]``, ``M = D /
        sub_dim``. Distances are the kernel's own float32 sums: a sub-vector within rounding of two centroids may
        take the other one than pure MLX's matmul (the first-use check bounds how often).
    :raises ValueError: what :func:`encoder_supports` rejects, or a calibration missing or made for another shape
        (:class:`kvq_backends_vecinfer.storage.CalibrationError`, as pure MLX raises it).
    """
    if x.ndim != 4 or not encoder_supports(params, x.shape[-1], x.dtype):
        raise ValueError(f"x: the fused vecinfer encoder takes [B, H, T, D] float vectors with D <= 256 and "
                         f"codebooks of at most {streams.MAX_TABLE} floats; got {x.shape} {x.dtype} with {params!r}")
    B, H, T, D = x.shape
    params.check_head_dim(D)
    table = _layer(params, H)
    M, bits = params.sub_vectors(D), params.code_bits
    W = packing.packed_words(M, bits)
    kern = ENCODE.kernel(backend, ("y", "cb"), ("codes",))
    (codes,) = kern(inputs=[vq.transform(x, table.smoothing), table.codebook],
                    template=[("D", D), ("S", params.sub_dim), ("K", 1 << bits), ("BITS", bits), ("W", W),
                              ("NW", ENCODER_WARPS)],
                    grid=(32 * ENCODER_WARPS * B * H * -(-T // ENCODER_WARPS), 1, 1),
                    threadgroup=(32 * ENCODER_WARPS, 1, 1), output_shapes=[(B, H, T, W)], output_dtypes=[mx.uint32])
    return Encoded(params, {"codes": codes}, D)


def check_encoder(impl, params: VecInferParams, num_kv_heads: int, head_dim: int, dtype) -> tuple[bool, str]:
    """Encode 64 random tokens of ``num_kv_heads`` heads (one with a NaN coordinate) with :func:`fused_encode` and
    pure MLX: at most 0.5% of the codes may differ (sub-vectors within float rounding of two centroids), and the
    non-finite token must hold the reserved pattern in both."""
    x = normal((1, num_kv_heads, 64, head_dim), 13, mx.float32).at[0, 0, 7, 3].add(float("nan")).astype(dtype)
    got, want = fused_encode(x, params, impl.backend), impl.fallback().kvq_quantize(x, params)
    M = params.sub_vectors(head_dim)
    a, b = (vq.unpack_codes(e.data["codes"], params.code_bits, M) for e in (got, want))
    differ = mx.mean(a != b).item()
    reserved = all(bool(vq.reserved(e.data["codes"], M, params.code_bits)[0, 0, 7].item()) for e in (got, want))
    kept = "kept" if reserved else "lost"
    return differ <= 5e-3 and reserved, f"{differ:.2e} of codes differ, reserved pattern {kept}"


def _stream(encoded) -> streams.Stream:
    p = encoded.params
    book = _layer(p, encoded.shape[1]).codebook  # [G, K, sub_dim]
    return streams.Stream(encoded.data["codes"], encoded.head_dim, p.code_bits, book.reshape(book.shape[0], -1),
                          vec=p.sub_dim, reserved=True)


def stream_call(keys, values) -> streams.StreamCall | None:
    """The :class:`kvq_metal.streams.StreamCall` of vecinfer keys and values (``None`` for other methods or
    roles: pure MLX then raises its own error)."""
    if keys.method != "vecinfer" or values.method != "vecinfer":
        return None
    if keys.params.role != "keys" or values.params.role != "values":
        return None
    return streams.StreamCall((_stream(keys),), (_stream(values),), keys.head_dim)


class VecInferKernels(StreamsKernelImpl):
    """Kernel implementation of ``vecinfer`` (decode attention; see the module docstring and
    :class:`kvq_metal.streams_impl.StreamsKernelImpl`)."""

    method = "vecinfer"
    prepare_per_head = True  # the keys' smoothing factors are per KV head

    def kernel_supports(self, problem) -> bool:
        """Decode attention with codebooks the kernel holds in shared memory; the first-use check runs per call
        signature. Quantize where :func:`encoder_supports` takes the problem and the calibration is there (a
        missing one is pure MLX's error to raise), after its first-use check (:func:`check_encoder`) per
        (parameters, KV heads, head_dim, dtype)."""
        p = problem.params or VecInferParams()
        if problem.op == "quantize":
            B, H, T, D = problem.shape
            if not encoder_supports(p, D, problem.dtype):
                return False
            try:
                _layer(p, H)
            except (storage.CalibrationError, ValueError):
                return False
            return first_use_check(self.backend, "vq_encode", (p, H, D, str(problem.dtype)),
                                   lambda: check_encoder(self, p, H, D, problem.dtype))
        if problem.op != "attend" or not decode_shape_ok(problem):
            return False
        return (1 << p.code_bits) * p.sub_dim <= streams.MAX_TABLE and problem.head_dim % p.sub_dim == 0

    def kvq_quantize(self, x, params):
        """``kvq_quantize`` spec: :func:`fused_encode` where :func:`encoder_supports` takes ``x``, else the pure-MLX
        encoder (its errors)."""
        if (isinstance(params, VecInferParams) and isinstance(x, mx.array) and x.ndim == 4 and x.size
                and encoder_supports(params, x.shape[-1], x.dtype)):
            return fused_encode(x, params, self.backend)
        return self.fallback().kvq_quantize(x, params)

    def cost(self, problem) -> float:
        """Attend: one query transform, one kernel over the codes of K and V, the merge with the inverse rotation.
        Quantize: the transform (three MLX operations) and one kernel that reads each vector once."""
        p = problem.params or VecInferParams()
        B, H, T, D = problem.shape
        if problem.op == "quantize":
            return self.estimate(problem, launches=4, bytes_moved=B * H * T * D * (problem.dtype.size + 8),
                                 flops=2 * B * H * T * D * (1 << p.code_bits))
        return self.estimate(problem, launches=3, bytes_moved=2 * B * H * T * D * p.code_bits / p.sub_dim / 8)

    def stream_call(self, keys, values):
        """:func:`stream_call`."""
        return stream_call(keys, values)

    def prepare(self, keys):
        """``q' = H (s ⊙ q)`` (:func:`kvq_backends_vecinfer.vq.transform_queries`)."""
        smoothing = _layer(keys.params, keys.shape[1]).smoothing
        return lambda q: vq.transform_queries(q, smoothing)

    def finish(self, values):
        """``Hᵀ`` (:func:`kvq_backends_vecinfer.vq.inverse_transform`; values carry no smoothing)."""
        smoothing = _layer(values.params, values.shape[1]).smoothing
        return lambda out: vq.inverse_transform(out, smoothing)

    def check_heads(self, keys) -> int:
        """The calibration's KV heads: its codebooks and smoothing factors are per head."""
        return keys.shape[1]

    def matrix_sources(self, keys, values) -> tuple:
        """The loaded smoothing factors and codebooks of both sides (``kvq calibrate`` in the same process loads new
        ones)."""
        k, v = _layer(keys.params, keys.shape[1]), _layer(values.params, values.shape[1])
        return tuple(a for a in (k.smoothing, k.codebook, v.smoothing, v.codebook) if a is not None)


def implementations() -> list:
    """The kernel implementation objects of ``vecinfer`` on both back ends (each offers itself only on its GPU)."""
    return [VecInferKernels(backend) for backend in BACKENDS]
