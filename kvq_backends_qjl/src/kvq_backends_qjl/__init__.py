"""kvq plugin for ``qjl``: 1-bit Quantized Johnson-Lindenstrauss key sketches (a KEY method).

Zandieh, Daliri, Han, "QJL: 1-Bit Quantized JL Transform for KV Cache Quantization with Zero Overhead",
arXiv 2406.03482. A key ``k`` is stored as ``sign(S k)`` (``m`` bits) and ``‖k‖``; the unquantized query
scores it without bias as ``sqrt(π/2)/m · ‖k‖ · ⟨S q, sign(S k)⟩``. Per group of tokens, a few outlier channels
are kept apart and sketched separately (:mod:`.params` lists what is stored, :mod:`.sketch` the sketches).

Values are not this method's business: a cache pairs ``qjl`` keys with values of another method (typically
``affine``), and :meth:`QJLMLX.kvq_attend` attends with the values' own implementation. On a GPU, decode with
``affine`` values runs one fused kernel over the sign bits and the values' codes (:mod:`kvq_backends_qjl.kernels`).
"""

from __future__ import annotations

import kvq
from kvq import Method
from kvq.attention import attend_encoded
from kvq.costmodel import estimate

from . import attend, quantize
from .params import QJLParams

__all__ = ["METHOD", "QJLMLX", "QJLParams", "kvq_register"]

METHOD = Method("qjl", QJLParams, "1-bit JL sign sketch of keys + norms, outlier channels apart (keys only)",
                source="Zandieh, Daliri, Han: QJL (arXiv 2406.03482)", keys_only=True)


class QJLMLX:
    """Pure-MLX ``qjl``: quantize, estimate-only dequantize, and attend from the sign sketches.

    ``prepare_queries`` and ``scores`` are the key side of :func:`kvq.attention.attend_encoded`'s block protocol.
    """

    method = "qjl"
    backend = "mlx"

    def supports(self, problem) -> bool:
        """Every head_dim above ``outlier_channels``, every device (pure MLX)."""
        return problem.head_dim > (problem.params or QJLParams()).outlier_channels

    def cost(self, problem) -> float:
        """Estimated seconds: sketch matmuls for quantize, score matmuls over packed bits for attend."""
        B, H, T, D = problem.shape
        params = problem.params or QJLParams()
        m = params.sketch_dim_for(D)
        stored = params.accounting(D).bits_per_token * B * H * T / 8
        if problem.op == "attend":
            queries = (problem.num_q_heads or H) * problem.num_queries
            return estimate(problem, launches=12, bytes_moved=stored + 4 * B * queries * T,
                            flops=2 * B * queries * T * (m + 2 * params.outlier_channels))
        return estimate(problem, launches=10, bytes_moved=2 * B * H * T * D + stored, flops=2 * B * H * T * D * m)

    def kvq_quantize(self, x, params):
        """See :func:`kvq_backends_qjl.quantize.quantize` (errors included)."""
        return quantize.quantize(x, params)

    def kvq_dequantize(self, encoded, dtype):
        """An ESTIMATE of the keys (for tests), not a reconstruction: see :func:`.quantize.dequantize`."""
        return quantize.dequantize(encoded, dtype)

    def prepare_queries(self, q, keys):
        """Block protocol: :func:`kvq_backends_qjl.attend.prepare_queries` (``S q`` once)."""
        return attend.prepare_queries(q, keys)

    def scores(self, q, keys, start, stop):
        """Block protocol: :func:`kvq_backends_qjl.attend.scores` (float32 ``[B, H_kv, n_rep, T_q, stop-start]``)."""
        return attend.scores(q, keys, start, stop)

    def kvq_attend(self, queries, keys, values, scale, mask):
        """Attention over ``qjl`` keys and values of any method with an ``mlx`` implementation.

        :param queries: ``[B, H_q, T_q, D]`` float. :param keys: ``qjl`` :class:`kvq.Encoded`.
        :param values: :class:`kvq.Encoded` of any installed method (e.g. ``affine``).
        :param scale: float multiplying the estimated ``q · k``. :param mask: ``None`` or boolean,
            broadcastable to ``[B, H_q, T_q, T]`` (``True`` = may attend).
        :return: ``(out [B, H_q, T_q, D_v], lse [B, H_q, T_q])``, float32. Memory above the cache: one block at
            a time (:func:`kvq.attention.attend_encoded`): the keys' working set
            (:mod:`kvq_backends_qjl.attend`) plus the values' implementation's, and the block's scores.
        :raises ValueError: keys not ``qjl``-encoded, or no ``mlx`` implementation for the values' method.
        """
        if keys.method != "qjl":
            raise ValueError(f"keys: qjl attend needs qjl-encoded keys; got {keys.method!r}")
        value_impl = kvq.registry().implementations.get((values.method, "mlx"))
        if value_impl is None:
            raise ValueError(f"values: no 'mlx' implementation of method {values.method!r} is installed")
        return attend_encoded(queries, keys, values, scale, mask, self, value_impl)


def kvq_register(register):
    """Entry point ``qjl``: the method declaration, its pure-MLX implementation and its kernel implementations
    (``metal`` and ``cuda``: :mod:`kvq_backends_qjl.kernels`)."""
    from .kernels import implementations

    for obj in (METHOD, QJLMLX(), *implementations()):
        register(obj)
