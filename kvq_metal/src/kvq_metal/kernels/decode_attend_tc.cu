// decode_attend_tc: decode attention over compressed keys and values on tensor cores (CUDA, mma.sync m16n8k16,
// sm_80 and later), with the cache's uncompressed sinks and window (ND = 2) and the split merge in the same launch.
// Same contract as decode_attend.kvq; the design and measurements: kvq_metal.attend_tc's docstring.
// Reference: kvq_metal.reference.decode_attend
// Launcher: kvq_metal.attend.decode_attend
// Inputs kvq_metal.attend.TC_INPUTS (lens: int32 [B, 2] per-row token counts, read with RAGGED only); outputs
// part, ml (per block of a row), fout [B, H_q, T_q, DV] in its own dtype,
// lse [B, H_q, T_q], cnt [B * H] (zeroed: the split counters of the next launch, kvq_metal.attend.DecodeStep).
// Template: kvq_metal.attend._tc_template. Header: decode_attend_tc.cuh.
// Blocks: x = b * H + h; with ND = 2, y = 0: the sinks (wk/wv's dtype, sk/sv, none unless SINKS), y = 1: the window
// (wk/wv), read as they are (slots nsplit, nsplit + 1 of the partial results); y >= ND: split y - ND of the
// compressed tokens (slot y - ND), nsplit = gridDim.y - ND splits.
// Threads: THREADS per block; each warp takes NT tiles of 16 tokens per step (1 for uncompressed tokens).
// Scores: keys are the A operand (lane: 2 tokens g, g + 8, coordinates c * SK ...), the R <= 8 query rows the
// B operand. Values: V^T is the A operand (lane: 4 tokens, coordinates g * SV ...), the probabilities the B operand.

    constexpr int NWARP = THREADS / 32;
    constexpr int TILE = NWARP * 16 * NT;     // tokens of one block step (a split is whole tiles)
    constexpr int SK = D / 4;                 // key coordinates per thread slice (of 2 tokens)
    constexpr int SV = D / 8;                 // value coordinates per thread slice (of 4 tokens)
    constexpr int KS = D / 16;                // score k-steps == value m-tiles
    constexpr int CBK = KB + KB2;
    constexpr int CBV = VB + VB2;
    constexpr bool KPAIR = PAIRTAB && 2 * CBK <= 8;
    constexpr bool VPAIR = PAIRTAB && 2 * CBV <= 8;
    constexpr int KTAB = KPAIR ? (1 << (2 * CBK)) : (1 << CBK);
    constexpr int VTAB = VPAIR ? (1 << (2 * CBV)) : (1 << CBV);
    // KREP/VREP: one copy of the table per lane (word e * 32 + lane): every lookup is free of bank conflicts.
    // VSAME: values read the keys' table (the same codebook; then VREP == KREP)
    // KLIN/VLIN: 4-bit integer levels (affine codes) decoded arithmetically (kvq_lin4), no table
    constexpr int KTW = KLIN ? 0 : KTAB * (KREP ? 32 : 1);
    constexpr int VTW = VSAME || VLIN ? 0 : VTAB * (VREP ? 32 : 1);
    constexpr uint KMASK = (1u << KB) - 1u;
    constexpr uint VMASK = (1u << VB) - 1u;
    constexpr uint KMASK2 = (1u << KB2) - 1u;
    constexpr uint VMASK2 = (1u << VB2) - 1u;
    // a slice starts on a word boundary for every thread when its bit length is a multiple of 32
    constexpr bool KAL = (SK * KB) % 32 == 0 && (SK * KB2) % 32 == 0;
    constexpr bool VAL = (SV * VB) % 32 == 0 && (SV * VB2) % 32 == 0;
    // words a thread's slice of S bits spans (kvq_slice_words: its bit offsets are multiples of gcd(S, 32))
    constexpr int KNW = kvq_slice_words(SK * KB);
    constexpr int VNW = kvq_slice_words(SV * VB);
    constexpr int KNW2 = KB2 > 0 ? kvq_slice_words(SK * KB2) : 1;
    constexpr int VNW2 = VB2 > 0 ? kvq_slice_words(SV * VB2) : 1;
    // words per vector load of a slice (slices start on a word when aligned; uint4 / uint2 / uint)
    constexpr int KVEC = !KAL ? 1 : (KNW % 4 == 0 ? 4 : (KNW % 2 == 0 ? 2 : 1));
    constexpr int VVEC = !VAL ? 1 : (VNW % 4 == 0 ? 4 : (VNW % 2 == 0 ? 2 : 1));
    constexpr int KVEC2 = !KAL || KB2 == 0 ? 1 : (KNW2 % 4 == 0 ? 4 : (KNW2 % 2 == 0 ? 2 : 1));
    constexpr int VVEC2 = !VAL || VB2 == 0 ? 1 : (VNW2 % 4 == 0 ? 4 : (VNW2 % 2 == 0 ? 2 : 1));
    // scale groups per slice (one when the slice lies inside a group)
    constexpr int KNG = SK >= KG ? SK / KG : 1;
    constexpr int VNG = SV >= VG ? SV / VG : 1;
    constexpr bool KONE = KG == D && !KBIAS;  // one scale per vector: applied to the fp32 scores
    constexpr bool VONE = VG == D && !VBIAS;  // folded into the probabilities
    static_assert(!(KLIN && (KONE || KB != 4 || KB2 != 0 || SK % 8 != 0 || KG % 8 != 0)) &&
                      !(VLIN && (VONE || VB != 4 || VB2 != 0 || SV % 8 != 0 || VG % 8 != 0)) &&
                      !(VSAME && (KLIN || VLIN)),
                  "KLIN/VLIN: 4-bit codes of one stream with group scales and biases, slices and groups of whole "
                  "words");
    constexpr float LOG2E = 1.4426950408889634f;
    constexpr float LN2 = 0.6931471805599453f;

    // the tables during the loop, the warps' partial outputs after it
    constexpr int RED = NWARP * 8 * D;
    constexpr int SMW = KTW + VTW > RED ? KTW + VTW : RED;
    KVQ_SHARED __align__(16) uint smem_s[SMW];  // 16: the 128-bit stores of the table copies
    KVQ_SHARED float q_s[R * D];
    uint* ktab_s = smem_s;
    uint* vtab_s = VSAME ? smem_s : smem_s + KTW;
    // entry e of a table at byte e << KSH (KREP: one copy per lane, 32 words apart; the lane's at byte 4 lane)
    constexpr int KSH = KREP ? 7 : 2;
    constexpr int VSH = VREP ? 7 : 2;
    static_assert(KSH + 2 * CBK <= 32 && VSH + 2 * CBV <= 32, "KVQ_FIELD_AT: a code field and its entry's shift "
                  "fit one word");
    float* red_s = reinterpret_cast<float*>(smem_s);
    KVQ_SHARED float kt0_s[1 << CBK];
    KVQ_SHARED float vt0_s[1 << CBV];
    KVQ_SHARED float mw_s[NWARP * 8];
    KVQ_SHARED float lw_s[NWARP * 8];

    KVQ_SHARED int last_s;
    KVQ_SHARED float rtop_s[8];
    KVQ_SHARED float rtot_s[8];
    // QSH: the query B fragments in shared memory, pre-packed (k-step s of lane l: words 2 (32 s + l), + 1), read
    // with one 64-bit load per k-step instead of held in registers
    KVQ_SHARED __align__(8) uint qh_s[QSH ? 64 * KS : 2];

    // the compressed tokens' splits are whole tiles of TILE tokens (kvq_metal.attend.split_chunk)
    const int bh = KVQ_TG_X;
    const int NS = KVQ_NTG_Y;
    const int nsplit = NS - ND;
    // the block's slot among its row's NS partial results: slots < nsplit are the compressed tokens' splits, slot
    // nsplit + d the uncompressed block d. Blocks start in order of blockIdx.y, so the uncompressed blocks (more
    // bytes per token, fewer tokens) take y < ND and start first instead of trailing in a last wave.
    const int split = ND > 0 ? (KVQ_TG_Y < ND ? nsplit + KVQ_TG_Y : KVQ_TG_Y - ND) : KVQ_TG_Y;
    const int H = kc_shape[1];
    const int T = kc_shape[2];
    const int b = bh / H;
    const int h = bh - b * H;
    const int chunk = ((T + TILE - 1) / TILE + nsplit - 1) / nsplit * TILE;
    const int tid = KVQ_TID;
    const int lane = KVQ_LANE;
    const int warp = KVQ_WARP;
    const int g = lane >> 2;
    const int c = lane & 3;
    constexpr bool ROT_CODES = ROT;
    constexpr int NT_CODES = NT;
    constexpr bool PF_CODES = PF;

    // a block's work, for compressed tokens (DENSE false) or for the uncompressed sinks or window (true)
    auto run = [&](auto role) {
    constexpr bool DENSE = decltype(role)::value;
    // uncompressed tokens are attended unrotated, one 16-token tile per warp step
    constexpr bool ROT = ROT_CODES && !DENSE;
    constexpr int NT = DENSE ? 1 : NT_CODES;
    constexpr bool PF = PF_CODES && !DENSE;
    constexpr int TILE = NWARP * 16 * NT;
    const int dsplit = split - nsplit;  // DENSE: 0 the sinks, 1 the window
    const int t_begin = DENSE ? 0 : split * chunk;
    // RAGGED: row b holds lens[2 b] compressed tokens and lens[2 b + 1] window tokens (a batch of sequences of
    // different lengths in one launch; the splits cover the longest row, a shorter row's later splits are empty)
    const int t_end = DENSE ? (dsplit == 0 ? (SINKS ? sk_shape[2] : 0) : (RAGGED ? lens[2 * b + 1] : wk_shape[2]))
                            : min(RAGGED ? lens[2 * b] : T, t_begin + chunk);

    const int64_t kbase = b * kc_strides[0] + h * kc_strides[1];
    const int64_t kbase2 = b * kc2_strides[0] + h * kc2_strides[1];
    const int64_t ksbase = b * ks_strides[0] + h * ks_strides[1];
    const int64_t kbbase = b * kb_strides[0] + h * kb_strides[1];
    const int64_t vbase = b * vc_strides[0] + h * vc_strides[1];
    const int64_t vbase2 = b * vc2_strides[0] + h * vc2_strides[1];
    const int64_t vsbase = b * vs_strides[0] + h * vs_strides[1];
    const int64_t vbbase = b * vb_strides[0] + h * vb_strides[1];
    // first word and bit shift of this thread's key slice (coordinates c * SK ...) and value slice (g * SV ...)
    const int kbit = c * SK * KB, kbit2 = c * SK * KB2;
    const int vbit = g * SV * VB, vbit2 = g * SV * VB2;
    const int kwl = kc_shape[3], kwl2 = kc2_shape[3], vwl = vc_shape[3], vwl2 = vc2_shape[3];
    const int kg0 = (c * SK) / KG, vg0 = (g * SV) / VG;
    // vector loads where every row of codes is contiguous and aligned to the vector (one check per block)
    const bool kvec = kc_strides[3] == 1 && kc_strides[2] % KVEC == 0 && (reinterpret_cast<size_t>(kc + kbase) & (4 * KVEC - 1)) == 0;
    const bool vvec = vc_strides[3] == 1 && vc_strides[2] % VVEC == 0 && (reinterpret_cast<size_t>(vc + vbase) & (4 * VVEC - 1)) == 0;
    const bool kvec2 = kc2_strides[3] == 1 && kc2_strides[2] % KVEC2 == 0 && (reinterpret_cast<size_t>(kc2 + kbase2) & (4 * KVEC2 - 1)) == 0;
    const bool vvec2 = vc2_strides[3] == 1 && vc2_strides[2] % VVEC2 == 0 && (reinterpret_cast<size_t>(vc2 + vbase2) & (4 * VVEC2 - 1)) == 0;


    // one warp step: NT tiles of 16 tokens; key slices of tokens g, g + 8, value slices of tokens 2c, 2c + 1,
    // 2c + 8, 2c + 9, their scales. With PF the next step's loads are issued before this step's math.
    struct Step {
        uint kw[NT][2][KNW];
        uint kw2[NT][2][KNW2];
        uint vw[NT][4][VNW];
        uint vw2[NT][4][VNW2];
        float ksc[NT][2][KNG], kbi[NT][2][KNG], vsc[NT][4][VNG], vbi[NT][4][VNG];
        float vn[NT][2];
        // DENSE: the slices as half2 pairs (coordinates 2p, 2p + 1): key slices of D / 4, value slices of D / 8
        uint dk[DENSE ? NT : 1][2][DENSE ? SK / 2 : 1];
        uint dv[DENSE ? NT : 1][4][DENSE ? SV / 2 : 1];
    };
    // DENSE: the sinks (sk/sv) or the window (wk/wv); rows of the model's dtype (DDT 0: float16, 1: bfloat16, 2:
    // other) read with 128/64-bit loads where a block's rows are contiguous, aligned and D long (dvec_k / dvec_v),
    // else element by element (zero past the row's length)
    const auto* dkp = dsplit == 0 ? sk : wk;
    const auto* dvp = dsplit == 0 ? sv : wv;
    const int64_t dks2 = dsplit == 0 ? sk_strides[2] : wk_strides[2], dks3 = dsplit == 0 ? sk_strides[3] : wk_strides[3];
    const int64_t dvs2 = dsplit == 0 ? sv_strides[2] : wv_strides[2], dvs3 = dsplit == 0 ? sv_strides[3] : wv_strides[3];
    const int dkl = dsplit == 0 ? sk_shape[3] : wk_shape[3], dvl = dsplit == 0 ? sv_shape[3] : wv_shape[3];
    const int64_t dkb = dsplit == 0 ? b * sk_strides[0] + h * sk_strides[1] : b * wk_strides[0] + h * wk_strides[1];
    const int64_t dvb = dsplit == 0 ? b * sv_strides[0] + h * sv_strides[1] : b * wv_strides[0] + h * wv_strides[1];
    constexpr int DKW = SK / 2, DVW = SV / 2;  // half2 words per key / value slice
    constexpr int DKV = DKW % 4 == 0 ? 4 : (DKW % 2 == 0 ? 2 : 1);
    constexpr int DVV = DVW % 4 == 0 ? 4 : (DVW % 2 == 0 ? 2 : 1);
    const bool dvec_k = DENSE && DDT < 2 && dks3 == 1 && dkl == D && dks2 % (2 * DKV) == 0 &&
                        (reinterpret_cast<size_t>(dkp + dkb) & (4 * DKV - 1)) == 0;
    const bool dvec_v = DENSE && DDT < 2 && dvs3 == 1 && dvl == D && dvs2 % (2 * DVV) == 0 &&
                        (reinterpret_cast<size_t>(dvp + dvb) & (4 * DVV - 1)) == 0;
    auto load = [&](Step& buf, const int t0, auto vt) {
      // VECS: every row of codes read with vector loads and every offset within a (batch, KV head) row in 32 bits,
      // known at compile time; at: element (token t, column j) of an array of strides s (kvq_offset)
      constexpr bool VECS = decltype(vt)::value;
      auto at = [&](const int64_t base, const int t, const int j, const auto& s) {
        return kvq_offset_at<VECS, FLAT32>(base, t, s[2], j, s[3]);
      };
      if constexpr (DENSE) {
        // tokens past the end read the last row (the sinks' block without sinks: row 0 of the window, never used)
#pragma unroll
        for (int st = 0; st < NT; ++st) {
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int t = max(min(t0 + st * 16 + g + 8 * u, t_end - 1), 0);
                kvq_dense_row<DKV, DDT>(buf.dk[st][u], dkp + dkb + (int64_t)t * dks2, c * SK, dvec_k, dks3, dkl);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int t = max(min(t0 + st * 16 + 2 * c + (u & 1) + 8 * (u >> 1), t_end - 1), 0);
                kvq_dense_row<DVV, DDT>(buf.dv[st][u], dvp + dvb + (int64_t)t * dvs2, g * SV, dvec_v, dvs3, dvl);
            }
        }
      } else {
        // past the end of the codes a token index is clamped: its words are read from a valid token and its
        // score is masked to -inf below, so no load needs a branch
#pragma unroll
        for (int st = 0; st < NT; ++st) {
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int t = min(t0 + st * 16 + g + 8 * u, T - 1);
                KVQ_LOAD_CODES(K, k)
#pragma unroll
                for (int k = 0; k < KNG; ++k) {
                    buf.ksc[st][u][k] = KVQ_F32(ks[at(ksbase, t, KONE ? 0 : kg0 + k, ks_strides)]);
                    buf.kbi[st][u][k] = KBIAS ? KVQ_F32(kb[at(kbbase, t, kg0 + k, kb_strides)]) : 0.0f;
                }
                buf.vn[st][u] = VONE ? KVQ_F32(vs[at(vsbase, t, 0, vs_strides)]) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int t = min(t0 + st * 16 + 2 * c + (u & 1) + 8 * (u >> 1), T - 1);
                KVQ_LOAD_CODES(V, v)
#pragma unroll
                for (int k = 0; k < VNG; ++k) {
                    buf.vsc[st][u][k] = VONE ? 0.0f : KVQ_F32(vs[at(vsbase, t, vg0 + k, vs_strides)]);
                    buf.vbi[st][u][k] = VBIAS ? KVQ_F32(vb[at(vbbase, t, vg0 + k, vb_strides)]) : 0.0f;
                }
            }
        }
      }
    };
    // the first step's codes are requested before the tables and queries are prepared (their latency overlaps)
    Step buf;
    Step nxt;
    load(buf, t_begin + warp * 16 * NT, kvq_role<false>{});

    // the code tables: their few values are read from global memory once per block (kt0_s / vt0_s), then
    // pair tables: entry ((p1 << 2 * B2) | p2) = (value of code a, value of code b) for the pair's two codes;
    // single tables: entry c = (value of c, value of c); KREP / VREP: 32 copies
    for (int i = tid; i < (DENSE ? 0 : 1 << CBK); i += THREADS) kt0_s[i] = kt[i];
    for (int i = tid; i < (VSAME || DENSE ? 0 : 1 << CBV); i += THREADS) vt0_s[i] = vt[i];
    KVQ_BARRIER();
    KVQ_FILL_TABLE(K, k)
    KVQ_FILL_TABLE(V, v)
    // the tables' shared-space addresses (kvq_table_base) and the byte offset of this lane's copy
    const uint ktab_a = KLIN ? 0u : kvq_table_base(ktab_s), vtab_a = VLIN ? 0u : kvq_table_base(vtab_s);
    const uint klo = KREP ? 4 * lane : 0, vlo = VREP ? 4 * lane : 0;
    // queries: scale, (randomized Hadamard rotation), into shared memory
#include "load_queries.kvq"
    if constexpr (ROT) {
        KVQ_BARRIER();
        kvq_fwht_rows_warp<D, R, NWARP>(q_s, warp, lane);
    }
    KVQ_BARRIER();
    // query B fragments: k-step s holds pairs 2 s (b0) and 2 s + 1 (b1) of the slice at c * SK of row g, at their
    // coordinates (kvq_pair_first, kvq_pair_gap: KPERM in kvq_lin4's order, for KLIN codes; the uncompressed
    // blocks' pairs are adjacent)
    const float qmul = ROT ? 1.0f / KVQ_SQRT((float)D) : 1.0f;
    uint qf[QSH ? 1 : KS][2];
    // the fragment of k-step s, half e, for lane (gq, cq)
    constexpr bool KPERM = KLIN && !DENSE;
    constexpr bool VPERM = VLIN && !DENSE;
    auto qfrag = [&](const int s, const int e, const int gq, const int cq) -> uint {
        const int j = cq * SK + kvq_pair_first<KPERM>(2 * s + e);
        const int j1 = j + kvq_pair_gap<KPERM>();
        return gq < R ? kvq_h2(q_s[gq * D + j] * qmul, q_s[gq * D + j1] * qmul) : 0u;
    };
    if constexpr (QSH) {
        for (int i = tid; i < 64 * KS; i += THREADS) {
            const int ln = (i >> 1) & 31;
            qh_s[i] = qfrag(i >> 6, i & 1, ln >> 2, ln & 3);
        }
        KVQ_BARRIER();
    } else {
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            qf[s][0] = qfrag(s, 0, g, c);
            qf[s][1] = qfrag(s, 1, g, c);
        }
    }
    const uint2* qh_l = reinterpret_cast<const uint2*>(qh_s) + lane;  // the lane's fragments, 32 uint2 apart

    float acc[KS][4];
#pragma unroll
    for (int i = 0; i < KS; ++i) { acc[i][0] = 0.0f; acc[i][1] = 0.0f; acc[i][2] = 0.0f; acc[i][3] = 0.0f; }
    float m0 = -KVQ_INF, m1 = -KVQ_INF, l0 = 0.0f, l1 = 0.0f;

    // offsets within this block's (batch, KV head) row (FLAT32: from each array's start to the end of the row) fit
    // 32 bits in every array the loads read (kvq_fits32 of its tokens and columns; the base and the column stride of
    // no sign too)
    auto fits = [&](const auto& sh, const auto& st, const int64_t base) {
        const int64_t from = FLAT32 ? base : 0;
        return st[3] >= 0 && from >= 0 && kvq_fits32(sh[2], st[2], from + (int64_t)(sh[3] - 1) * st[3]);
    };
    const bool off32 = fits(kc_shape, kc_strides, kbase) && fits(kc2_shape, kc2_strides, kbase2) &&
                       fits(vc_shape, vc_strides, vbase) && fits(vc2_shape, vc2_strides, vbase2) &&
                       fits(ks_shape, ks_strides, ksbase) && fits(kb_shape, kb_strides, kbbase) &&
                       fits(vs_shape, vs_strides, vsbase) && fits(vb_shape, vb_strides, vbbase);
    // the warp's steps, with vt: the rows of codes are read with vector loads and offsets within a row of the batch
    // and KV heads are 32-bit (their checks made once per block: with the check inside the loop, the compiler
    // predicated the word-by-word path in beside the vector one and the loop issued both: 32 more loads per warp
    // step of turboquant-4 and affine-4 at head_dim 128)
    auto steps = [&](auto vt) {
    for (int t0 = t_begin + warp * 16 * NT; t0 < t_end; t0 += TILE) {
        if (PF) load(nxt, t0 + TILE, vt);
        // ---- scores on tensor cores
        float sc[NT][4];
#pragma unroll
        for (int st = 0; st < NT; ++st) {
            uint ku[2][KNW], ku2[2][KNW2];
            uint kh[2][KNG], kbh[2][KNG];
#pragma unroll
            for (int u = 0; u < 2 && !DENSE; ++u) {
                KVQ_SLICE_WORDS(K, k)
            }
            float d4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int s = 0; s < KS; ++s) {
                uint a[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int u = e & 1;            // a0/a2: token g, a1/a3: token g + 8
                    const int p = 2 * s + (e >> 1); // pair of the slice
                    uint x;
                    KVQ_DECODE_PAIR(K, k, p)
                    a[e] = x;
                }
                if constexpr (QSH) {
                    const uint2 qv = qh_l[32 * s];
                    kvq_mma(d4, a[0], a[1], a[2], a[3], qv.x, qv.y);
                } else {
                    kvq_mma(d4, a[0], a[1], a[2], a[3], qf[s][0], qf[s][1]);
                }
            }
            // d4: (token g, rows 2c, 2c + 1), (token g + 8, rows 2c, 2c + 1)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int u = e >> 1;
                const bool ok = t0 + st * 16 + g + 8 * u < t_end;
                const float mul = KONE && !DENSE ? buf.ksc[st][u][0] * LOG2E : LOG2E;
                sc[st][e] = ok ? d4[e] * mul : -KVQ_INF;
            }
        }
        // ---- online softmax of rows 2c, 2c + 1 (a row's 16 NT scores live in the 8 lanes of equal c)
        float z0, z1, al0, al1;
        if (kvq_softmax_step<SLACK>(sc, m0, m1, l0, l1, z0, z1, al0, al1)) kvq_rescale<KS>(acc, al0, al1);
        // ---- values on tensor cores
#pragma unroll
        for (int st = 0; st < NT; ++st) {
            float p[4];
            kvq_probs(sc[st], z0, z1, l0, l1, p);
            const float w0 = VONE && !DENSE ? buf.vn[st][0] : 1.0f, w1 = VONE && !DENSE ? buf.vn[st][1] : 1.0f;
            uint pb0, pb1;
            kvq_pfrag(p, w0, w1, pb0, pb1);
            uint vu[4][VNW], vu2[4][VNW2];
            uint vh[4][VNG], vbh[4][VNG];
#pragma unroll
            for (int u = 0; u < 4 && !DENSE; ++u) {
                KVQ_SLICE_WORDS(V, v)
            }
#pragma unroll
            for (int i = 0; i < KS; ++i) {
                uint xv[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    uint x;
                    KVQ_DECODE_PAIR(V, v, i)
                    xv[u] = x;
                }
                // A = V^T: rows (the coordinates of pair i of the slice at g SV: kvq_pair_first<VPERM>), columns (tokens 2c, 2c + 1 | 2c + 8, 2c + 9)
                kvq_mma_vt(acc[i], xv, pb0, pb1);
            }
        }
        if (PF) {
            buf = nxt;
        } else {
            load(buf, t0 + TILE, vt);
        }
    }
    };
    // (not for 4-bit integer levels at head_dim 256: there nvcc's two loops spilled 148 bytes of registers;
    // turboquant-4 at head_dim 256 spills 20 bytes outside its loops and keeps both)
    if constexpr (DENSE || (D > 128 && (KLIN || VLIN))) {
        steps(kvq_role<false>{});
    } else if (kvec && vvec && (KB2 == 0 || kvec2) && (VB2 == 0 || vvec2) && off32) {
        steps(kvq_role<true>{});
    } else {
        steps(kvq_role<false>{});
    }

    // ---- merge the block's warps: (max, sum) per row, then the rescaled outputs
    float f0, f1;
    kvq_warp_merge<NWARP>(mw_s, lw_s, warp, g, c, m0, m1, l0, l1, f0, f1);
#pragma unroll
    for (int i = 0; i < KS; ++i) {
        // m-tile i: the coordinates of pair i of the lane's value slice
        const int j = g * SV + kvq_pair_first<VPERM>(i);
        const int j1 = j + kvq_pair_gap<VPERM>();
        red_s[(warp * 8 + 2 * c) * D + j] = acc[i][0] * f0;
        red_s[(warp * 8 + 2 * c + 1) * D + j] = acc[i][1] * f1;
        red_s[(warp * 8 + 2 * c) * D + j1] = acc[i][2] * f0;
        red_s[(warp * 8 + 2 * c + 1) * D + j1] = acc[i][3] * f1;
    }
    KVQ_BARRIER();
    const int64_t obase = ((int64_t)bh * NS + split) * R;
    for (int o = tid; o < R * D; o += THREADS) {
        const int r = o / D;
        const int j = o - r * D;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARP; ++w) s += red_s[(w * 8 + r) * D + j];
        part[obase * D + o] = s;
    }
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
    // the split counters of the next launch (kvq_metal.attend.DecodeStep passes them on), zeroed
    if (split == 0 && tid == 0) cnt[bh] = 0;

    // ---- merge: the block that finishes a (batch, KV head) last merges its splits (flash-decoding's log-sum-exp
    // combine, in the same launch), undoes the rotation of the compressed splits, adds the ND uncompressed ones and
    // writes the output
    {
        kvq_fence_acq_rel();
        KVQ_BARRIER();
        if (tid == 0) last_s = atomicAdd(const_cast<int*>(counter) + bh, 1) == NS - 1;
        KVQ_BARRIER();
        if (last_s) {
            kvq_fence_acq_rel();
            const int WS = NS;
            float* w_s = red_s;  // [R][WS] split weights: the tables' memory is free again
            // each row's (max, sum) of all NS slots (the compressed splits, then the ND uncompressed blocks), read
            // once as pairs by one warp: the max over the warp, then the weights and the weighted sum
            for (int r = warp; r < R; r += NWARP) {
                const float2* mlr = reinterpret_cast<const float2*>(ml) + (int64_t)bh * NS * R + r;
                float top = -KVQ_INF;
                float2 first = make_float2(-KVQ_INF, 0.0f);  // the lane's first slot, kept for the second pass
                for (int s2 = lane; s2 < NS; s2 += 32) {
                    const float2 x = __ldcg(mlr + (int64_t)s2 * R);
                    if (s2 == lane) first = x;
                    top = KVQ_FMAX(top, x.x);
                }
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) top = KVQ_FMAX(top, KVQ_SHFL_XOR(top, off));
                float tot = 0.0f;
                for (int s2 = lane; s2 < NS; s2 += 32) {
                    const float2 x = s2 == lane ? first : __ldcg(mlr + (int64_t)s2 * R);
                    const float w = x.x == -KVQ_INF ? 0.0f : KVQ_EXP(x.x - top);
                    w_s[r * WS + s2] = w;
                    tot += w * x.y;
                }
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) tot += KVQ_SHFL_XOR(tot, off);
                if (lane == 0) { rtop_s[r] = top; rtot_s[r] = tot; }
            }
            KVQ_BARRIER();
            // weighted sum of the compressed splits' outputs (read from L2: other blocks wrote them), four
            // coordinates per thread with 128-bit loads and four independent sums (about nsplit / 8 round trips to
            // L2 instead of nsplit / 2 per coordinate), into q_s
            constexpr int D4 = D / 4;
            for (int o4 = tid; o4 < R * D4; o4 += THREADS) {
                const int r = o4 / D4;
                const int j = (o4 - r * D4) * 4;
                const float4* ps = reinterpret_cast<const float4*>(part + ((int64_t)bh * NS * R + r) * D + j);
                const int64_t step = R * D4;  // float4s from one split to the next
                float4 a[4];
#pragma unroll
                for (int k = 0; k < 4; ++k) a[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                int s2 = 0;
#pragma unroll 2
                for (; s2 + 4 <= nsplit; s2 += 4) {
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const float w = w_s[r * WS + s2 + k];
                        const float4 x = __ldcg(ps + (int64_t)(s2 + k) * step);
                        a[k].x += w * x.x; a[k].y += w * x.y; a[k].z += w * x.z; a[k].w += w * x.w;
                    }
                }
                for (; s2 < nsplit; ++s2) {
                    const float w = w_s[r * WS + s2];
                    const float4 x = __ldcg(ps + (int64_t)s2 * step);
                    a[0].x += w * x.x; a[0].y += w * x.y; a[0].z += w * x.z; a[0].w += w * x.w;
                }
                float* qo = q_s + r * D + j;
                qo[0] = (a[0].x + a[1].x) + (a[2].x + a[3].x);
                qo[1] = (a[0].y + a[1].y) + (a[2].y + a[3].y);
                qo[2] = (a[0].z + a[1].z) + (a[2].z + a[3].z);
                qo[3] = (a[0].w + a[1].w) + (a[2].w + a[3].w);
            }
            if constexpr (ROT) {
                KVQ_BARRIER();
                kvq_fwht_rows_warp<D, R, NWARP>(q_s, warp, lane);
            }
            KVQ_BARRIER();
            const float rs = ROT ? 1.0f / KVQ_SQRT((float)D) : 1.0f;
            for (int o = tid; o < R * D; o += THREADS) {
                const int r = o / D;
                const int j = o - r * D;
                float v = ROT ? q_s[o] * signs[j] * rs : q_s[o];
#pragma unroll
                for (int d = 0; d < ND; ++d) v += w_s[r * WS + nsplit + d] * __ldcg(part + (((int64_t)bh * NS + nsplit + d) * R + r) * D + j);
                if (j < DV) kvq_store(fout + ((int64_t)bh * R + r) * DV + j, v / rtot_s[r]);
            }
            if (tid < R) lse[bh * R + tid] = rtop_s[tid] + KVQ_LOG(rtot_s[tid]);
        }
    }
