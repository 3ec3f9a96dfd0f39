// prefill_attend_tc: the attention of a prefill chunk's query rows over float16 or bfloat16 keys and values, each row
// seeing the columns of its own intervals (computed here: no mask array), with FlashAttention-2's forward pass (Dao
// 2023) on tensor cores (CUDA, mma.sync m16n8k16, fp32 accumulators, sm_80 and later). Design: kvq_metal.prefill.
// Reference: kvq_metal.prefill.reference_attend
// Launcher: kvq_metal.prefill.prefill_attend
// Inputs: q [B, H_q, T_q, D], k [B, H_kv, N, D], v [B, H_kv, N, D] (one 16-bit dtype, row-contiguous), iv int32
// [T_q, P, 2] (row r sees column c iff iv[r, p, 0] <= c < iv[r, p, 1] for some p), sink [H_q] (learned sink
// logits, read with SINK only). Outputs: out [B, H_q, T_q, D] in q's dtype, lse float32 [B, H_q, T_q] (natural
// log of the normaliser out was divided by, the sink logit included; a row that sees nothing: out 0, lse -inf or
// its sink logit).
// Template: kvq_metal.prefill.launch_plan (D, DV, BC, BR, P, SINK, BF16, SCALE: the softmax scale's float bits,
// THREADS, MINB: the blocks per SM its registers must fit, 0 for no bound, WG: the products on sm_90a's warpgroup
// wgmma instead of mma.sync).
// Blocks: y = b * H_kv + KV head; x a tile of BR of the group's rep * T_q rows (row m: query row m / rep of query
// head KV head * rep + m % rep), the last tile first (it sees the most columns, so it should not start last);
// z the slice of DV value coordinates the block writes (D / DV slices: at head_dim 256 two blocks of 128 each
// compute the same scores, so that the output accumulators fit the registers).
// Threads: BR / 16 warps, warp w the rows 16 w .. 16 w + 15 (a lane: rows g, g + 8, g = lane / 4, columns 2c, 2c + 1
// of each 8, c = lane % 4); the query fragments are held in registers. The block steps over the tiles of BC columns
// that some row of it sees; each tile's K and V rows are copied to shared memory by cp.async (V's copy overlaps the
// scores, the next K tile's the values' product), 16-byte chunk j of row i at chunk j ^ (i & 7), so the 8 rows an
// ldmatrix reads hit 8 bank groups.
// WG (sm_90a, BC 64, 4 warps per warpgroup): each warpgroup's 64 rows take S = Q K^T and O += P V as wgmma
// m64n64k16 (A, the query and probability fragments, from registers; B, the K and V tiles, read by the tensor
// cores from shared memory through matrix descriptors), and the tiles are stored as wgmma's 128-byte-swizzled
// atoms: 64-column slices of 128-byte rows, chunk j of row i of slice s at 8 (BC s + i) + (j ^ (i & 7)) (for
// D = 64 the same place as without WG). A warpgroup runs its products whole (no per-warp skip).
// PIPE (with WG; FlashAttention-3's intra-warpgroup overlap, Shah et al. 2024): K and V tiles in two stages each, in
// dynamic shared memory (4 BC D 2 bytes + 1024 for the alignment: kvq_metal.prefill.launch_plan), and one tile's
// scores' product issued together with the previous tile's values' product, the softmax of the one running while
// the tensor cores do the other; the next K tile and this tile's V tile are copied meanwhile.

    constexpr int NWARP = BR / 16;  // THREADS (the template's) = 32 NWARP
    constexpr int CH = D / 8;    // 16-byte chunks per key row (D 16-bit elements)
    constexpr int CHV = DV / 8;  // per value row slice (the block's DV of the D value coordinates)
    constexpr int KS = D / 16;   // k-steps of the scores' product
    constexpr int NS = BC / 8;   // n-tiles of a warp's scores (16 rows x BC columns)
    constexpr int NO = DV / 8;   // n-tiles of a warp's output (16 rows x DV)
    constexpr int BIG = 0x7fffffff;
    constexpr float LOG2E = 1.4426950408889634f;
    constexpr float LN2 = 0.6931471805599453f;
    static_assert(BR % 16 == 0 && BC % 16 == 0 && DV % 16 == 0 && D % DV == 0 && CHV >= 8,
                  "whole mma tiles, at least 8 chunks a row");
    static_assert(THREADS == 32 * NWARP, "one warp per 16 rows");
    static_assert(!WG || (BC == 64 && DV % 64 == 0 && D % 64 == 0 && NWARP % 4 == 0),
                  "wgmma: tiles of 64 columns, 64-coordinate slices, whole warpgroups");
    static_assert(!PIPE || WG, "the pipelined schedule is the wgmma form's");
    constexpr int ALIGN = WG && !PIPE ? 1024 : 16;  // wgmma's swizzle atoms start on 1024 bytes

    // the K tile and the V tile (the block's slice of coordinates); with PIPE two stages of each, in dynamic
    // shared memory
    KVQ_SHARED __align__(ALIGN) uint4 k_s[PIPE ? 1 : BC * CH];
    KVQ_SHARED __align__(ALIGN) uint4 v_s[PIPE ? 1 : BC * CHV];
    KVQ_SHARED int2 iv_s[BR][P];                   // the block's rows' intervals, clamped to [0, N)
    KVQ_SHARED int span_s[2][P];                   // their union per interval slot: (min lo, max hi)

    const int tid = KVQ_TID;
    const int lane = KVQ_LANE;
    const int warp = KVQ_WARP;
    const int g = lane >> 2, c = lane & 3;
    const int Hq = q_shape[1], Tq = q_shape[2];
    const int Hkv = k_shape[1], N = k_shape[2];
    const int rep = Hq / Hkv;
    const int rows = rep * Tq;
    const int bk = KVQ_TG_Y;
    const int b = bk / Hkv, kvh = bk - b * Hkv;
    const int m0 = ((int)gridDim.x - 1 - (int)KVQ_TG_X) * BR;
    const int zv = KVQ_TG_Z;  // the block's slice of value coordinates: zv * DV ...
    const uint4* const kg = reinterpret_cast<const uint4*>(k) + (int64_t)bk * N * CH;
    const uint4* const vg = reinterpret_cast<const uint4*>(v) + (int64_t)bk * N * CH + zv * CHV;

    // the block's rows' intervals; a row past the group's end sees nothing (and is not written)
    for (int i = tid; i < BR * P; i += THREADS) {
        const int row = i / P, p = i - row * P;
        const int m = m0 + row;
        const int r = m / rep;
        iv_s[row][p] = m < rows ? make_int2(max(iv[(r * P + p) * 2], 0), min(iv[(r * P + p) * 2 + 1], N))
                                : make_int2(0, 0);
    }
    // this thread's rows: u = 0: 16 warp + g, u = 1: 16 warp + g + 8
    bool valid[2];
#pragma unroll
    for (int u = 0; u < 2; ++u) valid[u] = m0 + 16 * warp + g + 8 * u < rows;

    // the A fragments of the scores' product (k-step s: rows 16 warp + g, + 8, coordinates 16 s + 2c, + 1, + 8,
    // + 9), read from global memory once and held in registers for the whole loop (zero for a row past the end)
    uint qf[KS][4];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int m = m0 + 16 * warp + g + 8 * u;
        const int r = valid[u] ? m / rep : 0;
        const int h = kvh * rep + (valid[u] ? m - r * rep : 0);
        const uint* const qrow = reinterpret_cast<const uint*>(q + (((int64_t)b * Hq + h) * Tq + r) * D);
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            qf[s][u] = valid[u] ? qrow[8 * s + c] : 0u;
            qf[s][u + 2] = valid[u] ? qrow[8 * s + 4 + c] : 0u;
        }
    }
    KVQ_BARRIER();  // iv_s is written
    // the union of the block's non-empty intervals per slot, by the first warp (each lane BR / 32 rows)
    if (warp == 0) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
            int a = BIG, z = 0;
            for (int row = lane; row < BR; row += 32) {
                const int2 x = iv_s[row][p];
                if (x.x < x.y) { a = min(a, x.x); z = max(z, x.y); }
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                a = min(a, KVQ_SHFL_XOR(a, off));
                z = max(z, KVQ_SHFL_XOR(z, off));
            }
            if (lane == 0) { span_s[0][p] = a; span_s[1][p] = z; }
        }
    }
    KVQ_BARRIER();  // span_s is written

    // the first tile at or after column c0 (a multiple of BC) that a row of the block sees, BIG if none: tiles
    // between the intervals' unions (between a layer's sinks, compressed prefix and causal band) are never read
    auto advance = [&](const int c0) -> int {
        int t = BIG;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int a = span_s[0][p], z = span_s[1][p];
            if (a < z && z > c0) t = min(t, max(c0, a / BC * BC));
        }
        return t;
    };
    // where chunk j of tile row i sits in a tile of W chunks a row: swizzled within the row (mma.sync's ldmatrix),
    // or in wgmma's atoms of 64-column slices (the header's description)
    auto at = [&](const int W, const int i, const int j) -> int {
        return WG ? ((j >> 3) * BC + i) * 8 + ((j & 7) ^ (i & 7)) : i * W + (j ^ (i & 7));
    };
    // rows c0 .. c0 + BC - 1 of a KV head's keys (W = CH chunks) or values (W = CHV) into a tile; rows past N are
    // zeros (their scores are masked, and a zero value times a zero probability stays zero)
    auto load_tile = [&](auto width, uint4* dst, const uint4* src, const int c0) {
        constexpr int W = decltype(width)::value;
#pragma unroll
        for (int i = tid; i < BC * W; i += THREADS) {
            const int row = i / W, j = i - row * W;
            const bool ok = c0 + row < N;
            kvq_pf_cp16(dst + at(W, row, j), src + (int64_t)(ok ? c0 + row : 0) * CH + j, ok);
        }
        kvq_pf_cp_commit();
    };
    // the copies this thread waited for made visible to wgmma's reads (the async proxy) before the barrier
    auto publish = [&]() {
        if constexpr (WG) kvq_fence_proxy_async();
    };
    using KW = kvq_pf_int<CH>;
    using VW = kvq_pf_int<CHV>;

    float acc[NO][4];
#pragma unroll
    for (int i = 0; i < NO; ++i) { acc[i][0] = 0.0f; acc[i][1] = 0.0f; acc[i][2] = 0.0f; acc[i][3] = 0.0f; }
    float mrow[2] = {-KVQ_INF, -KVQ_INF};  // the rows' running max of the scores, log2 units
    float lrow[2] = {0.0f, 0.0f};          // this lane's part of the rows' sums (its 2 columns of each 8)
    const float qk = KVQ_AS_FLOAT(SCALE) * LOG2E;

    // which columns of tile c0 each of this thread's rows sees (bit x: column c0 + x); returns whether every row
    // of the warp sees all of them (then no score is masked)
    auto seen = [&](const int c0, kvq_u64 (&vis)[2]) -> bool {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            vis[u] = 0;
#pragma unroll
            for (int p = 0; p < P; ++p) {
                const int2 x = iv_s[16 * warp + g + 8 * u][p];
                vis[u] |= kvq_pf_low_bits(min(max(x.y - c0, 0), BC)) & ~kvq_pf_low_bits(min(max(x.x - c0, 0), BC));
            }
        }
        const kvq_u64 whole = kvq_pf_low_bits(BC);
        return __all_sync(0xffffffffu, (vis[0] == whole || !valid[0]) && (vis[1] == whole || !valid[1]));
    };
    // a tile's scores s (this lane's columns 2c, 2c + 1 of each 8) into probabilities: the columns a row does not
    // see set to -inf (unless all are seen), then the online softmax: a row's max over its 4 lanes (of the unscaled
    // scores; qk > 0 keeps the order), in log2 units; z the new max (0 while still -inf, so exp2 stays finite), al
    // the factor that rescales what was accumulated before (the caller's acc); each probability exp2(score * qk - z)
    // is one FFMA and one ex2. Scores stay unscaled until the exponent.
    auto soften = [&](float (&s)[NS][4], const kvq_u64 (&vis)[2], const bool all, float (&al)[2]) {
        if (!all) {
            const uint mine[2][2] = {{(uint)(vis[0] >> (2 * c)), (uint)(vis[0] >> (2 * c + 32))},
                                     {(uint)(vis[1] >> (2 * c)), (uint)(vis[1] >> (2 * c + 32))}};
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int bit = 8 * nt + (e & 1);  // a compile-time shift of one 32-bit half
                    if (!((mine[e >> 1][bit >> 5] >> (bit & 31)) & 1u)) s[nt][e] = -KVQ_INF;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            float top = -KVQ_INF;
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) top = KVQ_FMAX(top, KVQ_FMAX(s[nt][2 * u], s[nt][2 * u + 1]));
            top = KVQ_FMAX(top, KVQ_SHFL_XOR(top, 1));
            top = KVQ_FMAX(top, KVQ_SHFL_XOR(top, 2));
            const float nm = KVQ_FMAX(mrow[u], top * qk);
            const float z = nm == -KVQ_INF ? 0.0f : nm;
            al[u] = kvq_pf_exp2(mrow[u] - z);
            mrow[u] = nm;
            lrow[u] *= al[u];
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) {
                s[nt][2 * u] = kvq_pf_exp2(fmaf(s[nt][2 * u], qk, -z));
                s[nt][2 * u + 1] = kvq_pf_exp2(fmaf(s[nt][2 * u + 1], qk, -z));
                lrow[u] += s[nt][2 * u] + s[nt][2 * u + 1];
            }
        }
    };
    auto rescale = [&](const float (&al)[2]) {
#pragma unroll
        for (int i = 0; i < NO; ++i) { acc[i][0] *= al[0]; acc[i][1] *= al[0]; acc[i][2] *= al[1]; acc[i][3] *= al[1]; }
    };
    // the probabilities as the A fragments of the values' product: k-step kk from n-tiles 2kk, 2kk + 1
    // (FlashAttention-2's register reuse)
    auto pack = [&](const float (&s)[NS][4], uint (&a)[BC / 16][4]) {
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            a[kk][0] = kvq_pf_pack<BF16>(s[2 * kk][0], s[2 * kk][1]);
            a[kk][1] = kvq_pf_pack<BF16>(s[2 * kk][2], s[2 * kk][3]);
            a[kk][2] = kvq_pf_pack<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[kk][3] = kvq_pf_pack<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
    };
    // wgmma: the warpgroup's 64 rows x 64 columns of scores from the K tile at shared address kb (K-major B from
    // slice ks / 4, 32 bytes into its rows per k-step; the stride byte offset steps 8 rows, 1024 bytes), and O += P V
    // from the V tile at vb (N-major B from slice h, 16 rows a k-step, 2048 bytes; its two groups of 8 rows 1024 bytes
    // apart), one m64n64k16 per slice. Issued only: the caller commits and waits.
    auto wg_scores = [&](float (&sd)[32], const uint kb) {
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
            kvq_wg_mma64<BF16, 0>(sd, qf[ks], kvq_wg_desc(kb + (ks >> 2) * BC * 128 + (ks & 3) * 32, 16, 1024), ks > 0);
    };
    auto wg_values = [&](float (&od)[4 * NO], const uint (&a)[BC / 16][4], const uint vb) {
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
#pragma unroll
            for (int h = 0; h < DV / 64; ++h)
                kvq_wg_mma64<BF16, 1>(*reinterpret_cast<float (*)[32]>(&od[32 * h]), a[kk],
                                      kvq_wg_desc(vb + h * BC * 128 + kk * 2048, BC * 128, 1024), 1);
        }
    };

    if constexpr (PIPE) {
        // two stages of K tiles then two of V tiles, from the first 1024-byte boundary of the dynamic shared memory
        extern KVQ_SHARED __align__(16) uint4 kvq_pf_dynamic[];
        uint4* const tiles = kvq_pf_dynamic + (((1024u - (kvq_pf_smem(kvq_pf_dynamic) & 1023u)) & 1023u) >> 4);
        uint4* const vtiles = tiles + 2 * BC * CH;
        const uint kbase = kvq_pf_smem(tiles), vbase = kvq_pf_smem(vtiles);
        constexpr uint KSTAGE = BC * CH * 16, VSTAGE = BC * CHV * 16;  // bytes a stage
        float s[NS][4];
        float (&sd)[32] = reinterpret_cast<float (&)[32]>(s);
        float (&od)[4 * NO] = reinterpret_cast<float (&)[4 * NO]>(acc);
        uint a[BC / 16][4];
        kvq_u64 vis[2];
        float al[2];
        int cur = advance(0);
        if (cur < BIG) {
            // the first tile: its scores alone (nothing to overlap them with)
            load_tile(KW{}, tiles, kg, cur);
            kvq_pf_cp_wait_all();
            publish();
            KVQ_BARRIER();  // K tile 0 landed
            int nxt = advance(cur + BC);
            if (nxt < BIG) load_tile(KW{}, tiles + BC * CH, kg, nxt);
            load_tile(VW{}, vtiles, vg, cur);
            bool all = seen(cur, vis);
            kvq_wg_fence_operand(sd);
            kvq_wg_fence();
            wg_scores(sd, kbase);
            kvq_wg_commit();
            kvq_wg_wait<0>();
            kvq_wg_fence_operand(sd);
            soften(s, vis, all, al);  // acc is still zero: nothing to rescale
            pack(s, a);
            int st = 1;  // the stage of the current tile's K (its V goes to the same stage of the V tiles)
            cur = nxt;
            while (cur < BIG) {
                kvq_pf_cp_wait_all();
                publish();
                KVQ_BARRIER();  // K tile cur (stage st) and the previous V tile (stage st ^ 1) landed; every warp
                                // is done with the previous K tile and the V tile before it
                nxt = advance(cur + BC);
                if (nxt < BIG) load_tile(KW{}, tiles + (st ^ 1) * BC * CH, kg, nxt);
                load_tile(VW{}, vtiles + st * BC * CHV, vg, cur);
                // this tile's scores and the previous tile's values' product, two groups in flight
                kvq_wg_fence_operand(sd);
                kvq_wg_fence_operand(od);
                kvq_wg_fence();
                wg_scores(sd, kbase + st * KSTAGE);
                kvq_wg_commit();
                wg_values(od, a, vbase + (st ^ 1) * VSTAGE);
                kvq_wg_commit();
                all = seen(cur, vis);
                kvq_wg_wait<1>();  // the scores (the older group) are done; the values' product runs on
                kvq_wg_fence_operand(sd);
                soften(s, vis, all, al);
                kvq_wg_wait<0>();
                kvq_wg_fence_operand(od);
                rescale(al);  // what the previous tiles accumulated, to this tile's running max
                pack(s, a);
                st ^= 1;
                cur = nxt;
            }
            // the last tile's values' product
            kvq_pf_cp_wait_all();
            publish();
            KVQ_BARRIER();  // its V tile (stage st ^ 1) landed
            kvq_wg_fence_operand(od);
            kvq_wg_fence();
            wg_values(od, a, vbase + (st ^ 1) * VSTAGE);
            kvq_wg_commit();
            kvq_wg_wait<0>();
            kvq_wg_fence_operand(od);
        }
    }

    int c0 = PIPE ? BIG : advance(0);
    if (c0 < BIG) load_tile(KW{}, k_s, kg, c0);
    while (c0 < BIG) {
        const int cn = advance(c0 + BC);
        kvq_pf_cp_wait_all();
        publish();
        KVQ_BARRIER();  // K tile c0 landed; every warp is done with the previous V tile
        load_tile(VW{}, v_s, vg, c0);
        kvq_u64 vis[2];
        const bool all = seen(c0, vis);
        // whether a row of this warp sees a column (else the warp skips the tile; with WG the same for the whole
        // warpgroup: its wgmma are collective)
        const bool any = WG || __any_sync(0xffffffffu, (vis[0] | vis[1]) != 0);
        float s[NS][4];
        if (any) {
            // ---- scores S = Q K^T (B operand: K rows, two n-tiles per ldmatrix)
#pragma unroll
            for (int nt = 0; nt < NS; ++nt) { s[nt][0] = 0.0f; s[nt][1] = 0.0f; s[nt][2] = 0.0f; s[nt][3] = 0.0f; }
            if constexpr (WG) {
                float (&sd)[32] = reinterpret_cast<float (&)[32]>(s);
                kvq_wg_fence_operand(sd);
                kvq_wg_fence();
                wg_scores(sd, kvq_pf_smem(k_s));
                kvq_wg_commit();
                kvq_wg_wait_all();
                kvq_wg_fence_operand(sd);
            } else {
#pragma unroll
                for (int ks = 0; ks < KS; ++ks) {
                    // the k-step's fragments of every n-tile loaded first, then its mma: the loads' latencies overlap
                    // (each ldmatrix is asm volatile, so the compiler keeps them where they are written)
                    uint kb[NS / 2][4];
#pragma unroll
                    for (int n2 = 0; n2 < NS / 2; ++n2) {
                        const int row = 16 * n2 + (lane & 7) + ((lane >> 4) << 3), j = 2 * ks + ((lane >> 3) & 1);
                        kvq_pf_ldsm4<false>(kb[n2], k_s + row * CH + (j ^ (row & 7)));
                    }
#pragma unroll
                    for (int n2 = 0; n2 < NS / 2; ++n2) {
                        kvq_pf_mma<BF16>(s[2 * n2], qf[ks], kb[n2][0], kb[n2][1]);
                        kvq_pf_mma<BF16>(s[2 * n2 + 1], qf[ks], kb[n2][2], kb[n2][3]);
                    }
                }
            }
            float al[2];
            soften(s, vis, all, al);
            rescale(al);
        }
        kvq_pf_cp_wait_all();
        publish();
        KVQ_BARRIER();  // V tile c0 landed; every warp is done with K tile c0
        if (cn < BIG) load_tile(KW{}, k_s, kg, cn);
        if (any && WG) {
            // (every fragment packed before the fence: a register written between two wgmma makes ptxas wait)
            uint a[BC / 16][4];
            pack(s, a);
            float (&od)[4 * NO] = reinterpret_cast<float (&)[4 * NO]>(acc);
            kvq_wg_fence_operand(od);
            kvq_wg_fence();
            wg_values(od, a, kvq_pf_smem(v_s));
            kvq_wg_commit();
            kvq_wg_wait_all();
            kvq_wg_fence_operand(od);
        } else if (any) {
            // ---- values O += P V: the scores' accumulators of n-tiles 2kk, 2kk + 1 are the A fragment of k-step kk
            // (FlashAttention-2's register reuse); B operand: V rows transposed by ldmatrix, two n-tiles per load
#pragma unroll
            for (int kk = 0; kk < BC / 16; ++kk) {
                const uint a[4] = {kvq_pf_pack<BF16>(s[2 * kk][0], s[2 * kk][1]),
                                   kvq_pf_pack<BF16>(s[2 * kk][2], s[2 * kk][3]),
                                   kvq_pf_pack<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                   kvq_pf_pack<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                // the value fragments in groups of 4 loads, then their mma (as the scores' k-steps above)
                constexpr int G = NO / 2 < 4 ? NO / 2 : 4;
                static_assert((NO / 2) % G == 0, "whole groups of value fragments");
#pragma unroll
                for (int d0 = 0; d0 < NO / 2; d0 += G) {
                    uint vb[G][4];
#pragma unroll
                    for (int d = 0; d < G; ++d) {
                        const int row = 16 * kk + (lane & 7) + (((lane >> 3) & 1) << 3), j = 2 * (d0 + d) + (lane >> 4);
                        kvq_pf_ldsm4<true>(vb[d], v_s + row * CHV + (j ^ (row & 7)));
                    }
#pragma unroll
                    for (int d = 0; d < G; ++d) {
                        kvq_pf_mma<BF16>(acc[2 * (d0 + d)], a, vb[d][0], vb[d][1]);
                        kvq_pf_mma<BF16>(acc[2 * (d0 + d) + 1], a, vb[d][2], vb[d][3]);
                    }
                }
            }
        }
        c0 = cn;
    }

    // ---- the rows' sums over their 4 lanes, the sink logit joined to the normaliser, the output in its dtype
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        float l = lrow[u];
        l += KVQ_SHFL_XOR(l, 1);
        l += KVQ_SHFL_XOR(l, 2);
        if (!valid[u]) continue;
        const int m = m0 + 16 * warp + g + 8 * u;
        const int r = m / rep;
        const int h = kvh * rep + (m - r * rep);
        const float sk = SINK ? KVQ_F32(sink[h]) * LOG2E : -KVQ_INF;
        const float top = KVQ_FMAX(mrow[u], sk);
        float f = 0.0f, lse_r = -KVQ_INF;
        if (top != -KVQ_INF) {
            const float a = kvq_pf_exp2(mrow[u] - top);  // 0 for a row that saw no column
            const float tot = l * a + (SINK ? kvq_pf_exp2(sk - top) : 0.0f);
            f = a / tot;
            lse_r = (top + log2f(tot)) * LN2;
        }
        const int64_t o = ((int64_t)b * Hq + h) * Tq + r;
        uint* const orow = reinterpret_cast<uint*>(out + o * D + zv * DV);
#pragma unroll
        for (int i = 0; i < NO; ++i) orow[4 * i + c] = kvq_pf_pack<BF16>(acc[i][2 * u] * f, acc[i][2 * u + 1] * f);
        if (c == 0 && zv == 0) lse[o] = lse_r;
    }
