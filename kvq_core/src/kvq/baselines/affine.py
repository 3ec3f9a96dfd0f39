"""``affine``: per-group min-max quantization with ``mx.quantize``, the numerics of mlx-lm's QuantizedKVCache.

Each group of ``group_size`` coordinates of a vector gets a scale and a bias (16-bit each), so side data costs
``32 / group_size`` bits per coordinate (KIVI, Liu et al. 2024, quantizes keys per channel instead; mlx-lm and
this baseline quantize per token). Attention runs on the packed codes with ``mx.quantized_matmul``, block by
block, so no fp16 copy of the keys or values is made.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx

from ..attention import attend_encoded
from ..costmodel import estimate
from ..encoded import Encoded
from ..methods import BitsAccounting, Method
from ..validate import attrs_one_of, float_array, head_dim_multiple

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


@attrs.frozen(cache_hash=True)  # hashed on every decode step (selection and kernel-check keys)
class AffineParams:
    """Parameters of ``affine``.

    :param bits: code width, one of 2, 3, 4, 5, 6, 8.
    :param group_size: coordinates sharing one scale and bias, one of 32, 64, 128; must divide head_dim.
    """

    method: ClassVar[str] = "affine"
    bits: int = attrs.field(default=4, validator=attrs_one_of(BITS))
    group_size: int = attrs.field(default=64, validator=attrs_one_of(GROUP_SIZES))

    def accounting(self, head_dim: int) -> BitsAccounting:
        """Codes (``bits`` per coordinate) plus a 16-bit scale and a 16-bit bias per group."""
        groups = head_dim // self.group_size
        return BitsAccounting(head_dim, {"codes": self.bits * head_dim, "scales": 16 * groups,
                                         "biases": 16 * groups})

    def check_head_dim(self, head_dim: int) -> None:
        """:raises ValueError: ``group_size`` does not divide ``head_dim``."""
        head_dim_multiple("affine", head_dim, self.group_size, f"group_size={self.group_size} must divide it")


METHOD = Method("affine", AffineParams,
                f"per-group min-max quantization (mx.quantize), bits {', '.join(map(str, BITS))}",
                source="mlx-lm QuantizedKVCache; KIVI (arXiv 2402.02750)")


class AffineMLX:
    """Pure-MLX ``affine`` built on ``mx.quantize`` / ``mx.dequantize`` / ``mx.quantized_matmul``."""

    method = "affine"
    backend = "mlx"

    def supports(self, problem) -> bool:
        return problem.head_dim % (problem.params or AffineParams()).group_size == 0

    def cost(self, problem) -> float:
        B, H, T, D = problem.shape
        bits = (problem.params or AffineParams()).bits
        return estimate(problem, launches=6, bytes_moved=B * H * T * D * (2 + bits / 8), flops=8 * B * H * T * D)

    def kvq_quantize(self, x, params):
        x = float_array("x", x)
        params.check_head_dim(x.shape[-1])
        # float32 input is stored with float16 scales, as the accounting (and mlx-lm's fp16 models) assume
        x = x.astype(mx.float16) if x.dtype == mx.float32 else x
        codes, scales, biases = mx.quantize(x, group_size=params.group_size, bits=params.bits)
        return Encoded(params, {"codes": codes, "scales": scales, "biases": biases}, x.shape[-1])

    def kvq_dequantize(self, encoded, dtype):
        p, d = encoded.params, encoded.data
        scales, biases = d["scales"], d["biases"]
        if dtype == mx.float32:  # exact products, as mx.quantized_matmul computes them
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        x = mx.dequantize(d["codes"], scales, biases, group_size=p.group_size, bits=p.bits)
        return x.astype(dtype)

    def scores(self, q, keys, start, stop):
        """Block protocol (:func:`kvq.attention.attend_encoded`): ``q @ K[start:stop]^T`` on packed codes.

        On the CPU and on CUDA one block is decoded to float32 and multiplied instead: MLX's CPU
        ``quantized_matmul`` is an order of magnitude slower, its CUDA one lacks many shapes, and the products are
        identical (fp32 scales).
        """
        if not _packed_matmul_ok(q):
            return q @ self.kvq_dequantize(keys.tokens(start, stop), mx.float32)[:, :, None].swapaxes(-1, -2)
        c, s, b = _block(keys, start, stop)
        p = keys.params
        return mx.quantized_matmul(q, c, s, b, transpose=True, group_size=p.group_size, bits=p.bits)

    def weighted_values(self, p, values, start, stop):
        """Block protocol: ``p @ V[start:stop]`` on packed codes.

        The block is decoded instead on the CPU and on CUDA (see :func:`_packed_matmul_ok`).
        """
        if not _packed_matmul_ok(p):
            return p @ self.kvq_dequantize(values.tokens(start, stop), mx.float32)[:, :, None]
        c, s, b = _block(values, start, stop)
        vp = values.params
        return mx.quantized_matmul(p, c, s, b, transpose=False, group_size=vp.group_size, bits=vp.bits)

    def kvq_attend(self, queries, keys, values, scale, mask):
        if values.method != "affine":
            raise ValueError(f"values: affine attend needs affine-encoded values; got {values.method!r}")
        return attend_encoded(queries, keys, values, scale, mask, self, self)


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def _packed_matmul_ok(q: mx.array) -> bool:
    """Whether ``mx.quantized_matmul`` serves scores: on Metal. Not on the CPU (slow) nor on CUDA, where MLX
    0.32 raises "No implementation for problem shape" for float32 activations at many block sizes."""
    return not _on_cpu() and mx.metal.is_available()


def _block(encoded, start, stop):
    """codes, scales, biases of tokens ``start:stop`` with a broadcast axis for the GQA query groups."""
    return [encoded.data[n][:, :, None, start:stop] for n in ("codes", "scales", "biases")]
