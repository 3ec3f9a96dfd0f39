"""``turboquant_prod`` decode attention on kvq_metal's streams kernel (:mod:`kvq_metal.streams`).

TurboQuant-prod (Zandieh et al., arXiv 2504.19874, algorithm 2) stores, per token, the MSE stage's codes at
``bits - 1`` with the norm, and ``sign(S r)`` of the residual with ``‖r‖``. Its score is
``‖x‖ (Σ_j (Π q)_j c[code_j] + sqrt(π/2)/m · ‖r‖ · ⟨S Π q, sign(S r)⟩)``: two key streams, the rotated query and
the sketched rotated query side by side in one prepared row. Its value is the same sum, accumulated in the
rotated and the sketch domains side by side; the pure-MLX implementation's ``finish_values`` then adds
``Sᵀ`` of the second and inverse-rotates once (:mod:`kvq_backends_turboquant.prod`). Queries are prepared by the
pure-MLX implementation too (``prepare_queries``), so both share one formula.

Served: decode (at most :data:`kvq_metal.attend.MAX_ROWS` query rows per KV head), no mask, keys
``turboquant_prod`` and values of ``turboquant`` or ``turboquant_prod``, without outlier channels, MSE stage of
at least 1 bit; shapes :func:`kvq_metal.streams.supported` takes. Quantize (a cache's window flush) is one
fused launch (``tq_prod_quantize.kvq``: :func:`kvq_backends_turboquant.kernels.quantize.quantize_prod`) with the
randomized Hadamard rotation at a power of two in 32..256 and an MSE stage of 1-4 bits. Pure MLX serves the rest
with the same result.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
from kvq.encoded import Encoded
from kvq_metal import streams
from kvq_metal.base import first_use_check
from kvq_metal.common import code_mismatch, decode_shape_ok, normal, relative_error
from kvq_metal.streams_impl import StreamsKernelImpl

from .. import codebook, rotation
from ..impl import FAMILY, _is_prod, _is_split, head_dim_supported
from ..params import TurboQuantProdParams
from ..prod import qjl_scale, sketch_of
from . import quantize as fused


def _mse_bits(params) -> int:
    return params.stage_bits[0] if _is_prod(params) else params.bits


@lru_cache(maxsize=64)
def _centroids(dim: int, bits: int) -> mx.array:
    return codebook.codebook(dim, bits).centroids.reshape(1, -1)


@lru_cache(maxsize=64)
def _sign_table(dim: int) -> mx.array:
    c = qjl_scale(dim)
    return mx.array([[-c, c]], mx.float32)


def side_streams(encoded, offset: int) -> list[streams.Stream]:
    """The streams of one side: the MSE stage (norm-scaled centroids), and for ``turboquant_prod`` the residual's
    sign bits (scaled by the norm and the residual norm) whose query coordinates follow at ``offset + dim``."""
    p, d = encoded.params, encoded.data
    dim = p.rotated_dim(encoded.head_dim)
    bits = _mse_bits(p)
    out = [streams.Stream(d["codes"], dim, bits, _centroids(dim, bits), scales=(d["norms"],), offset=offset)]
    if _is_prod(p):
        out.append(streams.Stream(d["signs"], dim, 1, _sign_table(dim), scales=(d["norms"], d["residual_norms"]),
                                  offset=offset + dim))
    return out


def stream_call(keys, values) -> streams.StreamCall | None:
    """The :class:`kvq_metal.streams.StreamCall` of ``turboquant_prod`` keys and turboquant-family values;
    ``None`` for what is not served (outlier channels, a 0-bit MSE stage, other methods)."""
    if keys.method != "turboquant_prod" or values.method not in FAMILY:
        return None
    if _is_split(keys.params) or _is_split(values.params):
        return None
    if _mse_bits(keys.params) < 1 or _mse_bits(values.params) < 1:
        return None
    dim = keys.params.rotated_dim(keys.head_dim)
    return streams.StreamCall(tuple(side_streams(keys, 0)), tuple(side_streams(values, 0)), 2 * dim)


class TurboQuantProdKernels(StreamsKernelImpl):
    """Kernel implementation of ``turboquant_prod`` (decode attention; see the module docstring and
    :class:`kvq_metal.streams_impl.StreamsKernelImpl`)."""

    method = "turboquant_prod"

    def kernel_supports(self, problem) -> bool:
        """Decode attention over plain ``turboquant_prod`` keys (no outlier channels, MSE stage >= 1 bit); the
        first-use check runs per call signature (the values' parameters are not part of a problem). Quantize where
        :meth:`encoder_serves`, after its first-use check (:meth:`_check_codec`) per (parameters, head_dim,
        dtype)."""
        p = problem.params or TurboQuantProdParams()
        if problem.op == "quantize":
            if not self.encoder_serves(p, problem.head_dim):
                return False
            return first_use_check(self.backend, "tq_prod_codec", (p, problem.head_dim, str(problem.dtype)),
                                   lambda: self._check_codec(p, problem.head_dim, problem.dtype))
        if problem.op != "attend" or not decode_shape_ok(problem):
            return False
        return not _is_split(p) and _mse_bits(p) >= 1

    @staticmethod
    def encoder_serves(params, head_dim: int) -> bool:
        """Whether the fused encoder takes ``turboquant_prod`` ``params`` at ``head_dim``: no outlier channels, the
        randomized Hadamard rotation at a power of two in 32..256 (:func:`~.quantize.supported`), an MSE stage of
        1-4 bits (prod ``bits`` 2-5; a 0-bit stage is left to pure MLX)."""
        if not (isinstance(params, TurboQuantProdParams) and params.outlier_channels == 0 and not _is_split(params)
                and params.rotation == "hadamard" and head_dim_supported(params, head_dim)):
            return False
        dim = params.rotated_dim(head_dim)
        return dim & (dim - 1) == 0 and fused.supported(head_dim, dim, _mse_bits(params))

    def kvq_quantize(self, x, params):
        """``kvq_quantize`` spec: the fields of the pure-MLX encoder (``codes``, ``norms``, ``signs``,
        ``residual_norms``) from one launch where :meth:`encoder_serves`, else the pure-MLX encoder (its errors)."""
        if not (isinstance(x, mx.array) and x.ndim == 4 and x.size and
                x.dtype in (mx.float16, mx.bfloat16, mx.float32) and self.encoder_serves(params, x.shape[-1])):
            return self.fallback().kvq_quantize(x, params)
        D = x.shape[-1]
        dim, bits = params.rotated_dim(D), _mse_bits(params)
        book = codebook.codebook(dim, bits)
        norm_dtype = mx.float16 if params.norm_dtype == "float16" else mx.float32
        codes, norms, signs, rnorms = fused.quantize_prod(
            x, rotation.rotation("hadamard", dim, params.seed).signs, book.boundaries, book.centroids,
            sketch_of(params, D), bits, norm_dtype, self.backend)
        return Encoded(params, {"codes": codes, "norms": norms, "signs": signs, "residual_norms": rnorms}, D)

    def _check_codec(self, params, head_dim: int, dtype) -> tuple[bool, str]:
        """Encode 512 random vectors with both implementations: at most 0.1% of codes and of residual sign bits may
        differ (a coordinate within float rounding of a cell boundary, a projection within rounding of 0), and
        both norms agree within 1e-3 relative."""
        x = normal((1, 2, 256, head_dim), 9, dtype, scale=3.0)
        got, want = self.kvq_quantize(x, params), self.fallback().kvq_quantize(x, params)
        dim, bits = params.rotated_dim(head_dim), _mse_bits(params)
        differ = code_mismatch(got.data["codes"], want.data["codes"], bits, dim)
        signs = code_mismatch(got.data["signs"], want.data["signs"], 1, dim)
        norm_err = relative_error(got.data["norms"], want.data["norms"])
        rnorm_err = relative_error(got.data["residual_norms"], want.data["residual_norms"])
        ok = differ <= 1e-3 and signs <= 1e-3 and norm_err < 1e-3 and rnorm_err < 1e-3
        return ok, (f"{differ:.2e} of codes and {signs:.2e} of signs differ, norm errors {norm_err:.2e}, "
                    f"{rnorm_err:.2e}")

    def cost(self, problem) -> float:
        """Attend: one query rotation and sketch, one kernel over the codes, signs and norms of K and V, the split
        merge and the output's inverse transforms. Quantize: one kernel reading each vector once (plus the sketch's
        ``D_pad^2`` multiply-adds)."""
        p = problem.params or TurboQuantProdParams()
        B, H, T, D = problem.shape
        dim = p.rotated_dim(D)
        packed = B * H * T * (dim * p.bits / 8 + 2 * p.norm_bits / 8)
        if problem.op == "quantize":
            return self.estimate(problem, launches=1, bytes_moved=packed + B * H * T * D * problem.dtype.size,
                                 flops=2 * B * H * T * dim * dim)
        return self.estimate(problem, launches=3, bytes_moved=2 * packed)

    def stream_call(self, keys, values):
        """:func:`stream_call`."""
        return stream_call(keys, values)

    def prepare(self, keys):
        """The pure-MLX implementation's ``prepare_queries``: ``[Π q | S Π q]``."""
        mlx_impl = self.fallback()
        return lambda q: mlx_impl.prepare_queries(q, keys)

    def finish(self, values):
        """The pure-MLX implementation's ``finish_values``: ``Πᵀ (y + (Σ p γ sign) S)`` for prod values."""
        mlx_impl = self.fallback()
        return lambda out: mlx_impl.finish_values(out, values)
