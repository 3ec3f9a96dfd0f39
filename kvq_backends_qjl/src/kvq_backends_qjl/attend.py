"""QJL scores for :func:`kvq.attention.attend_encoded`'s block protocol, computed from the sign sketches.

``score(q, k) = c/m · ‖k_in‖ · ⟨S q, sign(S k_in)⟩ + c_o/m_o · ‖k_out‖ · ⟨S_o q_out, sign(S_o k_out)⟩``, an
unbiased estimate of ``⟨q, k⟩`` (Zandieh, Daliri, Han, arXiv 2406.03482). ``S q`` is computed once
per attention call; keys are never reconstructed. The inlier term uses the whole query (``⟨q, k_in⟩ =
⟨q_in, k_in⟩``, so it stays unbiased; the outlier channels of ``q`` only add a little variance), which is
what lets ``S q`` be shared by every token whatever its group's outlier channels.

In decode on the CPU back end (at most :data:`BITS_MATMUL_MAX_ROWS` query rows per kv head, ``m`` a multiple
of 32), the inlier term runs on the packed bits in place with ``mx.quantized_matmul``: 1-bit codes b with
per-token scale ``2 c/m ‖k_in‖`` and bias ``-c/m ‖k_in‖`` dequantize to ``c/m ‖k_in‖ (2b - 1)``, with no float
copy of the bits (2-4x faster than unpacking at 1-2 rows; its cost grows with the rows, so prefill unpacks).
Elsewhere a bounded chunk of tokens is unpacked to ±1 and multiplied in float32: on an H200, MLX 0.32.4's
CUDA back end has no 1-bit quantized_matmul ("1-bit quantization is not supported"), and its batched
float32 one failed at 2 bits too ("No implementation for problem shape"); Metal's is untested. Fused kernels
belong to kvq_metal.

Memory: :func:`kvq.attention.attend_encoded` runs one block at a time (at most
:data:`kvq.attention.VECTOR_BUDGET_BYTES` of float32 keys and values, or 256 tokens), and :func:`scores` holds
at most 4 float32 arrays as wide as the sketch (``m``) for the block's tokens (the unpacked bits and ±1 signs:
8 float32 copies of the block's keys at the default ``m = 2 · head_dim``; on the CPU's 1-bit path, none), plus
the outlier channels' estimates (``outlier_channels`` floats a token). Decode holds that above the cache.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
from kvq import Encoded

from .quantize import main_sketch, outlier_estimate
from .signs import unpack_signs

#: Bytes that one chunk's temporary float arrays (unpacked signs, gathered query channels) may hold.
CHUNK_BUDGET_BYTES = 16 * 2**20
#: Group size of the 1-bit ``mx.quantized_matmul`` path (one scale and bias per 32 sign bits).
BITS_GROUP = 32
#: Query rows per kv head (``n_rep · T_q``) up to which that path beats unpacking on a 2-core CPU with
#: OpenBLAS (measured: 4x at 2 rows, 1.15x at 8, 2x slower at 16, 25x slower at 256).
BITS_MATMUL_MAX_ROWS = 8


@attrs.frozen(eq=False)
class PreparedQuery:
    """The query as QJL scoring needs it, computed once per attention call.

    :param queries: scaled float32 ``[B, H_kv, n_rep, T_q, D]``.
    :param sketched: ``S q``, float32 ``[B, H_kv, n_rep, T_q, m]``.
    """

    queries: mx.array
    sketched: mx.array


def prepare_queries(q: mx.array, keys: Encoded) -> PreparedQuery:
    """Block protocol: ``S q`` once, for every block of ``keys``.

    :param q: scaled float32 ``[B, H_kv, n_rep, T_q, D]``. :param keys: ``qjl`` :class:`kvq.Encoded`.
    """
    q = q.astype(mx.float32)
    return PreparedQuery(q, q @ main_sketch(keys.params, keys.head_dim).matrix.T)


def _chunks(start: int, stop: int, bytes_per_token: int):
    """``(a, b)`` ranges covering ``start:stop`` whose temporaries fit :data:`CHUNK_BUDGET_BYTES`."""
    step = max(1, CHUNK_BUDGET_BYTES // max(bytes_per_token, 1))
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


def code_bits(sketch_dim: int, query_rows: int) -> int:
    """How :func:`inlier_scores` reads the sign bits: 1 (``mx.quantized_matmul`` on 1-bit codes: CPU, ``m`` a
    multiple of 32, at most :data:`BITS_MATMUL_MAX_ROWS` query rows per kv head) or 0 (unpack to ±1 floats)."""
    on_cpu = mx.default_device() == mx.cpu
    return int(on_cpu and sketch_dim % BITS_GROUP == 0 and query_rows <= BITS_MATMUL_MAX_ROWS)


def inlier_scores(prepared: PreparedQuery, keys: Encoded, start: int, stop: int) -> mx.array:
    """``c/m · ‖k_in‖ · ⟨S q, sign(S k_in)⟩`` for tokens ``start:stop``: float32 ``[B, H, n_rep, T_q, stop-start]``."""
    sketched, d = prepared.sketched, keys.data
    B, H, R, Tq, m = sketched.shape
    # the block's norms only: scaling all T norms would be per block work (and memory) of the whole context
    scale = main_sketch(keys.params, keys.head_dim).estimator_scale
    weight = scale * d["norms"][:, :, start:stop].astype(mx.float32)
    if code_bits(m, R * Tq):
        words = d["signs"][:, :, start:stop].view(mx.uint32)  # little-endian bytes: 32 one-bit codes a word
        w = mx.broadcast_to(weight[..., None], (B, H, stop - start, m // BITS_GROUP))
        return mx.quantized_matmul(sketched, words[:, :, None], (2 * w)[:, :, None], (-w)[:, :, None],
                                   transpose=True, group_size=BITS_GROUP, bits=1)
    parts = []
    for a, b in _chunks(start, stop, 4 * B * H * m):
        signs = unpack_signs(d["signs"][:, :, a:b])[:, :, None]  # [B, H, 1, t, m]
        parts.append((sketched @ signs.swapaxes(-1, -2)) * weight[:, :, None, None, a - start:b - start])
    return mx.concatenate(parts, axis=-1)


def outlier_scores(prepared: PreparedQuery, keys: Encoded, start: int, stop: int) -> mx.array:
    """``⟨q_out, k̂_out⟩`` for tokens ``start:stop``, ``k̂_out`` the outlier estimate of each token (unbiased).

    :return: float32 ``[B, H, n_rep, T_q, stop - start]``.
    """
    q = prepared.queries
    B, H, R, Tq, _ = q.shape
    k = keys.params.outlier_channels
    parts = []
    for a, b in _chunks(start, stop, 4 * B * H * R * Tq * k):
        t = b - a
        idx = keys.data["outlier_indices"][:, :, a:b].astype(mx.int32).reshape(B, H, 1, 1, t * k)
        q_out = mx.take_along_axis(q, idx, axis=-1).reshape(B, H, R, Tq, t, k)
        estimate = outlier_estimate(keys.tokens(a, b))[:, :, None, None]  # [B, H, 1, 1, t, k]
        parts.append(mx.sum(q_out * estimate, axis=-1))
    return mx.concatenate(parts, axis=-1)


def scores(prepared: PreparedQuery, keys: Encoded, start: int, stop: int) -> mx.array:
    """Block protocol: estimated ``q · k`` for tokens ``start:stop`` (float32 ``[B, H, n_rep, T_q, stop-start]``).
    Working set: at most 4 float32 ``[B, H, stop - start, m]`` arrays (the module docstring), nothing that grows
    with the other tokens."""
    s = inlier_scores(prepared, keys, start, stop)
    if keys.params.outlier_channels:
        s = s + outlier_scores(prepared, keys, start, stop)
    return s
