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
at least 1 bit; shapes :func:`kvq_metal.streams.supported` takes. Quantize stays pure MLX. Pure MLX serves the
rest with the same result.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
from kvq_metal import streams
from kvq_metal.common import decode_shape_ok

from .. import codebook
from ..impl import FAMILY, _is_prod, _is_split
from ..params import TurboQuantProdParams
from ..prod import qjl_scale


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


class TurboQuantProdKernels(streams.StreamsKernelImpl):
    """Kernel implementation of ``turboquant_prod`` (decode attention; see the module docstring and
    :class:`kvq_metal.streams.StreamsKernelImpl`)."""

    method = "turboquant_prod"

    def kernel_supports(self, problem) -> bool:
        """Decode attention over plain ``turboquant_prod`` keys (no outlier channels, MSE stage >= 1 bit); the
        first-use check runs per call signature (the values' parameters are not part of a problem)."""
        if problem.op != "attend" or not decode_shape_ok(problem):
            return False
        p = problem.params or TurboQuantProdParams()
        return not _is_split(p) and _mse_bits(p) >= 1

    def cost(self, problem) -> float:
        """One query rotation and sketch, one kernel over the codes, signs and norms of K and V, the split merge
        and the output's inverse transforms."""
        p = problem.params or TurboQuantProdParams()
        B, H, T, D = problem.shape
        dim = p.rotated_dim(D)
        packed = B * H * T * (dim * p.bits / 8 + 2 * p.norm_bits / 8)
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
