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

import mlx.core as mx
from kvq_metal import BACKENDS, streams
from kvq_metal import base
from kvq_metal.base import KernelImpl, _check_key
from kvq_metal.common import check_attend, decode_shape_ok, query_rows

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


class VecInferKernels(KernelImpl):
    """Kernel implementation of ``vecinfer`` (attend only; see the module docstring)."""

    method = "vecinfer"

    def kernel_supports(self, problem) -> bool:
        """Decode attention with codebooks the kernel holds in shared memory; the first-use check runs per call
        signature in :meth:`kvq_attend`."""
        if problem.op != "attend" or not decode_shape_ok(problem):
            return False
        p = problem.params or VecInferParams()
        return (1 << p.code_bits) * p.sub_dim <= streams.MAX_TABLE and problem.head_dim % p.sub_dim == 0

    def cost(self, problem) -> float:
        """One query transform, one kernel over the codes of K and V, the merge and the output's inverse rotation."""
        p = problem.params or VecInferParams()
        B, H, T, D = problem.shape
        return self.estimate(problem, launches=6, bytes_moved=2 * B * H * T * D * p.code_bits / p.sub_dim / 8)

    def attend_kernel(self, queries, keys, values, scale):
        """The kernel path of :meth:`kvq_attend` (no checks)."""
        smoothing = _layer(keys.params, keys.shape[1]).smoothing
        inverse = _layer(values.params, values.shape[1]).smoothing
        return streams.attend_streams(queries, scale, keys.shape[1], stream_call(keys, values),
                                      lambda q: vq.transform_queries(q, smoothing),
                                      lambda out: vq.inverse_transform(out, inverse), self.backend)

    def _serves(self, queries, keys, values, mask) -> bool:
        if mask is not None or keys.num_tokens == 0 or queries.shape[-1] != keys.head_dim:
            return False
        if queries.shape[1] % keys.shape[1] or values.head_dim != keys.head_dim:
            return False
        call = stream_call(keys, values)
        rows = query_rows(queries, keys)
        if call is None or not streams.supported(call, rows):
            return False
        key = (_check_key(keys.params), _check_key(values.params), keys.head_dim, rows, queries.dtype)
        quantize = self.fallback().kvq_quantize
        return base.first_use_check(self.backend, "decode_attend_streams[vecinfer]", key,
                               lambda: check_attend(self, quantize, keys.params, values.params, keys.head_dim,
                                                    rows, queries.dtype, heads=keys.shape[1]))

    def kvq_attend(self, queries, keys, values, scale, mask):
        """``kvq_attend`` spec; pure MLX serves masks, large codebooks and shapes beyond the kernel."""
        if not self._serves(queries, keys, values, mask):
            return self.fallback().kvq_attend(queries, keys, values, scale, mask)
        return self.attend_kernel(queries, keys, values, scale)

    def attend_dense(self, queries, keys, values, scale, dense):
        """Not offered: the streams kernel reads no uncompressed tokens (the cache attends them apart)."""
        return None

    def bind_dense(self, queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values):
        """Not offered (see :meth:`attend_dense`)."""
        return None


def implementations() -> list:
    """The kernel implementation objects of ``vecinfer`` on both back ends (each offers itself only on its GPU)."""
    return [VecInferKernels(backend) for backend in BACKENDS]
