"""Fused decode attention over compressed keys and values (split over the sequence, merged by log-sum-exp).

Every method whose stored coordinate decodes as ``x_j = table[code_j] * scale_g + bias_g`` (``g`` = the group
of ``j``) is served by one kernel: ``turboquant`` (table = Lloyd-Max centroids, one group per vector, scale =
the norm, no bias; queries and outputs live in the rotated domain), ``affine`` (table = ``0 .. 2^b - 1``,
per-group scale and bias, the numerics of ``mx.dequantize``), and ``turboquant_rvq`` with two tables. Codes are
read straight from the cache's packed words (``b`` bits each, densely packed, possibly straddling words): no
fp16 key or value is ever written, and each code is read once.

Layout (FlashAttention-2 / flash-decoding, Dao et al. 2023): one thread group of 128 threads per (batch, KV head,
split of the sequence). ``D / CPT`` threads share a token (each decodes ``CPT`` consecutive coordinates from one
or two words); the rest of the group works on other tokens. Per tile of 128 tokens: partial scores are reduced
across a token's threads with SIMD shuffles, a per-row online softmax runs over the tile, and each thread
accumulates ``p * x`` for its coordinates of every query row (all ``n_rep`` query heads of a GQA group and all
query tokens share the KV head's codes). The per-split ``(out, max, sum)`` are merged with log-sum-exp in MLX.
"""

from __future__ import annotations

import math

import attrs
import mlx.core as mx

from .dialect import kernel

THREADS = 128
TILE = 128
#: Thread groups to aim for across the sequence splits (a few per SM / GPU core).
TARGET_GROUPS = {"cuda": 528, "metal": 128}
#: Query rows (n_rep * T_q) one thread group serves.
MAX_ROWS = 8

SOURCE = """
    constexpr int NCG = D / CPT;
    constexpr int TL = THREADS / NCG;
    constexpr int NW = THREADS / 32;
    constexpr uint KMASK = (1u << KB) - 1u;
    constexpr uint VMASK = (1u << VB) - 1u;

    KVQ_SHARED float p_s[TILE * R];
    KVQ_SHARED float ml_s[2 * R];
    KVQ_SHARED float alpha_s[R];
    KVQ_SHARED float kt_s[1 << KB];
    KVQ_SHARED float vt_s[1 << VB];
    KVQ_SHARED float red_s[NW * R * D];

    const int bh = KVQ_TG_X;
    const int split = KVQ_TG_Y;
    const int H = kc_shape[1];
    const int T = kc_shape[2];
    const int b = bh / H;
    const int h = bh - b * H;
    const int chunk = meta[0];
    const int nsplit = meta[1];
    const int t_begin = split * chunk;
    const int t_end = min(T, t_begin + chunk);
    const int tid = KVQ_TID;
    const int lane = KVQ_LANE;
    const int warp = KVQ_WARP;
    const int cg = tid % NCG;
    const int tl = tid / NCG;
    const int j0 = cg * CPT;

    for (int i = tid; i < (1 << KB); i += THREADS) kt_s[i] = kt[i];
    for (int i = tid; i < (1 << VB); i += THREADS) vt_s[i] = vt[i];
    if (tid < R) { ml_s[2 * tid] = -KVQ_INF; ml_s[2 * tid + 1] = 0.0f; }

    float qr[R][CPT];
    float qsum[R];
    float acc[R][CPT];
    for (int r = 0; r < R; ++r) {
        qsum[r] = 0.0f;
        for (int i = 0; i < CPT; ++i) {
            qr[r][i] = q[(bh * R + r) * D + j0 + i];
            qsum[r] += qr[r][i];
            acc[r][i] = 0.0f;
        }
    }

    const int64_t kbase = b * kc_strides[0] + h * kc_strides[1];
    const int64_t ksbase = b * ks_strides[0] + h * ks_strides[1] + j0 / KG;
    const int64_t kbbase = b * kb_strides[0] + h * kb_strides[1] + j0 / KG;
    const int64_t vbase = b * vc_strides[0] + h * vc_strides[1];
    const int64_t vsbase = b * vs_strides[0] + h * vs_strides[1] + j0 / VG;
    const int64_t vbbase = b * vb_strides[0] + h * vb_strides[1] + j0 / VG;
    const int kbit = j0 * KB;
    const int kw = kbit >> 5;
    const int ksh = kbit & 31;
    const bool k2 = ksh + CPT * KB > 32;
    const int vbit = j0 * VB;
    const int vw = vbit >> 5;
    const int vsh = vbit & 31;
    const bool v2 = vsh + CPT * VB > 32;
    KVQ_BARRIER();

    for (int t0 = t_begin; t0 < t_end; t0 += TILE) {
        for (int k = 0; k < TILE / TL; ++k) {
            const int tt = k * TL + tl;
            const int t = t0 + tt;
            const bool valid = t < t_end;
            float part[R];
            for (int r = 0; r < R; ++r) part[r] = 0.0f;
            if (valid) {
                const int64_t idx = kbase + t * kc_strides[2] + kw;
                kvq_u64 bits = kc[idx];
                if (k2) bits |= ((kvq_u64)kc[idx + 1]) << 32;
                bits >>= ksh;
                for (int i = 0; i < CPT; ++i) {
                    const float c = kt_s[(uint)(bits >> (i * KB)) & KMASK];
                    for (int r = 0; r < R; ++r) part[r] += qr[r][i] * c;
                }
                const float sc = KVQ_F32(ks[ksbase + t * ks_strides[2]]);
                const float bi = KBIAS ? KVQ_F32(kb[kbbase + t * kb_strides[2]]) : 0.0f;
                for (int r = 0; r < R; ++r) part[r] = part[r] * sc + bi * qsum[r];
            }
            for (int off = NCG / 2; off > 0; off >>= 1) {
                for (int r = 0; r < R; ++r) part[r] += KVQ_SHFL_XOR(part[r], off);
            }
            if (cg == 0) {
                for (int r = 0; r < R; ++r) p_s[tt * R + r] = valid ? part[r] : -KVQ_INF;
            }
        }
        KVQ_BARRIER();
        for (int r = warp; r < R; r += NW) {
            float mx_ = -KVQ_INF;
            for (int tt = lane; tt < TILE; tt += 32) mx_ = KVQ_FMAX(mx_, p_s[tt * R + r]);
            for (int off = 16; off > 0; off >>= 1) mx_ = KVQ_FMAX(mx_, KVQ_SHFL_XOR(mx_, off));
            const float m_old = ml_s[2 * r];
            const float l_old = ml_s[2 * r + 1];
            const float m_new = KVQ_FMAX(m_old, mx_);
            float sum = 0.0f;
            for (int tt = lane; tt < TILE; tt += 32) {
                const float p = KVQ_EXP(p_s[tt * R + r] - m_new);
                p_s[tt * R + r] = p;
                sum += p;
            }
            for (int off = 16; off > 0; off >>= 1) sum += KVQ_SHFL_XOR(sum, off);
            if (lane == 0) {
                const float alpha = KVQ_EXP(m_old - m_new);
                alpha_s[r] = alpha;
                ml_s[2 * r] = m_new;
                ml_s[2 * r + 1] = l_old * alpha + sum;
            }
        }
        KVQ_BARRIER();
        for (int r = 0; r < R; ++r) {
            const float alpha = alpha_s[r];
            for (int i = 0; i < CPT; ++i) acc[r][i] *= alpha;
        }
        for (int k = 0; k < TILE / TL; ++k) {
            const int tt = k * TL + tl;
            const int t = t0 + tt;
            if (t < t_end) {
                const int64_t idx = vbase + t * vc_strides[2] + vw;
                kvq_u64 bits = vc[idx];
                if (v2) bits |= ((kvq_u64)vc[idx + 1]) << 32;
                bits >>= vsh;
                const float sc = KVQ_F32(vs[vsbase + t * vs_strides[2]]);
                const float bi = VBIAS ? KVQ_F32(vb[vbbase + t * vb_strides[2]]) : 0.0f;
                float pr[R];
                for (int r = 0; r < R; ++r) pr[r] = p_s[tt * R + r];
                for (int i = 0; i < CPT; ++i) {
                    const float x = vt_s[(uint)(bits >> (i * VB)) & VMASK] * sc + bi;
                    for (int r = 0; r < R; ++r) acc[r][i] += pr[r] * x;
                }
            }
        }
        KVQ_BARRIER();
    }

    for (int off = NCG; off < 32; off <<= 1) {
        for (int r = 0; r < R; ++r) {
            for (int i = 0; i < CPT; ++i) acc[r][i] += KVQ_SHFL_XOR(acc[r][i], off);
        }
    }
    if (lane < NCG) {
        for (int r = 0; r < R; ++r) {
            for (int i = 0; i < CPT; ++i) red_s[(warp * R + r) * D + j0 + i] = acc[r][i];
        }
    }
    KVQ_BARRIER();
    const int64_t obase = ((int64_t)bh * nsplit + split) * R;
    for (int o = tid; o < R * D; o += THREADS) {
        float s = 0.0f;
        for (int w = 0; w < NW; ++w) s += red_s[w * R * D + o];
        out[obase * D + o] = s;
    }
    if (tid < 2 * R) ml[obase * 2 + tid] = ml_s[tid];
"""

INPUTS = ("q", "meta", "kc", "ks", "kb", "kt", "vc", "vs", "vb", "vt")


@attrs.frozen
class Side:
    """One side (keys or values) of the attention, as the kernel reads it: ``x_j = table[code_j] * scale_g +
    bias_g`` with ``g = j // group``.

    :param codes: uint32 ``[B, H_kv, T, W]``: ``D`` codes of ``bits`` bits packed densely per token (may be a
        strided view into a larger buffer: the kernel reads it in place, no copy).
    :param scales: float16/bfloat16/float32 ``[B, H_kv, T]`` (one group) or ``[B, H_kv, T, D // group]``.
    :param biases: like ``scales``, or ``None``.
    :param table: float32 ``[2**bits]``: the value of each code.
    :param bits: 1..8. :param group: coordinates per scale (``D`` for one scale per vector).
    """

    codes: mx.array
    scales: mx.array
    biases: mx.array | None
    table: mx.array
    bits: int
    group: int


def coords_per_thread(bits: int) -> int:
    """Coordinates one thread decodes per token: 8 for 1-4 bits, 4 for 5-8 bits (at most 32 bits of codes)."""
    return 8 if bits <= 4 else 4


def supported(head_dim: int, key_bits: int, value_bits: int, key_group: int, value_group: int,
              rows: int) -> bool:
    """Whether the kernel serves this shape: ``rows = n_rep * T_q <= 8``; ``head_dim`` a power of two with 4 to
    32 threads per token (32..256 at 1-4 bits); groups that are multiples of the per-thread coordinates."""
    cpt = min(coords_per_thread(key_bits), coords_per_thread(value_bits))
    threads = head_dim // cpt if head_dim % cpt == 0 else 0
    return (1 <= rows <= MAX_ROWS and 4 <= threads <= 32 and threads & (threads - 1) == 0
            and all(1 <= b <= 8 for b in (key_bits, value_bits))
            and key_group % cpt == 0 and value_group % cpt == 0
            and head_dim % key_group == 0 and head_dim % value_group == 0)


def splits_for(batch_heads: int, num_tokens: int, backend: str) -> tuple[int, int]:
    """``(splits, chunk)``: the sequence is cut into ``splits`` chunks of ``chunk`` tokens (a multiple of the
    tile) so that about :data:`TARGET_GROUPS` thread groups run."""
    tiles = max(1, math.ceil(num_tokens / TILE))
    splits = max(1, min(tiles, math.ceil(TARGET_GROUPS.get(backend, 256) / batch_heads)))
    chunk = math.ceil(tiles / splits) * TILE
    return math.ceil(num_tokens / chunk), chunk


def decode_attend(q: mx.array, keys: Side, values: Side, backend: str) -> tuple[mx.array, mx.array]:
    """Attention of prepared queries over compressed keys and values (no mask: every key precedes every query).

    :param q: float32 ``[B, H_kv, R, D]``: the scaled queries of each KV head's group (``R = n_rep * T_q``
        rows), already in the codes' domain (e.g. rotated for turboquant).
    :param keys, values: :class:`Side` descriptions with ``T >= 1`` tokens and the same ``D``.
    :param backend: ``"metal"`` or ``"cuda"``.
    :return: ``(out [B, H_kv, R, D] float32, lse [B, H_kv, R] float32)``: normalised output (in the codes'
        domain) and natural-log log-sum-exp of the scores.
    :raises ValueError: a shape :func:`supported` rejects, or mismatched token counts.
    """
    B, H, R, D = q.shape
    T = keys.codes.shape[2]
    if values.codes.shape[2] != T or T < 1:
        raise ValueError(f"keys have {T} tokens and values {values.codes.shape[2]}; need the same count >= 1")
    if not supported(D, keys.bits, values.bits, keys.group, values.group, R):
        raise ValueError(f"decode_attend does not serve head_dim {D}, bits {keys.bits}/{values.bits}, groups "
                         f"{keys.group}/{values.group}, {R} query rows")
    splits, chunk = splits_for(B * H, T, backend)
    cpt = min(coords_per_thread(keys.bits), coords_per_thread(values.bits))
    kern = kernel("decode_attend", backend, INPUTS, ("out", "ml"), SOURCE, ensure_row_contiguous=False)
    template = [("D", D), ("R", R), ("CPT", cpt), ("KB", keys.bits), ("VB", values.bits), ("KG", keys.group),
                ("VG", values.group), ("KBIAS", keys.biases is not None), ("VBIAS", values.biases is not None),
                ("THREADS", THREADS), ("TILE", TILE)]
    meta = mx.array([chunk, splits], mx.int32)
    inputs = [mx.contiguous(q.astype(mx.float32)), meta,
              keys.codes, keys.scales, keys.scales if keys.biases is None else keys.biases, keys.table,
              values.codes, values.scales, values.scales if values.biases is None else values.biases,
              values.table]
    out, ml = kern(inputs=inputs, template=template, grid=(THREADS * B * H, splits, 1),
                   threadgroup=(THREADS, 1, 1), output_shapes=[(B, H, splits, R, D), (B, H, splits, R, 2)],
                   output_dtypes=[mx.float32, mx.float32])
    m, l = ml[..., 0], ml[..., 1]
    top = mx.max(m, axis=2, keepdims=True)
    w = mx.exp(m - top)
    total = mx.sum(w * l, axis=2)
    o = mx.sum(w[..., None] * out, axis=2) / total[..., None]
    return o, top.squeeze(2) + mx.log(total)
