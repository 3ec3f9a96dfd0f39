"""``fp16``: the uncompressed baseline (identity up to a cast of float32 input to float16)."""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx

from ..attention import check_query_dim, dense_attend
from ..costmodel import estimate
from ..encoded import Encoded
from ..declaration import BitsAccounting, Method
from ..validate import float_array


@attrs.frozen
class Fp16Params:
    """No parameters: keys and values are stored as 16-bit floats (float16, or bfloat16 if given bfloat16)."""

    method: ClassVar[str] = "fp16"

    def accounting(self, head_dim: int) -> BitsAccounting:
        """16 bits per coordinate, nothing shared."""
        return BitsAccounting(head_dim, {"x": 16 * head_dim})

    def check_head_dim(self, head_dim: int) -> None:
        """Every head_dim >= 1 is supported."""


METHOD = Method("fp16", Fp16Params, "uncompressed 16-bit keys and values (kvq-fp16 in method strings; the "
                "reference, kvcache, is mlx-lm's KVCache)",
                source="mlx-lm KVCache")


class Fp16MLX:
    """Pure-MLX ``fp16``: quantize casts to 16 bits, attend is float32 blockwise attention."""

    method = "fp16"
    backend = "mlx"

    def supports(self, problem) -> bool:
        return True

    def cost(self, problem) -> float:
        B, H, T, D = problem.shape
        return estimate(problem, launches=4, bytes_moved=4 * B * H * T * D, flops=4 * B * H * T * D)

    def kvq_quantize(self, x, params):
        x = float_array("x", x)
        return Encoded(params, {"x": x if x.dtype != mx.float32 else x.astype(mx.float16)}, x.shape[-1])

    def kvq_dequantize(self, encoded, dtype):
        return encoded.data["x"].astype(dtype)

    def scores(self, q, keys, start, stop):
        """Block protocol (:func:`kvq.attention.attend_encoded`): float32 ``[B, H_kv, n_rep, T_q, stop - start]``.
        Working set: at most 2 float32 copies of the block's keys (the cast and its transposed layout)."""
        return q @ keys.data["x"][:, :, None, start:stop].astype(mx.float32).swapaxes(-1, -2)

    def weighted_values(self, p, values, start, stop):
        """Block protocol: ``p @ V[start:stop]``, float32. Working set: at most 2 float32 copies of the block."""
        return p @ values.data["x"][:, :, None, start:stop].astype(mx.float32)

    def kvq_attend(self, queries, keys, values, scale, mask):
        """:func:`kvq.attention.dense_attend` over the stored 16-bit keys and values (shapes: the ``kvq_attend``
        spec). Memory above the cache: one block's float32 copies (:data:`kvq.attention.VECTOR_BUDGET_BYTES` of
        keys and values, at least 256 tokens) and its scores; blocks run one at a time.

        :raises ValueError: values of another method, queries of another head_dim than the keys.
        """
        if values.method != "fp16":
            raise ValueError(f"values: fp16 attend needs fp16-encoded values; got {values.method!r}")
        check_query_dim(queries, keys.head_dim)
        return dense_attend(queries, keys.data["x"], values.data["x"], scale, mask, one_at_a_time=True)
