"""The pure-MLX implementation of ``turboquant_rvq``: quantize, dequantize, attend (pack is kvq's generic packer).

Attention follows kvq's block protocol (:func:`kvq.attention.attend_encoded`), as ``turboquant`` does: the query is
rotated once; each block of keys is scored against ``c1[idx1] + c2[idx2]`` in the rotated domain and scaled by the
stored norms; values are decoded and weighted in the rotated domain one block at a time; the output is
inverse-rotated once. No block is brought back to the original domain.

Memory: :func:`kvq.attention.attend_encoded` runs one block at a time (at most
:data:`kvq.attention.VECTOR_BUDGET_BYTES` of float32 keys and values, or 256 tokens); a block's working set is at
most 10 float32 copies of its keys and 10 of its values at ``D_pad`` (two stages of unpacked codes and centroids:
measured on the CPU, 4 at 2 + 2 bits, 9.5 at 3 + 3 bits, whose codes straddle words).
"""

from __future__ import annotations

import mlx.core as mx

from kvq.attention import attend_encoded
from kvq.costmodel import estimate
from kvq.encoded import Encoded
from kvq.validate import float_array

from . import mse, rvq
from .impl import check_attend_inputs, head_dim_supported, padding_note
from .rvq import TurboQuantRVQParams


def _tokens_axis(a: mx.array) -> mx.array:
    """``[B, H, n]`` per-token scalars -> ``[B, H, 1, 1, n]`` float32, to scale ``[B, H, n_rep, T_q, n]`` scores."""
    return a.astype(mx.float32)[:, :, None, None, :]


class TurboQuantRVQMLX:
    """Pure-MLX implementation object of ``turboquant_rvq`` (every device and float dtype, head_dim 1..1024)."""

    method = "turboquant_rvq"
    backend = "mlx"
    params_class = TurboQuantRVQParams

    def __repr__(self) -> str:
        return "TurboQuantRVQMLX()"

    # -- selection ----------------------------------------------------------------------------------
    def supports(self, problem) -> bool:
        """Every device and float dtype; head_dim 1..1024."""
        return head_dim_supported(problem.params or self.params_class(), problem.head_dim)

    def explain(self, problem) -> str:
        """Where the rotation pads head_dim, the padded size and its bits per coordinate (else ``""``)."""
        return padding_note(problem.params or self.params_class(), problem.head_dim)

    def cost(self, problem) -> float:
        """Estimated seconds, counted like ``turboquant``'s (elementwise passes over float32 ``[B, H, T, D_pad]``)
        with both stages' encode comparisons and bit-unpacking passes."""
        B, H, T, D = problem.shape
        params = problem.params or TurboQuantRVQParams()
        b1, b2 = params.stage_bits
        coords = B * H * T * params.rotated_dim(D)
        decode_passes = 12 + 8 * (b1 + b2)
        if problem.op == "quantize":
            passes = 20 + 2**b1 + 2**b2 + 8 * (b1 + b2)
            return estimate(problem, launches=26, bytes_moved=4 * coords * passes, flops=coords * 10)
        if problem.op == "dequantize":
            return estimate(problem, launches=16, bytes_moved=4 * coords * decode_passes, flops=coords * 5)
        q_rows = B * (problem.num_q_heads or H) * problem.num_queries
        return estimate(problem, launches=34, bytes_moved=8 * coords * decode_passes,
                        flops=4 * q_rows * T * params.rotated_dim(D))

    # -- ops ----------------------------------------------------------------------------------------
    def kvq_quantize(self, x, params):
        """Encode ``x`` float16/bfloat16/float32 ``[B, H_kv, T, D]`` into ``codes``, ``residual_codes``, ``norms``
        (see :mod:`kvq_backends_turboquant.rvq`).

        :raises TypeError: ``params`` not a :class:`TurboQuantRVQParams`, ``x`` not a float ``mx.array``.
        :raises ValueError: ``x`` not rank 4, unsupported head_dim.
        """
        if not isinstance(params, TurboQuantRVQParams):
            raise TypeError(f"params must be a TurboQuantRVQParams for method 'turboquant_rvq'; got {params!r}")
        x = float_array("x", x)
        D = x.shape[-1]
        params.check_head_dim(D)
        unit, norms = mse.normalise(x)
        fields, _ = rvq.encode_rotated(mse.rotation_of(params, D).forward(unit), params)
        fields["norms"] = mse.store_norms(norms, params)
        return Encoded(params, fields, D)

    def kvq_dequantize(self, encoded, dtype):
        """``[B, H_kv, T, D]`` of ``dtype``: ``‖x‖ · Πᵀ (c1[idx1] + c2[idx2])`` with the padding dropped."""
        D = encoded.head_dim
        y = rvq.decode_rotated(encoded.data, encoded.params, D) * encoded.data["norms"].astype(mx.float32)[..., None]
        return mse.rotation_of(encoded.params, D).inverse(y)[..., :D].astype(dtype)

    def kvq_attend(self, queries, keys, values, scale, mask):
        """Attention over ``turboquant_rvq`` keys and values; see the ``kvq_attend`` spec for shapes. Memory above
        the cache: one block's working set at a time (the module docstring) plus its scores.

        :raises ValueError: keys or values of another method, or queries whose head_dim differs from the keys'.
        """
        queries = check_attend_inputs(self.method, (self.method,), queries, keys, values)
        return attend_encoded(queries, keys, values, scale, mask, self, self)

    # -- block protocol (kvq.attention.attend_encoded) -----------------------------------------------
    def prepare_queries(self, q, keys):
        """Scaled float32 ``q`` ``[B, H_kv, n_rep, T_q, D]`` -> ``Π q`` ``[..., D_pad]`` (once per attend)."""
        return mse.rotation_of(keys.params, keys.head_dim).forward(q)

    def scores(self, q, keys, start, stop):
        """``q · k̃`` for keys ``start:stop``: float32 ``[B, H_kv, n_rep, T_q, stop - start]``, from
        ``c1[idx1] + c2[idx2]`` in the rotated domain times the stored norms. Working set: at most 10 float32
        copies of the block's keys at ``D_pad``."""
        block = keys.tokens(start, stop)
        y_hat = rvq.decode_rotated(block.data, block.params, keys.head_dim)[:, :, None]
        return (q @ y_hat.swapaxes(-1, -2)) * _tokens_axis(block.data["norms"])

    def weighted_values(self, p, values, start, stop):
        """``p @ ṽ`` for values ``start:stop`` in the rotated domain: float32 ``[B, H_kv, n_rep, T_q, D_pad]``.
        Working set: at most 10 float32 copies of the block's values at ``D_pad``."""
        block = values.tokens(start, stop)
        weights = p * _tokens_axis(block.data["norms"])
        return weights @ rvq.decode_rotated(block.data, block.params, values.head_dim)[:, :, None]

    def finish_values(self, out, values):
        """Normalised rotated-domain output -> ``[B, H_kv, n_rep, T_q, D]``: one inverse rotation, padding dropped."""
        D = values.head_dim
        return mse.rotation_of(values.params, D).inverse(out)[..., :D]
