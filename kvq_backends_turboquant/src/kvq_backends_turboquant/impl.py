"""The pure-MLX implementation of ``turboquant`` and ``turboquant_prod``: quantize, dequantize, attend.

Zandieh et al., TurboQuant (arXiv 2504.19874). Attention follows kvq's block protocol
(:func:`kvq.attention.attend_encoded`): the query is rotated (and, for ``turboquant_prod`` keys, sketched) once;
each block of keys is scored against its centroids in the rotated domain and scaled by the stored norms; each
block of values is decoded in the rotated domain and weighted there; the output is inverse-rotated once. No block
is ever brought back to the original domain, and no more than one block is decoded at a time. ``turboquant`` with
data-chosen outlier channels (``outlier_select="data"``) does the same per channel group
(:mod:`~kvq_backends_turboquant.outliers`).

Memory: :func:`kvq.attention.attend_encoded` runs one block at a time (blocks of at most
:data:`kvq.attention.VECTOR_BUDGET_BYTES` of float32 keys and values, or 256 tokens), and each block's working
set is at most 6 float32 copies of its keys (:meth:`TurboQuantMLX.scores`) and 6 of its values
(:meth:`TurboQuantMLX.weighted_values`), in the rotated domain (``D_pad`` coordinates): unpacked codes,
centroids, and for ``turboquant_prod`` the sign bits as ±1 floats. Decode holds that above the cache, whatever
the context.
"""

from __future__ import annotations

import mlx.core as mx

from kvq.attention import attend_encoded, check_query_dim
from kvq.costmodel import estimate
from kvq.encoded import Encoded
from kvq.validate import float_array

from . import mse, outliers, prod
from .params import TurboQuantParams, TurboQuantProdParams
from .rotation import group_dim

FAMILY = ("turboquant", "turboquant_prod")


def _is_prod(params) -> bool:
    return isinstance(params, TurboQuantProdParams)


def _is_split(params) -> bool:
    """Data-chosen outlier channels: two TurboQuant instances (:mod:`~kvq_backends_turboquant.outliers`)."""
    return getattr(params, "data_chosen", False)


def _tokens_axis(a: mx.array) -> mx.array:
    """``[B, H, n]`` per-token scalars -> ``[B, H, 1, 1, n]`` float32, to scale ``[B, H, n_rep, T_q, n]`` scores."""
    return a.astype(mx.float32)[:, :, None, None, :]


def head_dim_supported(params, head_dim: int) -> bool:
    """Whether ``params.check_head_dim(head_dim)`` accepts ``head_dim`` (the family's only limit on a problem)."""
    try:
        params.check_head_dim(head_dim)
    except ValueError:
        return False
    return True


def padding_note(params, head_dim: int) -> str:
    """``"head_dim 72 zero-padded to 80 for the rotation: 4.44 bits per coordinate"`` where the rotated vectors of
    ``params`` (both channel groups' with data-chosen outliers) have more coordinates than ``head_dim``, else
    ``""`` (also for a head_dim ``params`` does not support: :meth:`explain` must not raise)."""
    if not head_dim_supported(params, head_dim):
        return ""
    if _is_split(params):
        k = params.outlier_channels
        dim = sum(group_dim(n, params.rotation) for n in (k, head_dim - k))
    else:
        dim = params.rotated_dim(head_dim)
    if dim == head_dim:
        return ""
    bits = params.accounting(head_dim).bits_per_coordinate
    return f"head_dim {head_dim} zero-padded to {dim} for the rotation: {bits:.4g} bits per coordinate"


def check_attend_inputs(method: str, accepted: tuple[str, ...], queries, keys, values) -> mx.array:
    """Validate the inputs of a turboquant-family ``kvq_attend``; returns ``queries`` as a float ``mx.array``.

    :raises ValueError: keys or values encoded by a method outside ``accepted``, or queries whose head_dim differs
        from the keys'. :raises TypeError: queries that are not a float ``mx.array``.
    """
    for name, encoded in (("keys", keys), ("values", values)):
        if encoded.method not in accepted:
            raise ValueError(f"{name}: {method} attend needs {' or '.join(accepted)}-encoded {name}; "
                             f"got {encoded.method!r}")
    queries = float_array("queries", queries)
    check_query_dim(queries, keys.head_dim)
    return queries


class TurboQuantMLX:
    """Pure-MLX implementation object for one method of the family (``method`` is ``"turboquant"`` or
    ``"turboquant_prod"``). The variant actually computed follows the parameter object it is handed.

    :raises ValueError: from the constructor, for a method outside :data:`FAMILY`.
    """

    backend = "mlx"

    def __init__(self, method: str) -> None:
        if method not in FAMILY:
            raise ValueError(f"method must be one of {', '.join(FAMILY)}; got {method!r}")
        self.method = method
        self.params_class = TurboQuantProdParams if method == "turboquant_prod" else TurboQuantParams

    def __repr__(self) -> str:
        return f"TurboQuantMLX({self.method!r})"

    # -- selection ----------------------------------------------------------------------------------
    def supports(self, problem) -> bool:
        """Every device and float dtype; head_dim 1..1024 (zero-padded to ``params.rotated_dim(head_dim)``)."""
        return head_dim_supported(problem.params or self.params_class(), problem.head_dim)

    def explain(self, problem) -> str:
        """Where the rotation pads head_dim, the padded size and the bits per coordinate that it costs
        (:class:`kvq.contract.Explains`); ``""`` otherwise."""
        return padding_note(problem.params or self.params_class(), problem.head_dim)

    def cost(self, problem) -> float:
        """Estimated seconds. Bytes are counted as the pure-MLX ops move them: every elementwise pass over the
        ``[B, H, T, D_pad]`` float32 vectors (bit packing touches ``bits`` words per code, the encoder compares with
        ``2**bits - 1`` boundaries), which puts the CPU estimate within ~3x of measured times."""
        B, H, T, D = problem.shape
        params = problem.params or self.params_class()
        dim, prod_ = params.rotated_dim(D), _is_prod(params)
        bits = max(params.stage_bits)
        coords = B * H * T * dim
        sketch_flops = 2 * B * H * T * dim * dim if prod_ else 0
        decode_passes = 10 + 8 * bits + 8 * prod_
        if problem.op == "quantize":
            passes = 16 + 2**bits + 8 * bits + 16 * prod_
            return estimate(problem, launches=20, bytes_moved=4 * coords * passes, flops=coords * 8 + sketch_flops)
        if problem.op == "dequantize":
            return estimate(problem, launches=12, bytes_moved=4 * coords * decode_passes,
                            flops=coords * 4 + sketch_flops)
        q_rows = B * (problem.num_q_heads or H) * problem.num_queries
        dot_flops = 4 * q_rows * T * dim * (2 if prod_ else 1)
        return estimate(problem, launches=30, bytes_moved=8 * coords * decode_passes, flops=dot_flops)

    # -- ops ----------------------------------------------------------------------------------------
    def kvq_quantize(self, x, params):
        """Encode ``x`` float16/bfloat16/float32 ``[B, H_kv, T, D]`` (see the package docstring for the fields).

        :raises TypeError: ``params`` of the wrong class, ``x`` not a float ``mx.array``.
        :raises ValueError: ``x`` not rank 4, unsupported head_dim.
        """
        if not isinstance(params, self.params_class):
            raise TypeError(f"params must be a {self.params_class.__name__} for method {self.method!r}; "
                            f"got {params!r}")
        x = float_array("x", x)
        D = x.shape[-1]
        params.check_head_dim(D)
        if _is_split(params):
            return Encoded(params, outliers.quantize(x, params), D)
        fields, y, y_hat = mse.quantize(x, params)
        if _is_prod(params):
            fields.update(prod.encode_residual(y - y_hat, params, D))
        return Encoded(params, fields, D)

    def kvq_dequantize(self, encoded, dtype):
        """``[B, H_kv, T, D]`` of ``dtype``: ``‖x‖ · Πᵀ ỹ`` with the padding dropped (an estimate for ``_prod``,
        unbiased in inner products)."""
        if _is_split(encoded.params):
            return outliers.dequantize(encoded.data, encoded.params, encoded.head_dim).astype(dtype)
        y = self._decode_block(encoded) * encoded.data["norms"].astype(mx.float32)[..., None]
        D = encoded.head_dim
        return mse.rotation_of(encoded.params, D).inverse(y)[..., :D].astype(dtype)

    def kvq_attend(self, queries, keys, values, scale, mask):
        """Attention over turboquant-family keys and values (either variant on either side); see the
        ``kvq_attend`` spec for shapes. Memory above the cache: one block's working set at a time (the module
        docstring: at most 6 + 6 float32 copies of a block's rotated keys and values) plus its scores.
        :raises ValueError: values of another method, mismatched head_dim."""
        queries = check_attend_inputs(self.method, FAMILY, queries, keys, values)
        return attend_encoded(queries, keys, values, scale, mask, self, self)

    # -- block protocol (kvq.attention.attend_encoded) -----------------------------------------------
    def prepare_queries(self, q, keys):
        """Scaled float32 ``q`` ``[B, H_kv, n_rep, T_q, D]`` -> ``Π q`` ``[..., D_pad]``, followed for
        ``turboquant_prod`` keys by ``S Π q`` ``[..., D_pad]`` (concatenated on the last axis)."""
        D = keys.head_dim
        if _is_split(keys.params):
            return outliers.rotate_queries(q, keys.params, D)
        rotated = mse.rotation_of(keys.params, D).forward(q)
        if not _is_prod(keys.params):
            return rotated
        return mx.concatenate([rotated, rotated @ prod.sketch_of(keys.params, D).T], axis=-1)

    def scores(self, q, keys, start, stop):
        """``q · k̃`` for keys ``start:stop``: float32 ``[B, H_kv, n_rep, T_q, stop - start]``, from the centroids
        (and sign bits) in the rotated domain, times the stored norms. Working set: at most 6 float32 copies of
        the block's keys at ``D_pad`` (measured on the CPU: 2 at 1, 2 and 4 bits, 5 at 3 bits; ``turboquant_prod``
        3 to 5.6)."""
        block, D = keys.tokens(start, stop), keys.head_dim
        if _is_split(block.params):
            return outliers.scores(q, block, D)
        dim = block.params.rotated_dim(D)
        y_hat = mse.decode_rotated(block.data, block.params, D)[:, :, None]
        s = q[..., :dim] @ y_hat.swapaxes(-1, -2)
        if _is_prod(block.params):
            signs = prod.signs_of(block.data, block.params, D)[:, :, None]
            gamma = _tokens_axis(block.data["residual_norms"]) * prod.qjl_scale(dim)
            s = s + (q[..., dim:] @ signs.swapaxes(-1, -2)) * gamma
        return s * _tokens_axis(block.data["norms"])

    def weighted_values(self, p, values, start, stop):
        """``p @ ṽ`` for values ``start:stop`` in the rotated domain: float32 ``[B, H_kv, n_rep, T_q, D_pad]``
        (``[..., 2 D_pad]`` for ``turboquant_prod``: the sketch-domain sum follows, for :meth:`finish_values`).
        Working set: as :meth:`scores`, at most 6 float32 copies of the block's values at ``D_pad``."""
        block, D = values.tokens(start, stop), values.head_dim
        if _is_split(block.params):
            return outliers.weighted_values(p, block, D)
        weights = p * _tokens_axis(block.data["norms"])
        out = weights @ mse.decode_rotated(block.data, block.params, D)[:, :, None]
        if not _is_prod(block.params):
            return out
        gamma = _tokens_axis(block.data["residual_norms"]) * prod.qjl_scale(block.params.rotated_dim(D))
        return mx.concatenate([out, (weights * gamma) @ prod.signs_of(block.data, block.params, D)[:, :, None]],
                              axis=-1)

    def finish_values(self, out, values):
        """Normalised rotated-domain output -> ``[B, H_kv, n_rep, T_q, D]``: adds ``(Σ p γ sign) S`` for
        ``turboquant_prod``, inverse-rotates once and drops the padding."""
        D = values.head_dim
        if _is_split(values.params):
            return outliers.finish_values(out, values.params, D)
        dim = values.params.rotated_dim(D)
        y = out[..., :dim]
        if _is_prod(values.params):
            y = y + out[..., dim:] @ prod.sketch_of(values.params, D)
        return mse.rotation_of(values.params, D).inverse(y)[..., :D]

    def _decode_block(self, encoded) -> mx.array:
        """Unit-vector reconstruction ``ỹ`` in the rotated domain, float32 ``[B, H, T, D_pad]``."""
        D = encoded.head_dim
        y = mse.decode_rotated(encoded.data, encoded.params, D)
        if _is_prod(encoded.params):
            y = y + prod.decode_residual(encoded.data, encoded.params, D)
        return y
