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
from ..dialect import gpu_backend, size_input
from ..kernel_files import KERNELS, load

#: The decode kernel of :func:`dequantize_into`.
DEQUANTIZE = load(KERNELS / "affine_dequantize.kvq")
#: Vectors per thread group of :data:`DEQUANTIZE` (one SIMD group each).
VECTORS_PER_GROUP = 4


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


def decode_supported(head_dim: int, bits: int, group_size: int) -> bool:
    """Whether :func:`dequantize_into`'s kernel reads ``head_dim`` coordinates of ``bits`` in groups of
    ``group_size``: head_dim a power of two in 32..256, a group of at least 32 coordinates dividing it, and each
    lane's ``head_dim / 32`` codes within two 32-bit words (all of 2..8 bits but 7 at head_dim 256)."""
    if not (32 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and 2 <= bits <= 8
            and 32 <= group_size <= head_dim and head_dim % group_size == 0):
        return False
    width = head_dim // 32 * bits
    return all(lane * width % 32 + width <= 64 for lane in range(32))


def dequantize_into(encoded, dtype, before: int, after: int, backend: str) -> mx.array:
    """``affine`` tokens decoded from their packed codes into ``[B, H, before + T + after, D]`` of ``dtype``, each
    row's tokens between ``before`` and ``after`` columns left unwritten (kernel ``affine_dequantize.kvq``;
    pure-MLX reference :meth:`kvq.baselines.affine.AffineMLX.kvq_dequantize`, ``mx.dequantize``): ``code * scale
    + bias`` in float32, rounded once to ``dtype`` (``mx.dequantize`` rounds to the scales' dtype first: at most
    one unit in the last place of ``dtype`` apart).

    :raises ValueError: a width :func:`decode_supported` rejects, or ``before`` / ``after`` negative.
    """
    p, d, D = encoded.params, encoded.data, encoded.head_dim
    if not decode_supported(D, p.bits, p.group_size):
        raise ValueError(f"affine decode kernel serves head_dim a power of two in 32..256, bits 2..8, group_size "
                         f">= 32 dividing it; got {D}, {p.bits}, {p.group_size}")
    B, H, T, _ = encoded.shape
    n = B * H * T
    kern = DEQUANTIZE.kernel(backend, ("codes", "scales", "biases", "before", "after"), ("out",))
    (out,) = kern(
        inputs=[d["codes"].reshape(B * H, T, d["codes"].shape[-1]), d["scales"].reshape(n, d["scales"].shape[-1]),
                d["biases"].reshape(n, d["biases"].shape[-1]), size_input(before, "before"),
                size_input(after, "after")],
        template=[("D", D), ("BITS", p.bits), ("GROUP", p.group_size), ("VPG", VECTORS_PER_GROUP),
                  ("OUT_T", dtype)],
        grid=(32 * VECTORS_PER_GROUP * max(1, -(-n // VECTORS_PER_GROUP)), 1, 1),
        threadgroup=(32 * VECTORS_PER_GROUP, 1, 1),
        output_shapes=[(B * H * (before + T + after), D)], output_dtypes=[dtype])
    return out.reshape(B, H, before + T + after, D)


def _check_decode(backend: str, params, head_dim: int, dtype) -> tuple[bool, str]:
    """First-use check of :func:`dequantize_into`: 256 random vectors (with a row of columns around them) decode
    within 1e-2 relative of ``mx.dequantize`` per element's scale (one rounding of ``dtype`` apart)."""
    from kvq.baselines.affine import AffineMLX

    pure = AffineMLX()
    x = mx.random.normal((1, 2, 128, head_dim), key=mx.random.key(7)).astype(mx.float16) * 3
    enc = pure.kvq_quantize(x, params)
    got = dequantize_into(enc, dtype, 1, 2, backend)[:, :, 1:-2].astype(mx.float32)
    want = pure.kvq_dequantize(enc, dtype).astype(mx.float32)
    err = float(mx.max(mx.abs(got - want)) / mx.maximum(mx.max(mx.abs(want)), 1e-30))
    return err < 1e-2, f"max error {err:.2e} of the largest value"


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

    def dequantize_into(self, encoded, dtype, before, after):
        """:class:`kvq.contract.DequantizesInto` (:func:`dequantize_into`) on this object's own device, for 16- and
        32-bit outputs and widths :func:`decode_supported` takes, after the first-use check; ``None`` elsewhere
        (the prefill path then joins ``mx.dequantize``'s output)."""
        p, D = encoded.params, encoded.head_dim
        if not (gpu_backend() == self.backend and encoded.num_tokens and encoded.method == "affine"
                and dtype in (mx.float16, mx.bfloat16, mx.float32) and decode_supported(D, p.bits, p.group_size)):
            return None
        if not first_use_check(self.backend, "affine_dequantize", (D, p.bits, p.group_size, dtype),
                               lambda: _check_decode(self.backend, p, D, dtype)):
            return None
        return dequantize_into(encoded, dtype, before, after, self.backend)

    def _dense_call(self, queries, keys, values):
        """:meth:`KernelImpl._dense_call`: the tensor-core kernel reads the uncompressed tokens too."""
        if not self._serves(queries, keys, values, None):
            return None
        ks, vs = _side(keys), _side(values)
        if not attend.serves_dense(self.backend, queries.shape[3], ks, vs, query_rows(queries, keys)):
            return None
        return attend.DenseCall(ks, vs)
