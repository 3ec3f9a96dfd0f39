"""``affine``: per-group min-max quantization with ``mx.quantize``, the numerics of mlx-lm's QuantizedKVCache.

Each group of ``group_size`` coordinates of a vector gets a scale and a bias (16-bit each), so side data costs
``32 / group_size`` bits per coordinate (group_size by default 64, mlx-lm's, where it divides head_dim, else 32:
:func:`auto_group_size`; KIVI, Liu et al. 2024, quantizes keys per channel instead; mlx-lm and
this baseline quantize per token). Attention runs on the packed codes with ``mx.quantized_matmul``, block by
block, so no fp16 copy of the keys or values is made (on CUDA, and on the CPU for more than a few query rows,
each block is decoded to float32 instead: :meth:`AffineMLX.scores`); blocks run one at a time (:func:`kvq.attention.attend_encoded`), so decode
holds one block's working set above the cache, at most 8 float32 copies of the block's keys and values.

Non-finite input (kvq's policy, :class:`kvq.contract.Quantizes`): ``mx.quantize`` alone turns a group holding a
NaN into finite values (its min and max skip the NaN); here the scale of every group holding a NaN or ±inf is
stored as NaN, so that group (and only it) decodes to NaN and its scores and weighted values are NaN.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx

from ..attention import attend_encoded
from ..costmodel import estimate
from ..encoded import Encoded
from ..declaration import BitsAccounting, Method
from ..validate import attrs_one_of, float_array, head_dim_multiple

BITS = (2, 3, 4, 5, 6, 8)
#: The group sizes ``mx.quantize`` supports (MLX 0.32 refuses 8, 16 and 256).
GROUP_SIZES = (32, 64, 128)
#: mlx-lm's QuantizedKVCache group size: the automatic choice wherever it divides head_dim.
DEFAULT_GROUP_SIZE = 64


def _check_group_size(instance, attribute, value):
    if value is not None:
        attrs_one_of(GROUP_SIZES)(instance, attribute, value)


def auto_group_size(head_dim: int) -> int | None:
    """The group size ``group_size=None`` means for ``head_dim``: 64 where it divides head_dim, else the largest of
    :data:`GROUP_SIZES` that does (32: 128 divides no head_dim that 64 does not), ``None`` where none does.

    64 first, not the largest: it is mlx-lm's QuantizedKVCache default and was affine's fixed default, so head_dims
    it divides (64, 128, 256 ...) keep their results; only head_dims it does not divide (32, 96, 160 ...) get 32.
    """
    if head_dim >= 1 and head_dim % DEFAULT_GROUP_SIZE == 0:
        return DEFAULT_GROUP_SIZE
    return max((g for g in GROUP_SIZES if head_dim >= 1 and head_dim % g == 0), default=None)


@attrs.frozen(cache_hash=True)  # hashed on every decode step (selection and kernel-check keys)
class AffineParams:
    """Parameters of ``affine``.

    :param bits: code width, one of 2, 3, 4, 5, 6, 8.
    :param group_size: coordinates sharing one scale and bias, one of 32, 64, 128 (must divide head_dim), or
        ``None`` (default): chosen from head_dim by :func:`auto_group_size` (64 where it divides head_dim, as
        mlx-lm's QuantizedKVCache; else 32). It is made concrete where head_dim is known: :meth:`for_head_dim`
        (:func:`kvq.select` calls it, so a plan holds e.g. ``AffineParams(bits=4, group_size=64)``) and
        :meth:`fit` (a cache calls it on its first compressed block, so prompt-cache files store the number).
    :raises ValueError: ``bits`` or ``group_size`` outside those values.
    """

    method: ClassVar[str] = "affine"
    bits: int = attrs.field(default=4, validator=attrs_one_of(BITS))
    group_size: int | None = attrs.field(default=None, validator=_check_group_size)

    def group_size_for(self, head_dim: int) -> int | None:
        """``group_size``, or where it is ``None`` :func:`auto_group_size` ``(head_dim)`` (``None``: none divides it).
        Whether a given ``group_size`` divides ``head_dim`` is :meth:`check_head_dim`'s question."""
        return auto_group_size(head_dim) if self.group_size is None else self.group_size

    def for_head_dim(self, head_dim: int) -> AffineParams:
        """These parameters with a concrete ``group_size`` for ``head_dim`` (``self`` when it is given).

        :raises ValueError: as :meth:`check_head_dim`.
        """
        self.check_head_dim(head_dim)
        return self if self.group_size is not None else attrs.evolve(self, group_size=auto_group_size(head_dim))

    def fit(self, block: mx.array) -> AffineParams:
        """:meth:`for_head_dim` of the block's head_dim (``[B, H_kv, T, D]``): a cache calls it on the first block
        it compresses (:class:`kvq.contract.Fits`), so its configuration, and the prompt-cache files it writes,
        hold the group size used. :raises ValueError: as :meth:`check_head_dim`."""
        return self.for_head_dim(block.shape[-1])

    def unfitted(self) -> AffineParams:
        """These parameters as a user who left ``group_size`` to its default could have asked for them
        (:class:`kvq.contract.Unfits`; ``kvq.load_prompt_cache(expect=...)`` compares through it): group size 64
        becomes ``None``, since 64 is valid only where it divides head_dim, and there the automatic choice is 64
        too; 32 and 128 stay (whether the automatic choice would be 32 depends on a head_dim not known here)."""
        return attrs.evolve(self, group_size=None) if self.group_size == DEFAULT_GROUP_SIZE else self

    def accounting(self, head_dim: int) -> BitsAccounting:
        """Codes (``bits`` per coordinate) plus a 16-bit scale and a 16-bit bias per group.

        :raises ValueError: ``group_size=None`` and no supported group size divides ``head_dim``.
        """
        groups = head_dim // (self.group_size or self.for_head_dim(head_dim).group_size)
        return BitsAccounting(head_dim, {"codes": self.bits * head_dim, "scales": 16 * groups,
                                         "biases": 16 * groups})

    def check_head_dim(self, head_dim: int) -> None:
        """:raises ValueError: ``group_size`` does not divide ``head_dim``, or (``group_size=None``) none of the
        group sizes ``mx.quantize`` supports (32, 64, 128) does (head_dim 80, 48, 16, 8 ...)."""
        if self.group_size is not None:
            head_dim_multiple("affine", head_dim, self.group_size, f"group_size={self.group_size} must divide it")
        elif auto_group_size(head_dim) is None:
            head_dim_multiple("affine", head_dim, min(GROUP_SIZES), "the group size must divide it, and "
                              f"mx.quantize supports group sizes {', '.join(map(str, GROUP_SIZES))} only")


METHOD = Method("affine", AffineParams,
                f"per-group min-max quantization (mx.quantize), bits {', '.join(map(str, BITS))}",
                source="mlx-lm QuantizedKVCache; KIVI (arXiv 2402.02750)")


class AffineMLX:
    """Pure-MLX ``affine`` built on ``mx.quantize`` / ``mx.dequantize`` / ``mx.quantized_matmul``."""

    method = "affine"
    backend = "mlx"

    def supports(self, problem) -> bool:
        group_size = (problem.params or AffineParams()).group_size_for(problem.head_dim)
        return group_size is not None and problem.head_dim % group_size == 0

    def cost(self, problem) -> float:
        B, H, T, D = problem.shape
        bits = (problem.params or AffineParams()).bits
        return estimate(problem, launches=6, bytes_moved=B * H * T * D * (2 + bits / 8), flops=8 * B * H * T * D)

    def kvq_quantize(self, x, params):
        x = float_array("x", x)
        params = params.for_head_dim(x.shape[-1])  # checks head_dim; the codes record the group size used
        # float32 input is stored with float16 scales, as the accounting (and mlx-lm's fp16 models) assume
        x = x.astype(mx.float16) if x.dtype == mx.float32 else x
        codes, scales, biases = mx.quantize(x, group_size=params.group_size, bits=params.bits)
        scales = _nan_where_non_finite(scales, x, params.group_size)
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

        On CUDA, and on the CPU beyond :data:`CPU_PACKED_SCORE_ROWS` query rows per KV head, one block is decoded
        to float32 and multiplied instead: MLX's CPU ``quantized_matmul`` costs in proportion to the rows (16x
        slower than decoding at 64 rows), its CUDA one lacks many shapes; the products agree to float32 rounding.

        :return: float32 ``[B, H_kv, n_rep, T_q, stop - start]``. Working set: at most 8 float32 copies of the
            block's keys (``mx.dequantize``'s temporaries: 2 at 2, 4 and 8 bits, up to 7 at 3, 5 and 6 bits on
            the CPU); none on Metal (the codes are read in place).
        """
        if not _packed_matmul_ok(q, CPU_PACKED_SCORE_ROWS):
            return q @ self.kvq_dequantize(keys.tokens(start, stop), mx.float32)[:, :, None].swapaxes(-1, -2)
        c, s, b = _block(keys, start, stop)
        p = keys.params
        return mx.quantized_matmul(q, c, s, b, transpose=True, group_size=p.group_size, bits=p.bits)

    def weighted_values(self, p, values, start, stop):
        """Block protocol: ``p @ V[start:stop]`` on packed codes, float32 ``[B, H_kv, n_rep, T_q, D]``.

        The block is decoded instead on CUDA and on the CPU beyond :data:`CPU_PACKED_VALUE_ROWS` rows
        (:func:`_packed_matmul_ok`). Working set: as
        :meth:`scores`, at most 8 float32 copies of the block's values.
        """
        if not _packed_matmul_ok(p, CPU_PACKED_VALUE_ROWS):
            return p @ self.kvq_dequantize(values.tokens(start, stop), mx.float32)[:, :, None]
        c, s, b = _block(values, start, stop)
        vp = values.params
        return mx.quantized_matmul(p, c, s, b, transpose=False, group_size=vp.group_size, bits=vp.bits)

    def kvq_attend(self, queries, keys, values, scale, mask):
        """Attention over affine keys and values (shapes: the ``kvq_attend`` spec), block by block through
        :func:`kvq.attention.attend_encoded`. Memory above the cache: one block's working set (:meth:`scores`,
        :meth:`weighted_values`), at most 8 float32 copies of a block of
        :data:`kvq.attention.VECTOR_BUDGET_BYTES` of keys and values (at least 256 tokens), plus its scores.

        :raises ValueError: values of another method.
        """
        if values.method != "affine":
            raise ValueError(f"values: affine attend needs affine-encoded values; got {values.method!r}")
        return attend_encoded(queries, keys, values, scale, mask, self, self)


def _nan_where_non_finite(scales: mx.array, x: mx.array, group_size: int) -> mx.array:
    """``scales`` ``[..., D / group_size]`` with NaN for each group of ``x`` ``[..., D]`` that holds a NaN or ±inf
    (lazy, no host synchronisation; other scales unchanged bit for bit). ``mx.isfinite`` is six elementwise
    kernels on a GPU (two comparisons with ±inf, one with itself, their unions and negation); compiled, one
    (a prefill chunk's affine update ran 0.16 ms of this check's kernels on an H100:
    ``benchmarks/results/prefill/2026-12-06-h100-chunk-kernels``)."""
    finite = mx.all(_isfinite(x).reshape(*x.shape[:-1], -1, group_size), axis=-1)
    return mx.where(finite, scales, float("nan"))


_isfinite = mx.compile(mx.isfinite, shapeless=True)


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


#: Query rows per KV head (GQA group times query tokens) up to which the CPU scores a block with
#: ``mx.quantized_matmul`` on the codes rather than decoding it: its cost grows with the rows and decoding's
#: does not (2-core x86-64, OpenBLAS, 8K tokens x 3 heads x 64 dims, 4 bits: 1.2 ms at 1 row, 3.3 at 3, 8.6 at 8,
#: against 4.9-5.7 ms decoded; values 0.5, 1.3, 3.1 and 6.8 at 16 rows, against 4.5-6.0).
CPU_PACKED_SCORE_ROWS = 4
#: The same for weighted values.
CPU_PACKED_VALUE_ROWS = 8


def _packed_matmul_ok(q: mx.array, cpu_rows: int) -> bool:
    """Whether ``mx.quantized_matmul`` serves a block (``q [B, H_kv, n_rep, T_q, ...]``): on Metal always; on the
    CPU up to ``cpu_rows`` query rows per KV head (decode; beyond, decoding the block is faster: prefill); not on
    CUDA, where MLX 0.32 raises "No implementation for problem shape" for float32 activations at many block sizes."""
    if _on_cpu():
        return q.shape[-2] * q.shape[-3] <= cpu_rows
    return mx.metal.is_available()


def _block(encoded, start, stop):
    """codes, scales, biases of tokens ``start:stop`` with a broadcast axis for the GQA query groups."""
    return [encoded.data[n][:, :, None, start:stop] for n in ("codes", "scales", "biases")]
