"""``qjl`` keys on kvq_metal's streams kernel: decode attention read straight from the sign bits, with ``affine``
values read from their packed codes (:mod:`kvq_metal.streams`).

Per token the kernel scores ``c/m · ‖k_in‖ · ⟨S q, sign(S k_in)⟩`` from the ``m`` sign bits (uint8, in place)
against the query sketched once per call, adds the outlier channels' estimate
``Σ_i q[idx_i] · c_o/m_o · ‖k_out‖ · (S_oᵀ sign(S_o k_out))_i`` (Zandieh, Daliri, Han, arXiv 2406.03482; the
pure-MLX formula is :mod:`kvq_backends_qjl.attend`), and weighs values decoded as ``code · scale + bias``
(mlx-lm's affine numerics). Served: decode (at most :data:`kvq_metal.attend.MAX_ROWS` query rows per KV head),
no mask, ``affine`` values, head_dim <= 256, shapes :func:`kvq_metal.streams.supported` takes; pure MLX serves the
rest with the same result (:class:`~kvq_backends_qjl.QJLMLX`). Quantize stays pure MLX (one sketch matmul and a
pack: already few launches).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
from kvq_metal import BACKENDS, streams
from kvq_metal.baselines import affine
from kvq_metal.common import decode_shape_ok

from .params import QJLParams
from .quantize import main_sketch, outlier_sketch


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


class QJLKernels(streams.StreamsKernelImpl):
    """Kernel implementation of ``qjl`` (decode attention; see the module docstring and
    :class:`kvq_metal.streams.StreamsKernelImpl`)."""

    method = "qjl"

    def kernel_supports(self, problem) -> bool:
        """Decode attention whose keys the streams kernel reads (sketch dims, outlier channels, head_dim <= 256).
        The values' method is not part of a problem: :meth:`kvq_attend` checks it per call, and runs the first-use
        check per (key parameters, value parameters, head_dim, query rows, dtype)."""
        if problem.op != "attend" or not decode_shape_ok(problem):
            return False
        p = problem.params or QJLParams()
        return problem.head_dim <= 256 and problem.head_dim > p.outlier_channels

    def cost(self, problem) -> float:
        """One query sketch, one kernel over the sign bits and norms (and values of about the same bytes), the
        split merge."""
        B, H, T, D = problem.shape
        p = problem.params or QJLParams()
        stored = p.accounting(D).bits_per_token * B * H * T / 8
        return self.estimate(problem, launches=3, bytes_moved=2 * stored)

    def stream_call(self, keys, values):
        """:func:`key_stream_call`."""
        return key_stream_call(keys, values)

    def prepare(self, keys):
        """:func:`prepare`."""
        return prepare(keys)


def implementations() -> list:
    """The kernel implementation objects of ``qjl`` on both back ends (each offers itself only on its own GPU)."""
    return [QJLKernels(backend) for backend in BACKENDS]
