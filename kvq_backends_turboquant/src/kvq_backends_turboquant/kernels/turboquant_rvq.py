"""``turboquant_rvq`` on kvq_metal's kernels: decode attention that decodes ``k = norm · (c1[idx1] + c2[idx2])``
on the fly.

The seed system's TurboQuant-RVQ fused decode + attend: both code streams are read from the cache's packed words
and each code pair indexes one table of ``2^(b1 + b2)`` sums ``c1[i] + c2[j]`` (at most 256 entries), inside the
same online-softmax kernel as ``turboquant`` (:mod:`kvq_metal.attend`), in the rotated domain. Quantize stays in
pure MLX. Served: bits and residual_bits 1..4, head_dim rotated at a power of two in 32..256 (``params.rotated_dim``;
other Hadamard sizes such as 80, 96, 112 are served by pure MLX), decode (up to 8 query rows per KV head).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from kvq_metal import attend
from kvq_metal.base import KernelImpl, first_use_check
from kvq_metal.common import check_attend, decode_shape_ok, rows_of

from ..impl import head_dim_supported, padding_note
from ..rvq import TurboQuantRVQParams
from .turboquant import power_of_two, rotated_attend, rotated_dense_call, rotated_kernel_serves


@lru_cache(maxsize=64)
def _table(params, head_dim: int) -> mx.array:
    """float32 ``[2^(b1 + b2)]``: ``table[(i << b2) | j] = c1[i] + c2[j]`` (evaluated once per parameters: keys and
    values with equal parameters share one array, see :func:`kvq_metal.attend.table_layout`)."""
    c1, c2 = params.codebooks(head_dim)
    table = (c1[:, None] + c2[None, :]).reshape(-1)
    mx.eval(table)
    return table


def _side(encoded) -> attend.Side:
    p = encoded.params
    dim = p.rotated_dim(encoded.head_dim)
    return attend.Side(encoded.data["codes"], encoded.data["norms"], None, _table(p, encoded.head_dim), p.bits,
                       dim, codes2=encoded.data["residual_codes"], bits2=p.residual_bits)


class TurboQuantRVQKernels(KernelImpl):
    """Kernel implementation of ``turboquant_rvq`` (attend); see the module docstring."""

    method = "turboquant_rvq"

    def kernel_supports(self, problem) -> bool:
        """Decode attention only, rotated at a power of two, within :func:`kvq_metal.attend.supported`, after the
        first-use check."""
        p = problem.params or TurboQuantRVQParams()
        if problem.op != "attend" or not decode_shape_ok(problem) or not head_dim_supported(p, problem.head_dim):
            return False
        dim, rows = p.rotated_dim(problem.head_dim), rows_of(problem)
        if not (power_of_two(dim) and attend.supported(dim, p.bits, p.bits, dim, dim, rows)):
            return False
        return first_use_check(self.backend, "decode_attend[turboquant_rvq]",
                               (dim, p.bits, p.residual_bits, p.norm_dtype, rows),
                               lambda: check_attend(self, self.fallback().kvq_quantize, p, p, problem.head_dim,
                                                    rows, problem.dtype))

    def explain(self, problem) -> str:
        """:meth:`KernelImpl.explain`; where the kernel serves ``problem`` and the rotation pads head_dim, what that
        costs (:func:`~kvq_backends_turboquant.impl.padding_note`)."""
        return super().explain(problem) or padding_note(problem.params or TurboQuantRVQParams(), problem.head_dim)

    def cost(self, problem) -> float:
        """One kernel over both packed code streams and the norms of K and V, plus the split merge."""
        p = problem.params or TurboQuantRVQParams()
        B, H, T, D = problem.shape
        dim = p.rotated_dim(D)
        packed = B * H * T * (dim * (p.bits + p.residual_bits) / 8 + p.norm_bits / 8)
        return self.estimate(problem, launches=2, bytes_moved=2 * packed)

    def attend_kernel(self, queries, keys, values, scale):
        """The kernel path of :meth:`kvq_attend` (no checks)."""
        return rotated_attend(self, queries, keys, values, scale, _side)

    def kvq_attend(self, queries, keys, values, scale, mask):
        """``kvq_attend`` spec; pure MLX serves masks, other methods' values and shapes beyond the kernel."""
        if not rotated_kernel_serves(queries, keys, values, mask, lambda p: p.method == self.method):
            return self.fallback().kvq_attend(queries, keys, values, scale, mask)
        return self.attend_kernel(queries, keys, values, scale)

    def _dense_call(self, queries, keys, values):
        """:meth:`KernelImpl._dense_call` (the randomized Hadamard rotation and the tensor-core kernel)."""
        if not rotated_kernel_serves(queries, keys, values, None, lambda p: p.method == self.method):
            return None
        return rotated_dense_call(self, queries, keys, values, _side)
