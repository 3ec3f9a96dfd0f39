"""The pure-MLX implementation of ``vecinfer``: quantize, dequantize, and attend through kvq's block protocol.

Yao et al., VecInfer (arXiv 2510.06175). Attention never decodes keys to the original domain: the query is
transformed once (``q' = H (s ⊙ q)``) and, in decode (few queries), turned into a table of ``q'`` sub-vector ·
centroid products; each block of keys is then scored by summing table entries gathered by its codes. When the table
would be large (a long prefill chunk) the block's centroids are gathered instead and multiplied with ``q'`` (same
numbers, fewer bytes). Values are decoded block by block in the rotated domain and weighted there; the output is
inverse-transformed once (:meth:`VecInferMLX.finish_values`).

Memory: blocks hold at most :data:`kvq.attention.VECTOR_BUDGET_BYTES` of float32 keys and values (or 256 tokens)
and run one at a time (:func:`kvq.attention.attend_encoded`); a block's working set is its unpacked codes and at
most 2 float32 copies of its values (gathered centroids), plus on the keys' side the gathered table entries
(``M`` floats a token and query row: bounded with the scores). Decode holds that above the cache.

Encoded fields, all ``[B, H_kv, T, ...]``: ``codes`` uint32 ``[B, H_kv, T, ceil(M * code_bits / 32)]``, nothing
else. The codebook comes from the calibration that the parameters name (:mod:`kvq_backends_vecinfer.storage`).
A vector stored with the reserved code pattern (it had a NaN or ±inf coordinate: :mod:`kvq_backends_vecinfer.vq`)
decodes to NaN, and its scores and its weight in the values are NaN, as in an fp16 cache.
"""

from __future__ import annotations

import mlx.core as mx
from kvq.attention import attend_encoded, block_size_for, check_query_dim, token_bytes_of
from kvq.costmodel import estimate
from kvq.encoded import Encoded
from kvq.validate import float_array

from . import storage, vq
from .params import VecInferParams

#: Largest lookup table (float32 bytes, all queries of one call) built by ``prepare_queries``; above it, scores
#: come from gathered centroids and a matmul instead.
TABLE_BUDGET_BYTES = 16 * 2**20


class VecInferMLX:
    """Pure-MLX implementation object of ``vecinfer`` (all four ops but ``pack``, which the generic one serves)."""

    method = "vecinfer"
    backend = "mlx"

    def __repr__(self) -> str:
        return "VecInferMLX()"

    # -- selection ----------------------------------------------------------------------------------
    def supports(self, problem) -> bool:
        """Every device and float dtype; head_dim a Hadamard size divisible by ``sub_dim`` (calibration not read)."""
        params = problem.params or VecInferParams()
        try:
            VecInferParams(sub_dim=params.sub_dim).check_head_dim(problem.head_dim)
        except ValueError:
            return False
        return True

    def cost(self, problem) -> float:
        """Estimated seconds: quantize is dominated by the ``[n, K]`` distances per sub-vector, attend by one gather
        per sub-vector code and query row."""
        B, H, T, D = problem.shape
        params = problem.params or VecInferParams()
        K, M = 2**params.code_bits, params.sub_vectors(D)
        vectors = B * H * T
        if problem.op == "quantize":
            return estimate(problem, launches=12, bytes_moved=12 * vectors * M * K, flops=3 * vectors * M * K * 2)
        if problem.op == "dequantize":
            return estimate(problem, launches=8, bytes_moved=16 * vectors * D, flops=4 * vectors * D)
        rows = B * (problem.num_q_heads or H) * problem.num_queries
        return estimate(problem, launches=20, bytes_moved=8 * rows * T * M + 8 * vectors * D,
                        flops=2 * rows * T * M + 2 * rows * M * K * params.sub_dim)

    # -- ops ----------------------------------------------------------------------------------------
    def kvq_quantize(self, x, params):
        """Encode ``x`` float16/bfloat16/float32 ``[B, H_kv, T, D]`` -> ``Encoded`` with ``codes`` only.

        :raises TypeError: ``params`` not :class:`VecInferParams`, ``x`` not a float ``mx.array``.
        :raises ValueError: ``x`` not rank 4, unsupported head_dim, or a calibration that is missing, for another
            model, head_dim, KV-head count or layer (the message names the ``kvq calibrate`` command).
        """
        if not isinstance(params, VecInferParams):
            raise TypeError(f"params must be a VecInferParams for method 'vecinfer'; got {params!r}")
        x = float_array("x", x)
        params.check_head_dim(x.shape[-1])
        table = _layer(params, x.shape[1])
        codes = vq.encode(x, table.codebook, table.smoothing, params.sub_dim, params.code_bits)
        return Encoded(params, {"codes": codes}, x.shape[-1])

    def kvq_dequantize(self, encoded, dtype):
        """``[B, H_kv, T, D]`` of ``dtype``: ``s ⊙ Hᵀ ŷ`` (keys) or ``Hᵀ ŷ`` (values), ``ŷ`` the centroids."""
        p = encoded.params
        table = _layer(p, encoded.shape[1])
        y = vq.decode_rotated(_codes(encoded, 0, encoded.num_tokens), table.codebook)
        y = mx.where(_non_finite(encoded, 0, encoded.num_tokens)[..., None], float("nan"), y)
        return vq.inverse_transform(y, table.smoothing).astype(dtype)

    def kvq_attend(self, queries, keys, values, scale, mask):
        """Attention over vecinfer keys and values (see the ``kvq_attend`` spec for shapes).

        Memory above the cache: one block's working set at a time (the module docstring); blocks are sized for
        the gathered table entries (``M`` times the scores) and the decoded vectors.

        :raises ValueError: keys or values of another method or role, queries whose head_dim differs from the keys'.
        """
        for name, encoded in (("keys", keys), ("values", values)):
            if encoded.method != "vecinfer":
                raise ValueError(f"{name}: vecinfer attend needs vecinfer-encoded {name}; got {encoded.method!r}")
        queries = float_array("queries", queries)
        check_query_dim(queries, keys.head_dim)
        B, Hq, Tq, _ = queries.shape
        # gathered table entries are M times the scores: size blocks for them (and for the decoded values)
        vector_bytes = token_bytes_of(B, keys.shape[1], keys.head_dim, values.head_dim)
        block = block_size_for(B, Hq, Tq * keys.params.sub_vectors(keys.head_dim), keys.num_tokens, vector_bytes)
        return attend_encoded(queries, keys, values, scale, mask, self, self, block_size=block)

    # -- block protocol (kvq.attention.attend_encoded) -----------------------------------------------
    def prepare_queries(self, q, keys):
        """Scaled float32 ``q`` ``[B, H_kv, n_rep, T_q, D]`` -> the lookup table ``[..., T_q, M, K]`` of
        ``q'`` sub-vector · centroid products (``q' = H (s ⊙ q)``), or ``q'`` itself ``[..., T_q, D]`` when the
        table would exceed :data:`TABLE_BUDGET_BYTES`.

        :raises ValueError: keys encoded with ``role="values"`` parameters.
        """
        _check_role(keys, "keys")
        table = _layer(keys.params, keys.shape[1])
        q = vq.transform_queries(q, table.smoothing)
        _, K, S = table.codebook.shape
        if 4 * q.size // S * K > TABLE_BUDGET_BYTES:
            return q
        return vq.lookup_table(q, table.codebook)

    def scores(self, q, keys, start, stop):
        """``q · k̃`` for keys ``start:stop``: float32 ``[B, H_kv, n_rep, T_q, stop - start]``, as sums of table
        entries gathered by the codes (or, for a ``q'`` from a long prefill, ``q' · ŷ`` over gathered centroids).
        Working set: the block's unpacked codes and gathered entries ``[..., T_q, stop - start, M]`` (or 2 float32
        copies of the block's keys)."""
        codes = _codes(keys, start, stop)
        if q.ndim == 6:
            s = vq.table_scores(q, codes)
        else:
            y_hat = vq.decode_rotated(codes, _layer(keys.params, keys.shape[1]).codebook)
            s = q @ y_hat[:, :, None].swapaxes(-1, -2)
        return mx.where(_non_finite(keys, start, stop)[:, :, None, None], float("nan"), s)

    def weighted_values(self, p, values, start, stop):
        """``p @ ŷ`` for values ``start:stop``, in the rotated domain: float32 ``[B, H_kv, n_rep, T_q, D]`` (NaN for
        the queries that weigh a vector of the reserved pattern, whatever its weight, as ``0 · NaN`` in fp16).
        Working set: the block's unpacked codes and at most 2 float32 copies of its values."""
        y_hat = vq.decode_rotated(_codes(values, start, stop), _layer(values.params, values.shape[1]).codebook)
        p = mx.where(_non_finite(values, start, stop)[:, :, None, None], float("nan"), p)
        return p @ y_hat[:, :, None]

    def finish_values(self, out, values):
        """Normalised rotated-domain output ``[B, H_kv, n_rep, T_q, D]`` -> original domain (``Hᵀ``, once).

        :raises ValueError: values encoded with ``role="keys"`` parameters.
        """
        _check_role(values, "values")
        return vq.inverse_transform(out, _layer(values.params, values.shape[1]).smoothing)


def _layer(params, num_kv_heads: int) -> storage.LayerCodebook:
    """The layer's codebook, checked against the data's KV-head count."""
    table = storage.layer_codebook(params)
    if table.num_kv_heads != num_kv_heads:
        raise storage.CalibrationError(
            f"the vecinfer calibration of {params.model_id!r} was recorded with {table.num_kv_heads} KV heads, but "
            f"the data has {num_kv_heads}: is model_id the model you run?")
    return table


def _codes(encoded, start: int, stop: int) -> mx.array:
    """Unpacked codes of tokens ``start:stop``: uint32 ``[B, H_kv, n, M]``."""
    p = encoded.params
    return vq.unpack_codes(encoded.data["codes"][:, :, start:stop], p.code_bits, p.sub_vectors(encoded.head_dim))


def _non_finite(encoded, start: int, stop: int) -> mx.array:
    """bool ``[B, H_kv, n]``: tokens ``start:stop`` stored with the reserved pattern (a non-finite input)."""
    p = encoded.params
    return vq.reserved(encoded.data["codes"][:, :, start:stop], p.sub_vectors(encoded.head_dim), p.code_bits)


def _check_role(encoded, side: str) -> None:
    if encoded.params.role != side:
        raise ValueError(f"{side}: encoded with role={encoded.params.role!r} vecinfer parameters, whose codebooks "
                         f"were trained on {encoded.params.role}; give the {side} role={side!r} (e.g. "
                         f"value_params=dict(role='values'))")
