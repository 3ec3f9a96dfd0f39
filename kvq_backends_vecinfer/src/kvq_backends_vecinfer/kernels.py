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
"""

from __future__ import annotations

from kvq_metal import BACKENDS, streams
from kvq_metal.common import decode_shape_ok

from . import vq
from .impl import _layer
from .params import VecInferParams


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


class VecInferKernels(streams.StreamsKernelImpl):
    """Kernel implementation of ``vecinfer`` (decode attention; see the module docstring and
    :class:`kvq_metal.streams.StreamsKernelImpl`)."""

    method = "vecinfer"
    prepare_per_head = True  # the keys' smoothing factors are per KV head

    def kernel_supports(self, problem) -> bool:
        """Decode attention with codebooks the kernel holds in shared memory; the first-use check runs per call
        signature."""
        if problem.op != "attend" or not decode_shape_ok(problem):
            return False
        p = problem.params or VecInferParams()
        return (1 << p.code_bits) * p.sub_dim <= streams.MAX_TABLE and problem.head_dim % p.sub_dim == 0

    def cost(self, problem) -> float:
        """One query transform, one kernel over the codes of K and V, the merge with the inverse rotation."""
        p = problem.params or VecInferParams()
        B, H, T, D = problem.shape
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
