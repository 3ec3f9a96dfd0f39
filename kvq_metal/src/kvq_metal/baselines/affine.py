"""``affine`` (the baseline :mod:`kvq.baselines.affine`) on kvq_metal: decode attention read straight from
``mx.quantize``'s packed codes.

``x_j = code_j * scale_g + bias_g`` (mlx-lm's QuantizedKVCache numerics; ``mx.quantize`` packs codes densely,
little-endian, exactly as :mod:`kvq.packing`). Quantize stays with ``mx.quantize``, which is already one fused
MLX kernel per call. It lives in kvq_metal, not with its method, because the method lives in kvq core, below
kvq_metal (see :mod:`kvq_metal.baselines`).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from kvq.baselines.affine import AffineParams

from .. import attend, streams
from ..base import KernelImpl, first_use_check
from ..common import check_attend, decode_shape_ok, query_rows, rows_of


@lru_cache(maxsize=None)
def _levels(bits: int) -> tuple[float, ...]:
    return tuple(float(i) for i in range(1 << bits))


def _side(encoded) -> attend.Side:
    p = encoded.params
    d = encoded.data
    # the table 0 .. 2^bits - 1: one cached array per width, so keys and values share it (attend.table_layout)
    table = attend._constant(_levels(p.bits), mx.float32)
    return attend.Side(d["codes"], d["scales"], d["biases"], table, p.bits, p.group_size, levels=True)


@lru_cache(maxsize=None)
def _level_table(bits: int) -> mx.array:
    return mx.array([_levels(bits)], mx.float32)


def value_stream(encoded) -> streams.Stream:
    """``affine`` values as a value stream of the streams kernel (:class:`kvq_metal.streams.Stream`): the same
    numbers as :func:`_side` (``code * scale_g + bias_g``, one scale and bias per group), the levels as a table
    ``[1, 2**bits]``. Other methods' kernels pair their keys with it (``qjl`` keys with ``affine`` values)."""
    d, bits = encoded.data, encoded.params.bits
    group = encoded.head_dim // d["scales"].shape[-1]
    return streams.Stream(d["codes"], encoded.head_dim, bits, _level_table(bits), scales=(d["scales"],),
                          biases=d["biases"], group=group)


class AffineKernels(KernelImpl):
    """Fused decode attention for ``affine`` keys and values (any bits 2-8, group 32/64/128, head_dim 32-256
    power of two). Outside those limits, or with a mask, pure MLX serves the call (same result)."""

    method = "affine"

    def kernel_supports(self, problem) -> bool:
        """Decode attention only, within :func:`kvq_metal.attend.supported`, after the first-use check."""
        if problem.op != "attend" or not decode_shape_ok(problem):
            return False
        p = problem.params or AffineParams()
        D, rows = problem.head_dim, rows_of(problem)
        group = p.group_size_for(D)  # group_size=None: the one chosen for D (None where none divides D)
        if group is None or not attend.supported(D, p.bits, p.bits, group, group, rows):
            return False
        p = p.for_head_dim(D)
        return first_use_check(self.backend, "decode_attend[affine]", (D, p.bits, p.group_size, rows),
                               lambda: check_attend(self, self.fallback().kvq_quantize, p, p, D, rows, mx.float16))

    def cost(self, problem) -> float:
        """One kernel plus the split merge; bytes: the packed codes and 16-bit scales and biases of K and V."""
        B, H, T, D = problem.shape
        p = problem.params or AffineParams()
        per_token = D * p.bits / 8 + 4 * D / (p.group_size_for(D) or D)  # (no group size: not supported anyway)
        return self.estimate(problem, launches=6, bytes_moved=2 * B * H * T * per_token)

    def attend_kernel(self, queries, keys, values, scale):
        """The kernel path of :meth:`kvq_attend` (no checks): ``(out, lse)`` as the spec says."""
        return attend.decode_attend(queries, scale, _side(keys), _side(values), self.backend)

    def _serves(self, queries, keys, values, mask) -> bool:
        B, Hq, _, D = queries.shape
        return (mask is None and keys.num_tokens > 0 and values.method == "affine"
                and values.head_dim == D and Hq % keys.shape[1] == 0
                and attend.supported(D, keys.params.bits, values.params.bits, keys.params.group_size,
                                     values.params.group_size, query_rows(queries, keys)))

    def kvq_attend(self, queries, keys, values, scale, mask):
        """``kvq_attend`` spec; pure MLX serves masks, other methods' values and shapes beyond the kernel."""
        if not self._serves(queries, keys, values, mask):
            return self.fallback().kvq_attend(queries, keys, values, scale, mask)
        return self.attend_kernel(queries, keys, values, scale)

    def _dense_call(self, queries, keys, values):
        """:meth:`KernelImpl._dense_call`: the tensor-core kernel reads the uncompressed tokens too."""
        if not self._serves(queries, keys, values, None):
            return None
        ks, vs = _side(keys), _side(values)
        if not attend.serves_dense(self.backend, queries.shape[3], ks, vs, query_rows(queries, keys)):
            return None
        return attend.DenseCall(ks, vs)
