// decode_attend_streams_tc: decode attention over code streams (kvq_metal.streams) on tensor cores (CUDA,
// mma.sync m16n8k16, sm_80 and later): the contract of decode_attend_streams.kvq (same inputs, same outputs, merged
// by decode_merge_streams.kvq), the warp layout of decode_attend_tc.cu.
// Reference: kvq_metal.reference.decode_attend_streams
// Launcher: kvq_metal.streams.decode_attend_streams
// Inputs kvq_metal.streams.INPUTS; outputs out [B, H, NS, R, DO] (unnormalised), ml [B, H, NS, R, 2] (max in
// natural-log units, sum). Template: kvq_metal.streams._tc_template. Header: decode_attend_streams_tc.cuh.
// Blocks: x = b * H + h; with ND = 2, y = 0: the sinks (slot NS - 2), y = 1: the window (slot NS - 1), attended
// from the raw queries qr times QSCALE's float bits, their values written where value stream A's go; y >= ND: split
// y - ND of the compressed tokens (slot y - ND).
// Scores: per key stream X (A, B) S_X^T [16 tokens, 8 rows] = K_X [16, DIM_X] . Q_X^T on tensor cores, the keys the
// A operand (lane (g, c): tokens g, g + 8, a slice of DIM_X / 4 coordinates c * DIM_X / 4 ..., two per table lookup),
// the prepared query rows at the stream's offset the B operand; each stream's fp32 result times its per-token scales,
// summed, plus QJL's outlier-channel estimate (SIMT: lane l takes token l % 16 of a tile, half of the channels).
// Values: per value stream O_X^T [DIM_X, 8] += V_X^T [DIM_X, 16] . P_X^T [16, 8] (lane: 4 tokens, coordinates
// g * DIM_X / 8 ...), P_X the probabilities times the stream's per-token scales (grouped scales and biases are
// applied while decoding, one fma.f16x2 per pair). Stream B's output follows stream A's (DO = VA_DIM + VB_DIM).

    constexpr int NWARP = THREADS / 32;
    constexpr float LOG2E = 1.4426950408889634f;
    constexpr float LN2 = 0.6931471805599453f;
    // key streams: slices of S* coordinates of 2 tokens per lane, KS* k-steps; value streams: slices of SV* of 4
    // tokens, MT* m-tiles
    constexpr int SKA = KA_DIM / 4, KSA = KA_DIM / 16;
    constexpr int SKB = KB_DIM / 4, KSB = KB_ON ? KB_DIM / 16 : 0;
    constexpr int SVA = VA_DIM / 8, MTA = VA_DIM / 16;
    constexpr int SVB = VB_DIM / 8, MTB = VB_ON ? VB_DIM / 16 : 0;
    // a slice starts on a word for every lane when its bit length is a multiple of 32; else one more word is read
    constexpr bool KAAL = (SKA * KA_BITS) % 32 == 0, KBAL = (SKB * KB_BITS) % 32 == 0;
    constexpr bool VAAL = (SVA * VA_BITS) % 32 == 0, VBAL = (SVB * VB_BITS) % 32 == 0;
    constexpr int KANW = (SKA * KA_BITS + 31) / 32 + (KAAL ? 0 : 1);
    constexpr int KBNW = (SKB * KB_BITS + 31) / 32 + (KBAL ? 0 : 1);
    constexpr int VANW = (SVA * VA_BITS + 31) / 32 + (VAAL ? 0 : 1);
    constexpr int VBNW = (SVB * VB_BITS + 31) / 32 + (VBAL ? 0 : 1);
    constexpr int KAVEC = !KAAL ? 1 : (KANW % 4 == 0 ? 4 : (KANW % 2 == 0 ? 2 : 1));
    constexpr int KBVEC = !KBAL ? 1 : (KBNW % 4 == 0 ? 4 : (KBNW % 2 == 0 ? 2 : 1));
    constexpr int VAVEC = !VAAL ? 1 : (VANW % 4 == 0 ? 4 : (VANW % 2 == 0 ? 2 : 1));
    constexpr int VBVEC = !VBAL ? 1 : (VBNW % 4 == 0 ? 4 : (VBNW % 2 == 0 ? 2 : 1));
    // value stream A's scale groups per slice (VA_GRP: grouped scales and biases, applied while decoding)
    constexpr int VANG = VA_GRP && SVA >= VA_G ? SVA / VA_G : 1;
    // 1-bit streams decode four coordinates per lookup of a nibble table (values: two m-tiles at a time)
    constexpr bool KAQ = KA_BITS == 1, KBQ = KB_ON && KB_BITS == 1;
    constexpr bool VAQ = VA_BITS == 1 && !VA_GRP && MTA % 2 == 0, VBQ = VB_ON && VB_BITS == 1 && MTB % 2 == 0;
    // the code tables (entries as half2, nibble entries as two; 32 copies where REP), then the block's output
    constexpr int TKA = (KAQ ? 32 : (KA_PAIR ? 1 << (2 * KA_BITS) : 1 << KA_BITS)) * (KA_REP ? 32 : 1);
    constexpr int TKB = KB_ON ? (KBQ ? 32 : (KB_PAIR ? 1 << (2 * KB_BITS) : 1 << KB_BITS)) * (KB_REP ? 32 : 1) : 0;
    constexpr int TVA = (VAQ ? 32 : (VA_PAIR ? 1 << (2 * VA_BITS) : 1 << VA_BITS)) * (VA_REP ? 32 : 1);
    constexpr int TVB = VB_ON ? (VBQ ? 32 : (VB_PAIR ? 1 << (2 * VB_BITS) : 1 << VB_BITS)) * (VB_REP ? 32 : 1) : 0;
    constexpr int TABW = TKA + TKB + TVA + TVB;
    constexpr int RED = R * DO;
    constexpr int SMW = TABW > RED ? TABW : RED;
    constexpr int QW = R * (DQ > D ? DQ : D);
    KVQ_SHARED __align__(16) uint smem_s[SMW];
    KVQ_SHARED float q_s[QW];
    KVQ_SHARED __align__(16) float osk_s[OK > 0 ? OM * OK : 1];
    KVQ_SHARED float ol_s[OK > 0 ? NWARP * NT * 16 * R : 1];
    KVQ_SHARED float mw_s[NWARP * 8];
    KVQ_SHARED float lw_s[NWARP * 8];
    // QSH: the query B fragments in shared memory, pre-packed (k-step s of lane l: words 2 (32 s + l), + 1; key
    // stream B's k-steps after stream A's), read with one 64-bit load per k-step instead of held in registers
    constexpr int QKS = (KSA + KSB) > D / 16 ? (KSA + KSB) : D / 16;
    KVQ_SHARED __align__(8) uint qh_s[QSH ? 64 * QKS : 2];
    uint* katab_s = smem_s;
    uint* kbtab_s = smem_s + TKA;
    uint* vatab_s = smem_s + TKA + TKB;
    uint* vbtab_s = smem_s + TKA + TKB + TVA;
    float* red_s = reinterpret_cast<float*>(smem_s);

    const int bh = KVQ_TG_X;
    const int NS = KVQ_NTG_Y;
    const int nsplit = NS - ND;
    // uncompressed blocks take y < ND (more bytes per token: they start first) and the last ND slots
    const int split = ND > 0 ? (KVQ_TG_Y < ND ? nsplit + KVQ_TG_Y : KVQ_TG_Y - ND) : KVQ_TG_Y;
    const int H = kc_shape[1];
    const int T = kc_shape[2];
    const int b = bh / H;
    const int h = bh - b * H;
    const int tid = KVQ_TID;
    const int lane = KVQ_LANE;
    const int warp = KVQ_WARP;
    const int g = lane >> 2;
    const int c = lane & 3;
    constexpr int NT_CODES = NT;

    auto run = [&](auto role) {
    constexpr bool DENSE = decltype(role)::value;
    constexpr int NT = DENSE ? 1 : NT_CODES;
    constexpr int TILE = NWARP * 16 * NT;
    // the key side as this role reads it: the raw rows (D coordinates) or stream A
    constexpr int SK1 = DENSE ? D / 4 : SKA;
    constexpr int KS1 = DENSE ? D / 16 : KSA;
    constexpr int SV1 = DENSE ? D / 8 : SVA;
    constexpr int MT1 = DENSE ? D / 16 : MTA;
    constexpr int QSTR = DENSE ? D : DQ;
    constexpr int QOFF = DENSE ? 0 : KA_OFF;
    constexpr bool KBX = KB_ON && !DENSE;
    constexpr bool VBX = VB_ON && !DENSE;
    constexpr bool OUTL = OK > 0 && !DENSE;
    constexpr int NB = OM / 8;             // outlier sign bytes per token: half-warp 0 reads NB / 2, 1 the rest
    constexpr int OSB = (NB + 1) / 2;
    const int dsplit = split - nsplit;  // DENSE: 0 the sinks, 1 the window
    const int chunk = ((T + TILE - 1) / TILE + nsplit - 1) / nsplit * TILE;
    const int t_begin = DENSE ? 0 : split * chunk;
    const int t_end = DENSE ? (dsplit == 0 ? (SINKS ? sk_shape[2] : 0) : wk_shape[2]) : min(T, t_begin + chunk);

    // row offsets, token strides, word counts and vector-load checks of every stream (one check per block)
    const int64_t kab = b * kc_strides[0] + h * kc_strides[1], ka_ts = kc_strides[2], ka_es = kc_strides[3];
    const int64_t kbb = b * kb_c_strides[0] + h * kb_c_strides[1], kb_ts = kb_c_strides[2], kb_es = kb_c_strides[3];
    const int64_t vab = b * vc_strides[0] + h * vc_strides[1], va_ts = vc_strides[2], va_es = vc_strides[3];
    const int64_t vbb = b * vb_c_strides[0] + h * vb_c_strides[1], vb_ts = vb_c_strides[2], vb_es = vb_c_strides[3];
    const int ka_rw = kc_shape[3] * KA_CB / 4, kb_rw = kb_c_shape[3] * KB_CB / 4;
    const int va_rw = vc_shape[3] * VA_CB / 4, vb_rw = vb_c_shape[3] * VB_CB / 4;
    auto vec_ok = [&](const auto* arr, const int64_t base, const int64_t ts, const int64_t es, const int cb,
                      const int words) -> bool {
        return es == 1 && (ts * cb) % (4 * words) == 0 &&
               (reinterpret_cast<size_t>(arr + base) & (size_t)(4 * words - 1)) == 0;
    };
    const bool kavec = vec_ok(kc, kab, ka_ts, ka_es, KA_CB, KAVEC);
    const bool kbvec = vec_ok(kb_c, kbb, kb_ts, kb_es, KB_CB, KBVEC);
    const bool vavec = vec_ok(vc, vab, va_ts, va_es, VA_CB, VAVEC);
    const bool vbvec = vec_ok(vb_c, vbb, vb_ts, vb_es, VB_CB, VBVEC);
    const int ka_bit = c * SKA * KA_BITS, kb_bit = c * SKB * KB_BITS;
    const int va_bit = g * SVA * VA_BITS, vb_bit = g * SVB * VB_BITS;
    const int va_g0 = (g * SVA) / VA_G;
    const int64_t ka1 = b * ka_s1_strides[0] + h * ka_s1_strides[1], ka1_ts = ka_s1_strides[2];
    const int64_t ka2 = b * ka_s2_strides[0] + h * ka_s2_strides[1], ka2_ts = ka_s2_strides[2];
    const int64_t kb1 = b * kb_s1_strides[0] + h * kb_s1_strides[1], kb1_ts = kb_s1_strides[2];
    const int64_t kb2 = b * kb_s2_strides[0] + h * kb_s2_strides[1], kb2_ts = kb_s2_strides[2];
    const int64_t va1 = b * va_s1_strides[0] + h * va_s1_strides[1], va1_ts = va_s1_strides[2];
    const int64_t va2 = b * va_s2_strides[0] + h * va_s2_strides[1], va2_ts = va_s2_strides[2];
    const int64_t vag = VA_GRP ? va_s1_strides[3] : 0;
    const int64_t vabb = b * va_b_strides[0] + h * va_b_strides[1], vab_ts = va_b_strides[2];
    const int64_t vabg = VA_GRP && VA_BIAS ? va_b_strides[3] : 0;
    const int64_t vb1 = b * vb_s1_strides[0] + h * vb_s1_strides[1], vb1_ts = vb_s1_strides[2];
    const int64_t vb2 = b * vb_s2_strides[0] + h * vb_s2_strides[1], vb2_ts = vb_s2_strides[2];

    // DENSE: the sinks (sk/sv) or the window (wk/wv), rows of the model's dtype (DDT 0: float16, 1: bfloat16)
    const auto* dkp = dsplit == 0 ? sk : wk;
    const auto* dvp = dsplit == 0 ? sv : wv;
    const int64_t dks2 = dsplit == 0 ? sk_strides[2] : wk_strides[2], dks3 = dsplit == 0 ? sk_strides[3] : wk_strides[3];
    const int64_t dvs2 = dsplit == 0 ? sv_strides[2] : wv_strides[2], dvs3 = dsplit == 0 ? sv_strides[3] : wv_strides[3];
    const int dkl = dsplit == 0 ? sk_shape[3] : wk_shape[3], dvl = dsplit == 0 ? sv_shape[3] : wv_shape[3];
    const int64_t dkb = dsplit == 0 ? b * sk_strides[0] + h * sk_strides[1] : b * wk_strides[0] + h * wk_strides[1];
    const int64_t dvb = dsplit == 0 ? b * sv_strides[0] + h * sv_strides[1] : b * wv_strides[0] + h * wv_strides[1];
    constexpr int DKW = D / 8, DVW = D / 16;  // half2 words per key / value slice of a raw row
    constexpr int DKV = DKW % 4 == 0 ? 4 : (DKW % 2 == 0 ? 2 : 1);
    constexpr int DVV = DVW % 4 == 0 ? 4 : (DVW % 2 == 0 ? 2 : 1);
    const bool dvec_k = DENSE && DDT < 2 && dks3 == 1 && dkl == D && dks2 % (2 * DKV) == 0 &&
                        (reinterpret_cast<size_t>(dkp + dkb) & (4 * DKV - 1)) == 0;
    const bool dvec_v = DENSE && DDT < 2 && dvs3 == 1 && dvl == D && dvs2 % (2 * DVV) == 0 &&
                        (reinterpret_cast<size_t>(dvp + dvb) & (4 * DVV - 1)) == 0;

    // one warp step: NT tiles of 16 tokens; key words of tokens g, g + 8 and value words of tokens 2c, 2c + 1,
    // 2c + 8, 2c + 9; per-token scales of keys and of values (those folded into the probabilities) for tokens
    // g, g + 8; value stream A's group scales and biases
    struct Step {
        uint ka[NT][2][DENSE ? DKW : KANW];
        uint kb[NT][2][KBX ? KBNW : 1];
        uint va[NT][4][DENSE ? DVW : VANW];
        uint vb[NT][4][VBX ? VBNW : 1];
        float ksa[NT][2], ksb[NT][2], vwa[NT][2], vwb[NT][2];
        float vsc[NT][4][VANG], vbi[NT][4][VANG];
        // QJL's outliers of token lane % 16 of each tile: this half-warp's sign bytes, the channels, the norm
        uint osg[NT][OUTL ? OSB : 1];
        uint oid[NT][OUTL ? OK : 1];
        float onr[NT];
    };
    auto load = [&](Step& buf, const int t0, auto vt) {
      // VECS: every stream's rows read with vector loads and every offset within a (batch, KV head) row in 32 bits,
      // known at compile time; at: token t (column j of column stride cs) of an array of token stride ts (kvq_offset)
      constexpr bool VECS = decltype(vt)::value;
      auto at = [&](const int t, const int64_t ts, const int j = 0, const int64_t cs = 0) {
          return kvq_offset<VECS>(t, ts, j, cs);
      };
      if constexpr (DENSE) {
#pragma unroll
        for (int st = 0; st < NT; ++st) {
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int t = max(min(t0 + st * 16 + g + 8 * u, t_end - 1), 0);
                kvq_dense_row<DKV, DDT>(buf.ka[st][u], dkp + dkb + (int64_t)t * dks2, c * SK1, dvec_k, dks3, dkl);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int t = max(min(t0 + st * 16 + 2 * c + (u & 1) + 8 * (u >> 1), t_end - 1), 0);
                kvq_dense_row<DVV, DDT>(buf.va[st][u], dvp + dvb + (int64_t)t * dvs2, g * SV1, dvec_v, dvs3, dvl);
            }
        }
      } else {
        // past the end a token index is clamped (its score is masked to -inf): no load needs a branch
#pragma unroll
        for (int st = 0; st < NT; ++st) {
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int t = min(t0 + st * 16 + g + 8 * u, T - 1);
                const auto* ra = kc + kab + at(t, ka_ts);
                KVQ_ROW_WORDS(buf.ka[st][u], ra, KANW, KA_CB, KAVEC, VECS || kavec, ka_bit >> 5, ka_rw, ka_es, !KAAL)
                float s = 1.0f;
                if (KA_NS > 0) s = KVQ_F32(ka_s1[ka1 + at(t, ka1_ts)]);
                if (KA_NS > 1) s *= KVQ_F32(ka_s2[ka2 + at(t, ka2_ts)]);
                buf.ksa[st][u] = s;
                if constexpr (KBX) {
                    const auto* rb = kb_c + kbb + at(t, kb_ts);
                    KVQ_ROW_WORDS(buf.kb[st][u], rb, KBNW, KB_CB, KBVEC, VECS || kbvec, kb_bit >> 5, kb_rw, kb_es, !KBAL)
                    float sb = 1.0f;
                    if (KB_NS > 0) sb = KVQ_F32(kb_s1[kb1 + at(t, kb1_ts)]);
                    if (KB_NS > 1) sb *= KVQ_F32(kb_s2[kb2 + at(t, kb2_ts)]);
                    buf.ksb[st][u] = sb;
                }
                float w = 1.0f;
                if (!VA_GRP && VA_NS > 0) w = KVQ_F32(va_s1[va1 + at(t, va1_ts)]);
                if (!VA_GRP && VA_NS > 1) w *= KVQ_F32(va_s2[va2 + at(t, va2_ts)]);
                buf.vwa[st][u] = w;
                float wb = 1.0f;
                if (VBX && VB_NS > 0) wb = KVQ_F32(vb_s1[vb1 + at(t, vb1_ts)]);
                if (VBX && VB_NS > 1) wb *= KVQ_F32(vb_s2[vb2 + at(t, vb2_ts)]);
                buf.vwb[st][u] = wb;
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int t = min(t0 + st * 16 + 2 * c + (u & 1) + 8 * (u >> 1), T - 1);
                const auto* ra = vc + vab + at(t, va_ts);
                KVQ_ROW_WORDS(buf.va[st][u], ra, VANW, VA_CB, VAVEC, VECS || vavec, va_bit >> 5, va_rw, va_es, !VAAL)
                if constexpr (VBX) {
                    const auto* rb = vb_c + vbb + at(t, vb_ts);
                    KVQ_ROW_WORDS(buf.vb[st][u], rb, VBNW, VB_CB, VBVEC, VECS || vbvec, vb_bit >> 5, vb_rw, vb_es, !VBAL)
                }
#pragma unroll
                for (int k = 0; k < VANG; ++k) {
                    buf.vsc[st][u][k] = VA_GRP ? KVQ_F32(va_s1[va1 + at(t, va1_ts, va_g0 + k, vag)]) : 0.0f;
                    buf.vbi[st][u][k] = VA_GRP && VA_BIAS ? KVQ_F32(va_b[vabb + at(t, vab_ts, va_g0 + k, vabg)]) : 0.0f;
                }
            }
            if constexpr (OUTL) {
                const int half = lane >> 4;
                const int t = min(t0 + st * 16 + (lane & 15), T - 1);
                const int64_t ob = b * o_c_strides[0] + h * o_c_strides[1] + (int64_t)t * o_c_strides[2];
                const int64_t ib = b * o_i_strides[0] + h * o_i_strides[1] + (int64_t)t * o_i_strides[2];
                const int b0 = half ? NB / 2 : 0, b1 = half ? NB : NB / 2;
#pragma unroll
                for (int j = 0; j < OSB; ++j) buf.osg[st][j] = b0 + j < b1 ? (uint)o_c[ob + (b0 + j) * o_c_strides[3]] : 0u;
#pragma unroll
                for (int i = 0; i < OK; ++i) buf.oid[st][i] = (uint)o_i[ib + i * o_i_strides[3]];
                buf.onr[st] = KVQ_F32(o_s[b * o_s_strides[0] + h * o_s_strides[1] + (int64_t)t * o_s_strides[2]]);
            }
        }
      }
    };
    Step buf;
    Step nxt;  // PF: the next step's loads, issued before this step's math
    load(buf, t_begin + warp * 16 * NT, kvq_role<false>{});

    // the code tables, the outlier sketch and the query rows (prepared, or raw and scaled for uncompressed tokens)
    if (!DENSE) {
        if (KAQ) KVQ_QUAD_TABLE(katab_s, ka_t, KA_REP) else KVQ_STREAM_TABLE(katab_s, ka_t, KA_BITS, KA_PAIR, KA_REP)
        if (KBQ) KVQ_QUAD_TABLE(kbtab_s, kb_t, KB_REP) else if (KB_ON) KVQ_STREAM_TABLE(kbtab_s, kb_t, KB_BITS, KB_PAIR, KB_REP)
        if (VAQ) KVQ_QUAD_TABLE(vatab_s, va_t, VA_REP) else KVQ_STREAM_TABLE(vatab_s, va_t, VA_BITS, VA_PAIR, VA_REP)
        if (VBQ) KVQ_QUAD_TABLE(vbtab_s, vb_t, VB_REP) else if (VB_ON) KVQ_STREAM_TABLE(vbtab_s, vb_t, VB_BITS, VB_PAIR, VB_REP)
        for (int i = tid; i < (OK > 0 ? OM * OK : 0); i += THREADS) osk_s[i] = o_m[i];
        for (int e = tid; e < R * DQ; e += THREADS) {
            const int r = e / DQ;
            q_s[e] = q[bh * q_strides[0] + r * q_strides[1] + (e - r * DQ) * q_strides[2]];
        }
    } else {
        const int Tq = qr_shape[2];
        const int n_rep = R / Tq;
        const float qscale = KVQ_AS_FLOAT(QSCALE);
        for (int e = tid; e < R * D; e += THREADS) {
            const int r = e / D;
            const int j = e - r * D;
            const int hq = h * n_rep + r / Tq;
            q_s[e] = KVQ_F32(qr[b * qr_strides[0] + hq * qr_strides[1] + (r % Tq) * qr_strides[2] + j * qr_strides[3]]) * qscale;
        }
    }
    KVQ_BARRIER();
    // the tables' shared-space addresses (kvq_table_base) and the byte offsets of the lane's copies: entry e at
    // byte e << SH (a copy per lane: entries 32 slots apart)
    const uint katab_a = kvq_table_base(katab_s), kbtab_a = kvq_table_base(kbtab_s);
    const uint vatab_a = kvq_table_base(vatab_s), vbtab_a = kvq_table_base(vbtab_s);
    const uint kalo = KA_REP ? 4 * lane * (KAQ ? 2 : 1) : 0, kblo = KB_REP ? 4 * lane * (KBQ ? 2 : 1) : 0;
    const uint valo = VA_REP ? 4 * lane * (VAQ ? 2 : 1) : 0, vblo = VB_REP ? 4 * lane * (VBQ ? 2 : 1) : 0;
    constexpr int KASH = (KA_REP ? 7 : 2) + (KAQ ? 1 : 0), KBSH = (KB_REP ? 7 : 2) + (KBQ ? 1 : 0);
    constexpr int VASH = (VA_REP ? 7 : 2) + (VAQ ? 1 : 0), VBSH = (VB_REP ? 7 : 2) + (VBQ ? 1 : 0);
    static_assert(KASH + 2 * KA_BITS <= 32 && KBSH + 2 * KB_BITS <= 32 && VASH + 2 * VA_BITS <= 32 &&
                      VBSH + 2 * VB_BITS <= 32, "KVQ_FIELD_AT: a code field and its entry's shift fit one word");

    // query B fragments: k-step s of a key stream holds its coordinates c * S + 4 s + {0, 1} (b0), {2, 3} (b1)
    uint qfa[QSH ? 1 : KS1][2];
    uint qfb[QSH || !KBX ? 1 : KSB][2];
    // the fragment of k-step s (key stream A: s < KS1; B: KS1 + s) for lane (gq, cq)
    auto qfrag = [&](const int s, const int e, const int gq, const int cq) -> uint {
        if (gq >= R) return 0u;
        if (s < KS1) {
            const int j = QOFF + cq * SK1 + 4 * s + 2 * e;
            return kvq_h2(q_s[gq * QSTR + j], q_s[gq * QSTR + j + 1]);
        }
        const int j = KB_OFF + cq * SKB + 4 * (s - KS1) + 2 * e;
        return kvq_h2(q_s[gq * DQ + j], q_s[gq * DQ + j + 1]);
    };
    if constexpr (QSH) {
        for (int i = tid; i < 64 * (KS1 + (KBX ? KSB : 0)); i += THREADS) {
            const int ln = (i >> 1) & 31;
            qh_s[i] = qfrag(i >> 6, i & 1, ln >> 2, ln & 3);
        }
        KVQ_BARRIER();
    } else {
#pragma unroll
        for (int s = 0; s < KS1; ++s) {
            qfa[s][0] = qfrag(s, 0, g, c);
            qfa[s][1] = qfrag(s, 1, g, c);
        }
#pragma unroll
        for (int s = 0; s < (KBX ? KSB : 0); ++s) {
            qfb[s][0] = qfrag(KS1 + s, 0, g, c);
            qfb[s][1] = qfrag(KS1 + s, 1, g, c);
        }
    }
    const uint2* qh_l = reinterpret_cast<const uint2*>(qh_s) + lane;  // the lane's fragments, 32 uint2 apart

    float acca[MT1][4];
    float accb[VBX ? MTB : 1][4];
#pragma unroll
    for (int i = 0; i < MT1; ++i) { acca[i][0] = 0.0f; acca[i][1] = 0.0f; acca[i][2] = 0.0f; acca[i][3] = 0.0f; }
#pragma unroll
    for (int i = 0; i < (VBX ? MTB : 1); ++i) { accb[i][0] = 0.0f; accb[i][1] = 0.0f; accb[i][2] = 0.0f; accb[i][3] = 0.0f; }
    float m0 = -KVQ_INF, m1 = -KVQ_INF, l0 = 0.0f, l1 = 0.0f;
    float* ol_w = ol_s + warp * NT * 16 * R;

    // offsets within a (batch, KV head) row fit 32 bits in every array the loads read (kvq_fits32 of the T tokens
    // and a row's extent; QJL's outlier arrays keep 64-bit offsets)
    auto fits = [&](const int64_t ts, const int64_t extent) { return kvq_fits32(T, ts, extent); };
    const bool off32 = fits(ka_ts, (kc_shape[3] - 1) * ka_es) && fits(kb_ts, (kb_c_shape[3] - 1) * kb_es) &&
                       fits(va_ts, (vc_shape[3] - 1) * va_es) && fits(vb_ts, (vb_c_shape[3] - 1) * vb_es) &&
                       fits(ka1_ts, 0) && fits(ka2_ts, 0) && fits(kb1_ts, 0) && fits(kb2_ts, 0) && fits(vb1_ts, 0) &&
                       fits(vb2_ts, 0) && fits(va2_ts, 0) && fits(va1_ts, VA_GRP ? (va_s1_shape[3] - 1) * vag : 0) &&
                       fits(vab_ts, VA_GRP && VA_BIAS ? (va_b_shape[3] - 1) * vabg : 0);
    // the warp's steps, with vt: every stream's rows read with vector loads and 32-bit offsets (checked once per
    // block: with the check inside the loop the compiler predicated the word-by-word path in beside the vector
    // one, as in decode_attend_tc.cu)
    auto steps = [&](auto vt) {
    for (int t0 = t_begin + warp * 16 * NT; t0 < t_end; t0 += TILE) {
        if constexpr (PF && !DENSE) load(nxt, t0 + TILE, vt);
        // ---- QJL's outlier channels (SIMT): lane l takes token l % 16 of each tile; est_i = sum_l' S_o[l', i]
        // sign_l' (S_o times c_o / m_o) over the sketch rows of its half of the sign bytes (l / 16), the halves
        // summed, then sum_i q[idx_i] |k_out| est_i over its half of the channels, the halves summed
        if (OUTL) {
            __syncwarp();
#pragma unroll
            for (int st = 0; st < NT; ++st) {
                const int tok = lane & 15;
                const int half = lane >> 4;
                const int t = t0 + st * 16 + tok;
                const bool live = t < t_end;
                float est[OK > 0 ? OK : 1];
#pragma unroll
                for (int i = 0; i < OK; ++i) est[i] = 0.0f;
                const int b0 = half ? NB / 2 : 0, b1 = half ? NB : NB / 2;
#pragma unroll
                for (int j = 0; j < OSB; ++j) {
                    const int l8 = b0 + j;
                    if (l8 >= b1) break;
                    const uint byte = buf.osg[st][j];
#pragma unroll
                    for (int bit = 0; bit < 8; ++bit) {
                        const float sgn = (byte >> bit) & 1u ? 1.0f : -1.0f;
                        const float* row = osk_s + (l8 * 8 + bit) * OK;
                        if (OK % 4 == 0) {
#pragma unroll
                            for (int i4 = 0; i4 < OK / 4; ++i4) {
                                const float4 s4 = reinterpret_cast<const float4*>(row)[i4];
                                est[4 * i4] += s4.x * sgn; est[4 * i4 + 1] += s4.y * sgn;
                                est[4 * i4 + 2] += s4.z * sgn; est[4 * i4 + 3] += s4.w * sgn;
                            }
                        } else {
#pragma unroll
                            for (int i = 0; i < OK; ++i) est[i] += row[i] * sgn;
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < OK; ++i) est[i] += KVQ_SHFL_XOR(est[i], 16);
                float part[R];
#pragma unroll
                for (int r = 0; r < R; ++r) part[r] = 0.0f;
                if (live) {
                    const float on = buf.onr[st];
                    constexpr int OH = (OK + 1) / 2;
#pragma unroll
                    for (int i = 0; i < OK; ++i) {
                        if ((i < OH) == (half == 0)) {
                            const int idx = (int)buf.oid[st][i];
                            const float e = est[i] * on;
#pragma unroll
                            for (int r = 0; r < R; ++r) part[r] += q_s[r * DQ + O_OFF + idx] * e;
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < R; ++r) part[r] += KVQ_SHFL_XOR(part[r], 16);
                if (half == 0) {
#pragma unroll
                    for (int r = 0; r < R; ++r) ol_w[(st * 16 + tok) * R + r] = part[r];
                }
            }
            __syncwarp();
        }
        // ---- scores on tensor cores, one accumulator per key stream
        float sc[NT][4];
#pragma unroll
        for (int st = 0; st < NT; ++st) {
            uint kua[2][DENSE ? 1 : KANW], kub[2][KBX ? KBNW : 1];
#pragma unroll
            for (int u = 0; u < 2 && !DENSE; ++u) {
#pragma unroll
                for (int k = 0; k < KANW; ++k)
                    kua[u][k] = KAAL ? buf.ka[st][u][k] : kvq_funnel(buf.ka[st][u][k], k + 1 < KANW ? buf.ka[st][u][k + 1] : 0u, ka_bit & 31);
#pragma unroll
                for (int k = 0; k < (KBX ? KBNW : 0); ++k)
                    kub[u][k] = KBAL ? buf.kb[st][u][k] : kvq_funnel(buf.kb[st][u][k], k + 1 < KBNW ? buf.kb[st][u][k + 1] : 0u, kb_bit & 31);
            }
            float da[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            float db[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int s = 0; s < KS1; ++s) {
                uint a[4];
                if constexpr (KAQ && !DENSE) {
                    // nibble s of token u: pairs 2s (a[u]) and 2s + 1 (a[2 + u])
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        const uint2 x = KVQ_STREAM_QUAD(kua[u], s, katab_a, kalo, KASH);
                        a[u] = x.x; a[2 + u] = x.y;
                    }
                } else {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int u = e & 1;            // a0/a2: token g, a1/a3: token g + 8
                    const int p = 2 * s + (e >> 1); // pair of the slice
                    if constexpr (DENSE) {
                        a[e] = buf.ka[st][u][p];
                    } else {
                        a[e] = KVQ_TABLE_PAIR(kua[u], p, KA_BITS, KA_PAIR, katab_a, kalo, KASH);
                    }
                }
                }
                if constexpr (QSH) {
                    const uint2 qf = qh_l[32 * s];
                    kvq_mma(da, a[0], a[1], a[2], a[3], qf.x, qf.y);
                } else {
                    kvq_mma(da, a[0], a[1], a[2], a[3], qfa[s][0], qfa[s][1]);
                }
            }
#pragma unroll
            for (int s = 0; s < (KBX ? KSB : 0); ++s) {
                uint a[4];
                if constexpr (KBQ) {
#pragma unroll
                    for (int u = 0; u < 2; ++u) {
                        const uint2 x = KVQ_STREAM_QUAD(kub[u], s, kbtab_a, kblo, KBSH);
                        a[u] = x.x; a[2 + u] = x.y;
                    }
                } else {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int u = e & 1;
                    const int p = 2 * s + (e >> 1);
                    a[e] = KVQ_TABLE_PAIR(kub[u], p, KB_BITS, KB_PAIR, kbtab_a, kblo, KBSH);
                }
                }
                if constexpr (QSH) {
                    const uint2 qf = qh_l[32 * (KS1 + s)];
                    kvq_mma(db, a[0], a[1], a[2], a[3], qf.x, qf.y);
                } else {
                    kvq_mma(db, a[0], a[1], a[2], a[3], qfb[s][0], qfb[s][1]);
                }
            }
            // d: (token g, rows 2c, 2c + 1), (token g + 8, rows 2c, 2c + 1)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int u = e >> 1;
                const int row = 2 * c + (e & 1);
                const bool ok = t0 + st * 16 + g + 8 * u < t_end;
                float v = DENSE ? da[e] : da[e] * buf.ksa[st][u];
                if (KBX) v += db[e] * buf.ksb[st][u];
                if (OUTL && row < R) v += ol_w[(st * 16 + g + 8 * u) * R + row];
                sc[st][e] = ok ? v * LOG2E : -KVQ_INF;
            }
        }
        // ---- online softmax of rows 2c, 2c + 1 (a row's scores live in the 8 lanes of equal c)
        float z0, z1, al0, al1;
        if (kvq_softmax_step<SLACK>(sc, m0, m1, l0, l1, z0, z1, al0, al1)) {
            kvq_rescale<MT1>(acca, al0, al1);
            kvq_rescale<VBX ? MTB : 0>(accb, al0, al1);
        }
        // ---- values on tensor cores, one accumulator per value stream
#pragma unroll
        for (int st = 0; st < NT; ++st) {
            float p[4];
            kvq_probs(sc[st], z0, z1, l0, l1, p);
            uint pa0, pa1;
            kvq_pfrag(p, DENSE ? 1.0f : buf.vwa[st][0], DENSE ? 1.0f : buf.vwa[st][1], pa0, pa1);
            uint vua[4][DENSE ? 1 : VANW], vub[4][VBX ? VBNW : 1];
            uint vh[4][VANG], vbh[4][VANG];
#pragma unroll
            for (int u = 0; u < 4 && !DENSE; ++u) {
#pragma unroll
                for (int k = 0; k < VANW; ++k)
                    vua[u][k] = VAAL ? buf.va[st][u][k] : kvq_funnel(buf.va[st][u][k], k + 1 < VANW ? buf.va[st][u][k + 1] : 0u, va_bit & 31);
#pragma unroll
                for (int k = 0; k < (VBX ? VBNW : 0); ++k)
                    vub[u][k] = VBAL ? buf.vb[st][u][k] : kvq_funnel(buf.vb[st][u][k], k + 1 < VBNW ? buf.vb[st][u][k + 1] : 0u, vb_bit & 31);
#pragma unroll
                for (int k = 0; k < VANG; ++k) {
                    vh[u][k] = kvq_h2(buf.vsc[st][u][k], buf.vsc[st][u][k]);
                    vbh[u][k] = kvq_h2(buf.vbi[st][u][k], buf.vbi[st][u][k]);
                }
            }
            if constexpr (VAQ && !DENSE) {
                // nibble i / 2 of a slice: pairs i and i + 1, m-tiles i and i + 1
#pragma unroll
                for (int i = 0; i < MT1; i += 2) {
                    uint xv[4], xw[4];
#pragma unroll
                    for (int u = 0; u < 4; ++u) {
                        const uint2 x = KVQ_STREAM_QUAD(vua[u], i / 2, vatab_a, valo, VASH);
                        xv[u] = x.x; xw[u] = x.y;
                    }
                    kvq_mma_vt(acca[i], xv, pa0, pa1);
                    kvq_mma_vt(acca[i + 1], xw, pa0, pa1);
                }
            } else {
#pragma unroll
            for (int i = 0; i < MT1; ++i) {
                uint xv[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    if constexpr (DENSE) {
                        xv[u] = buf.va[st][u][i];
                    } else {
                        uint x = KVQ_TABLE_PAIR(vua[u], i, VA_BITS, VA_PAIR, vatab_a, valo, VASH);
                        if (VA_GRP) {
                            const int gi = SVA >= VA_G ? (2 * i) / VA_G : 0;
                            x = kvq_hfma2(x, vh[u][gi], vbh[u][gi]);
                        }
                        xv[u] = x;
                    }
                }
                // A = V^T: rows (coordinates g SV + 2i, g SV + 2i + 1), columns (tokens 2c, 2c + 1 | 2c + 8, 2c + 9)
                kvq_mma_vt(acca[i], xv, pa0, pa1);
            }
            }
            if constexpr (VBX) {
                uint pb0, pb1;
                kvq_pfrag(p, buf.vwb[st][0], buf.vwb[st][1], pb0, pb1);
                if constexpr (VBQ) {
#pragma unroll
                    for (int i = 0; i < MTB; i += 2) {
                        uint xv[4], xw[4];
#pragma unroll
                        for (int u = 0; u < 4; ++u) {
                            const uint2 x = KVQ_STREAM_QUAD(vub[u], i / 2, vbtab_a, vblo, VBSH);
                            xv[u] = x.x; xw[u] = x.y;
                        }
                        kvq_mma_vt(accb[i], xv, pb0, pb1);
                        kvq_mma_vt(accb[i + 1], xw, pb0, pb1);
                    }
                } else {
#pragma unroll
                for (int i = 0; i < MTB; ++i) {
                    uint xv[4];
#pragma unroll
                    for (int u = 0; u < 4; ++u) xv[u] = KVQ_TABLE_PAIR(vub[u], i, VB_BITS, VB_PAIR, vbtab_a, vblo, VBSH);
                    kvq_mma_vt(accb[i], xv, pb0, pb1);
                }
                }
            }
        }
        if constexpr (PF && !DENSE) {
            buf = nxt;
        } else {
            load(buf, t0 + TILE, vt);
        }
    }
    };
    if constexpr (DENSE) {
        steps(kvq_role<false>{});
    } else if (kavec && (!KBX || kbvec) && vavec && (!VBX || vbvec) && off32) {
        steps(kvq_role<true>{});
    } else {
        steps(kvq_role<false>{});
    }

    // ---- merge the block's warps: (max, sum) per row, then the rescaled outputs
    float f0, f1;
    kvq_warp_merge<NWARP>(mw_s, lw_s, warp, g, c, m0, m1, l0, l1, f0, f1);
    const int r0 = 2 * c, r1 = 2 * c + 1;
    // the warps add their outputs into red_s [R, DO] in turn (one row's worth of shared memory per query row)
    for (int w = 0; w < NWARP; ++w) {
        if (warp == w) {
            auto put = [&](const int r, const int j, const float x) {
                if (r < R) red_s[r * DO + j] = (w == 0 ? 0.0f : red_s[r * DO + j]) + x;
            };
#pragma unroll
            for (int i = 0; i < MT1; ++i) {
                const int j = g * SV1 + 2 * i;
                put(r0, j, acca[i][0] * f0);
                put(r0, j + 1, acca[i][2] * f0);
                put(r1, j, acca[i][1] * f1);
                put(r1, j + 1, acca[i][3] * f1);
            }
#pragma unroll
            for (int i = 0; i < (VBX ? MTB : 0); ++i) {
                const int j = VA_DIM + g * SVB + 2 * i;
                put(r0, j, accb[i][0] * f0);
                put(r0, j + 1, accb[i][2] * f0);
                put(r1, j, accb[i][1] * f1);
                put(r1, j + 1, accb[i][3] * f1);
            }
            // uncompressed blocks leave the coordinates past value stream A's at 0
            if (DENSE && DO > D && w == 0) {
                for (int o = lane; o < R * (DO - D); o += 32) {
                    const int r = o / (DO - D);
                    red_s[r * DO + D + (o - r * (DO - D))] = 0.0f;
                }
            }
        }
        KVQ_BARRIER();
    }
    const int64_t obase = ((int64_t)bh * NS + split) * R;
    for (int o = tid; o < R * DO; o += THREADS) out[obase * DO + o] = red_s[o];
    if (tid < R) {
        float top = -KVQ_INF;
#pragma unroll
        for (int w = 0; w < NWARP; ++w) top = KVQ_FMAX(top, mw_s[w * 8 + tid]);
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARP; ++w) {
            const float mw = mw_s[w * 8 + tid];
            sum += mw == -KVQ_INF ? 0.0f : lw_s[w * 8 + tid] * kvq_exp2(mw - top);
        }
        ml[obase * 2 + 2 * tid] = top == -KVQ_INF ? -KVQ_INF : top * LN2;
        ml[obase * 2 + 2 * tid + 1] = sum;
    }
    };
    if constexpr (ND > 0) {
        if (split >= nsplit) {
            run(kvq_role<true>{});
        } else {
            run(kvq_role<false>{});
        }
    } else {
        run(kvq_role<false>{});
    }
