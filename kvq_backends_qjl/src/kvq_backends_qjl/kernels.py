"""``qjl`` keys on kvq_metal's streams kernel: decode attention read straight from the sign bits, with ``affine``
values read from their packed codes (:mod:`kvq_metal.streams`).

Per token the kernel scores ``c/m · ‖k_in‖ · ⟨S q, sign(S k_in)⟩`` from the ``m`` sign bits (uint8, in place)
against the query sketched once per call, adds the outlier channels' estimate
``Σ_i q[idx_i] · c_o/m_o · ‖k_out‖ · (S_oᵀ sign(S_o k_out))_i`` (Zandieh, Daliri, Han, arXiv 2406.03482; the
pure-MLX formula is :mod:`kvq_backends_qjl.attend`), and weighs values decoded as ``code · scale + bias``
(mlx-lm's affine numerics). Served: decode (at most :data:`kvq_metal.attend.MAX_ROWS` query rows per KV head),
no mask, ``affine`` values, head_dim <= 256, shapes :func:`kvq_metal.streams.supported` takes; pure MLX serves the
rest with the same result (:class:`~kvq_backends_qjl.QJLMLX`).

Quantize (a cache's window flush) is one fused launch (``qjl_quantize.kvq``, :func:`fused_quantize`): the outlier
channels of each group, the norms, and both sketches' sign bits, where pure MLX makes about forty small launches
(0.73 ms per layer and flush on an H200, against 0.10 ms for turboquant's fused encoder).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import mlx.core as mx
from kvq import Encoded
from kvq_metal import BACKENDS, streams
from kvq_metal.base import first_use_check
from kvq_metal.baselines import affine
from kvq_metal.common import decode_shape_ok, normal, relative_error
from kvq_metal.kernel_files import load
from kvq_metal.streams_impl import StreamsKernelImpl

from .params import QJLParams
from .quantize import main_sketch, outlier_sketch
from .signs import unpack_bits

#: The fused encoder (kernel file beside this module; :mod:`kvq_metal.kernel_files`).
QUANTIZE = load(Path(__file__).with_name("qjl_quantize.kvq"))
#: SIMD groups per thread group of the fused encoder (one token each).
ENCODER_WARPS = 4
#: Largest sketch dimensions the fused encoder takes (its threadgroup memory holds a 32-bit flag per sketch row and
#: SIMD group) and most outlier channels.
MAX_ENCODER_SKETCH, MAX_ENCODER_OUTLIER_SKETCH, MAX_ENCODER_OUTLIERS = 1024, 256, 32


def encoder_supports(params: QJLParams, head_dim: int, dtype) -> bool:
    """Whether :func:`fused_quantize` serves keys of ``head_dim`` and ``dtype``: float16, bfloat16 or float32,
    ``outlier_channels < head_dim <= 256`` (uint8 indices), at most :data:`MAX_ENCODER_OUTLIERS` outlier channels,
    sketch dimensions up to :data:`MAX_ENCODER_SKETCH` and :data:`MAX_ENCODER_OUTLIER_SKETCH`."""
    k = params.outlier_channels
    return (dtype in (mx.float16, mx.bfloat16, mx.float32) and k < head_dim <= 256 and k <= MAX_ENCODER_OUTLIERS
            and params.sketch_dim_for(head_dim) <= MAX_ENCODER_SKETCH
            and params.resolved_outlier_sketch_dim <= MAX_ENCODER_OUTLIER_SKETCH)


@lru_cache(maxsize=64)
def _transposed_sketches(params: QJLParams, head_dim: int) -> tuple[mx.array, mx.array]:
    """``(Sᵀ [D, m], S_oᵀ [k, m_o])`` float32, contiguous, made once per parameters (the fused encoder reads a
    sketch row as a column, across lanes); a 1-element placeholder for ``S_oᵀ`` without outlier channels."""
    main = mx.contiguous(main_sketch(params, head_dim).matrix.T)
    if not params.outlier_channels:
        return main, mx.zeros((1,), mx.float32)
    return main, mx.contiguous(outlier_sketch(params).matrix.T)


def fused_quantize(x: mx.array, params: QJLParams, backend: str) -> Encoded:
    """Encode keys ``x`` ``[B, H_kv, T, D]`` as :func:`kvq_backends_qjl.quantize.quantize` does, in one launch of
    ``qjl_quantize.kvq``: one thread group per (KV row, group of ``params.group_size`` tokens, block of
    :data:`ENCODER_WARPS` tokens of that group); see the kernel file.

    The same fields, dtypes and shapes: ``signs`` uint8 ``[B, H, T, m/8]``, ``norms`` float16 ``[B, H, T]``, and with
    outlier channels ``outlier_indices`` uint8 ``[B, H, T, k]``, ``outlier_signs`` uint8 ``[B, H, T, m_o/8]``,
    ``outlier_norms`` float16 ``[B, H, T]``. Sign bits are computed in float32 by the kernel's own sums, so a
    projection within rounding of 0 may take the other sign than pure MLX's matmul (the first-use check bounds how
    often).

    :raises ValueError: a shape or dtype :func:`encoder_supports` rejects, or ``x`` not rank 4.
    """
    if x.ndim != 4 or not encoder_supports(params, x.shape[-1], x.dtype):
        raise ValueError(f"x: the fused qjl encoder takes [B, H, T, D] float keys with outlier_channels < D <= 256 "
                         f"and sketch dims up to {MAX_ENCODER_SKETCH}/{MAX_ENCODER_OUTLIER_SKETCH}; got "
                         f"{x.shape} {x.dtype} with {params!r}")
    B, H, T, D = x.shape
    k, m, mo = params.outlier_channels, params.sketch_dim_for(D), params.resolved_outlier_sketch_dim
    n, groups = B * H, -(-T // params.group_size)
    parts = -(-min(T, params.group_size) // ENCODER_WARPS)  # thread groups per group of tokens
    st, sot = _transposed_sketches(params, D)
    kern = QUANTIZE.kernel(backend, ("x", "st", "sot"), ("signs", "norms", "idx", "osigns", "onorms"))
    signs, norms, idx, osigns, onorms = kern(
        inputs=[x.reshape(n, T, D), st, sot],
        template=[("D", D), ("M", m), ("MO", mo if k else 8), ("K", k), ("G", params.group_size),
                  ("NW", ENCODER_WARPS), ("NORM_T", mx.float16)],
        grid=(32 * ENCODER_WARPS * n * groups, parts, 1), threadgroup=(32 * ENCODER_WARPS, 1, 1),
        output_shapes=[(n, T, m // 8), (n, T), (n, T, k) if k else (1,), (n, T, mo // 8) if k else (1,),
                       (n, T) if k else (1,)],
        output_dtypes=[mx.uint8, mx.float16, mx.uint8, mx.uint8, mx.float16])
    data = {"signs": signs.reshape(B, H, T, m // 8), "norms": norms.reshape(B, H, T)}
    if k:
        data.update(outlier_indices=idx.reshape(B, H, T, k), outlier_signs=osigns.reshape(B, H, T, mo // 8),
                    outlier_norms=onorms.reshape(B, H, T))
    return Encoded(params, data, D)


def check_encoder(impl, params: QJLParams, head_dim: int, dtype) -> tuple[bool, str]:
    """Encode 2 heads x 80 random keys (with the default ``group_size`` of 32: two groups and a partial one;
    channels ``j % 37 == 5`` scaled 6x, so they carry the most energy) with ``impl.kvq_quantize`` and pure MLX: the
    outlier indices must be identical, at most 0.1% of sign bits may differ (projections within float rounding of
    0), and the norms agree within 1e-3 relative."""
    x = normal((1, 2, 80, head_dim), 11, mx.float32, scale=1.0)
    boost = mx.where(mx.arange(head_dim) % 37 == 5, 6.0, 1.0)  # channels 5, 42, 79 ...: outliers
    x = (x * boost).astype(dtype)
    got, want = impl.kvq_quantize(x, params), impl.fallback().kvq_quantize(x, params)
    if set(got.data) != set(want.data):
        return False, f"fields {sorted(got.data)} differ from {sorted(want.data)}"
    notes, ok = [], True
    for name in got.data:
        a, b = got.data[name], want.data[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, f"{name}: {a.shape} {a.dtype} against {b.shape} {b.dtype}"
        if name == "outlier_indices":
            same = bool(mx.all(a == b).item())
            ok &= same
            notes.append(f"indices {'equal' if same else 'differ'}")
        elif name.endswith("signs"):
            differ = mx.mean(unpack_bits(a) != unpack_bits(b)).item()
            ok &= differ <= 1e-3
            notes.append(f"{name} {differ:.1e} differ")
        else:
            err = relative_error(a, b)
            ok &= err < 1e-3
            notes.append(f"{name} error {err:.1e}")
    return ok, ", ".join(notes)


@lru_cache(maxsize=64)
def _tables(params: QJLParams, head_dim: int) -> tuple[mx.array, mx.array | None]:
    """``(sign table [1, 2] = ±c/m, outlier sketch [m_o, k] times c_o/m_o or None)``, made once per parameters."""
    main = main_sketch(params, head_dim)
    table = mx.array([[-main.estimator_scale, main.estimator_scale]], mx.float32)
    if not params.outlier_channels:
        return table, None
    o = outlier_sketch(params)
    return table, o.matrix * o.estimator_scale


def key_stream_call(keys, values) -> streams.StreamCall | None:
    """The :class:`kvq_metal.streams.StreamCall` of ``qjl`` keys and ``affine`` values; ``None`` for other values
    or head_dims above 256 (uint16 outlier indices)."""
    if values.method != "affine" or keys.head_dim > 256:
        return None
    p, d, D = keys.params, keys.data, keys.head_dim
    m = p.sketch_dim_for(D)
    table, sketch = _tables(p, D)
    offset = D if p.outlier_channels else 0
    key = streams.Stream(d["signs"], m, 1, table, scales=(d["norms"],), offset=offset)
    outliers = None
    if p.outlier_channels:
        outliers = streams.Outliers(d["outlier_indices"], d["outlier_signs"], d["outlier_norms"], sketch, 0)
    return streams.StreamCall((key,), (affine.value_stream(values),), offset + m, outliers)


def prepare(keys):
    """Scaled float32 ``q [B, H_kv, n_rep, T_q, D]`` -> ``[q | S q]`` (``S q`` alone without outlier channels)."""
    p, D = keys.params, keys.head_dim
    matrix = main_sketch(p, D).matrix

    def run(q):
        sketched = q @ matrix.T
        return mx.concatenate([q, sketched], axis=-1) if p.outlier_channels else sketched

    return run


class QJLKernels(StreamsKernelImpl):
    """Kernel implementation of ``qjl`` (decode attention; see the module docstring and
    :class:`kvq_metal.streams_impl.StreamsKernelImpl`)."""

    method = "qjl"

    def kernel_supports(self, problem) -> bool:
        """Decode attention whose keys the streams kernel reads (sketch dims, outlier channels, head_dim <= 256).
        The values' method is not part of a problem: :meth:`kvq_attend` checks it per call, and runs the first-use
        check per (key parameters, value parameters, head_dim, query rows, dtype). Quantize where
        :func:`encoder_supports` takes the keys, after its first-use check (:func:`check_encoder`) per
        (parameters, head_dim, dtype)."""
        p = problem.params or QJLParams()
        if problem.op == "quantize":
            if not encoder_supports(p, problem.head_dim, problem.dtype):
                return False
            return first_use_check(self.backend, "qjl_quantize", (p, problem.head_dim, str(problem.dtype)),
                                   lambda: check_encoder(self, p, problem.head_dim, problem.dtype))
        if problem.op != "attend" or not decode_shape_ok(problem):
            return False
        return problem.head_dim <= 256 and problem.head_dim > p.outlier_channels

    def cost(self, problem) -> float:
        """Attend: one query sketch, one kernel over the sign bits and norms (and values of about the same bytes),
        the split merge. Quantize: one kernel reading each key once and writing its fields."""
        B, H, T, D = problem.shape
        p = problem.params or QJLParams()
        stored = p.accounting(D).bits_per_token * B * H * T / 8
        if problem.op == "quantize":
            return self.estimate(problem, launches=1, bytes_moved=stored + B * H * T * D * problem.dtype.size)
        return self.estimate(problem, launches=3, bytes_moved=2 * stored)

    def kvq_quantize(self, x, params):
        """``kvq_quantize`` spec: :func:`fused_quantize` where :func:`encoder_supports` takes ``x``, else the
        pure-MLX encoder (errors as :func:`kvq_backends_qjl.quantize.quantize`)."""
        if (isinstance(params, QJLParams) and isinstance(x, mx.array) and x.ndim == 4 and x.size
                and encoder_supports(params, x.shape[-1], x.dtype)):
            return fused_quantize(x, params, self.backend)
        return self.fallback().kvq_quantize(x, params)

    def stream_call(self, keys, values):
        """:func:`key_stream_call`."""
        return key_stream_call(keys, values)

    def prepare(self, keys):
        """:func:`prepare`."""
        return prepare(keys)


def implementations() -> list:
    """The kernel implementation objects of ``qjl`` on both back ends (each offers itself only on its own GPU)."""
    return [QJLKernels(backend) for backend in BACKENDS]
