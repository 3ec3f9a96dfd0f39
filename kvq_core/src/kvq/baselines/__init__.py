"""The baselines every method is compared with, registered exactly like a third-party plugin.

``fp16`` (uncompressed) and ``affine`` (mlx-lm's QuantizedKVCache numerics), plus the generic pure-MLX bit
packing that every method may select (``method = "*"``).
"""

from __future__ import annotations

from .. import packing
from ..costmodel import estimate
from .affine import METHOD as AFFINE, AffineMLX
from .fp16 import METHOD as FP16, Fp16MLX


class PackMLX:
    """Pure-MLX dense bit packing (:mod:`kvq.packing`) for every method."""

    method = "*"
    backend = "mlx"

    def supports(self, problem) -> bool:
        return True

    def cost(self, problem) -> float:
        return estimate(problem, launches=8, bytes_moved=8 * problem.num_elements, flops=4 * problem.num_elements)

    def kvq_pack(self, codes, bits):
        return packing.pack(codes, bits)

    def kvq_unpack(self, packed, bits, count):
        return packing.unpack(packed, bits, count)


def kvq_register(register):
    """Entry point ``baselines``: the fp16 and affine methods and their pure-MLX implementations."""
    for obj in (FP16, AFFINE, Fp16MLX(), AffineMLX(), PackMLX()):
        register(obj)
