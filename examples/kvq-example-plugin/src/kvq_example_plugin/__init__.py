"""``absmax8``: int8 per-token absmax quantization, a complete third-party kvq method in one module.

Source: symmetric absmax quantization as in LLM.int8() (Dettmers et al., arXiv 2208.07339).
"""

from typing import ClassVar

import attrs
import mlx.core as mx

from kvq import BitsAccounting, Encoded, Method
from kvq.costmodel import estimate


@attrs.frozen
class Absmax8Params:
    """No parameters: 8-bit codes, one float16 scale per vector."""

    method: ClassVar[str] = "absmax8"

    def accounting(self, head_dim: int) -> BitsAccounting:
        return BitsAccounting(head_dim, {"codes": 8 * head_dim, "scales": 16})

    def check_head_dim(self, head_dim: int) -> None:
        """Any head_dim works."""


class Absmax8MLX:
    """Pure-MLX implementation: quantize and dequantize (kvq attends through dequantized blocks)."""

    method = "absmax8"
    backend = "mlx"

    def supports(self, problem) -> bool:
        return True

    def cost(self, problem) -> float:
        return estimate(problem, launches=4, bytes_moved=3 * problem.num_elements, flops=3 * problem.num_elements)

    def kvq_quantize(self, x, params):
        scales = mx.max(mx.abs(x), axis=-1, keepdims=True).astype(mx.float32) / 127
        codes = mx.round(x.astype(mx.float32) / mx.where(scales > 0, scales, 1)).astype(mx.int8)
        return Encoded(params, {"codes": codes, "scales": scales.astype(mx.float16)}, x.shape[-1])

    def kvq_dequantize(self, encoded, dtype):
        d = encoded.data
        return (d["codes"].astype(mx.float32) * d["scales"].astype(mx.float32)).astype(dtype)


def kvq_register(register):
    """Entry point: the method declaration and its one implementation."""
    register(Method("absmax8", Absmax8Params, "int8 per-token absmax (example plugin)", source="LLM.int8()"))
    register(Absmax8MLX())
