// decode_attend_tc.cuh: the header decode_attend_tc.cu is built with: inline-PTX helpers (mma.sync, movmatrix,
// conversions to half2, prmt, funnel shift, ex2), the steps of the online softmax, the values' mma and the warp
// merge (kvq_softmax_step, kvq_rescale, kvq_probs, kvq_pfrag, kvq_mma_vt, kvq_warp_merge: both tensor-core kernels
// call them), the row loader of uncompressed tokens, the bit-field and
// table-lookup macros and loads (KVQ_FIELD_AT, kvq_table_base, kvq_lds), the table-free decode of 4-bit integer levels (kvq_lin4) and the coordinates of a slice's
// pairs (kvq_pair_first, kvq_pair_gap), and the macros that write each step of one side once for both (keys K, k
// and values V, v):
// KVQ_FILL_TABLE, KVQ_LOAD_CODES, KVQ_SLICE_WORDS, KVQ_DECODE_PAIR; the tag that picks a block's role (kvq_role),
// the store of the output in its dtype (kvq_store), the merge's fence (kvq_fence_acq_rel) and the warp-wide
// Hadamard transform of query and output rows (kvq_fwht_rows_warp).
// Used by: decode_attend_tc.cu (its header, loaded with it by kvq_metal.attend_tc; also included by
// decode_attend_streams_tc.cuh, the header of the tensor-core streams kernel)

// a compile-time bool as a type: a block's role, the kernel body being one generic lambda instantiated for
// compressed tokens (kvq_role<false>) and for uncompressed ones (kvq_role<true>), so both share the block's static
// shared memory; and whether a warp's loop reads rows with vector loads and 32-bit offsets (kvq_offset)
template <bool B>
struct kvq_role {
    static constexpr bool value = B;
};
// the output in its own dtype (float, __half or __nv_bfloat16: each converts from float)
template <typename T>
__device__ __forceinline__ void kvq_store(T* p, const float v) { *p = static_cast<T>(v); }
__device__ __forceinline__ void kvq_mma(float (&d)[4], uint a0, uint a1, uint a2, uint a3, uint b0, uint b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint kvq_trans(uint x) {
    uint y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}
// two floats to one half2 (lo in the low 16 bits)
__device__ __forceinline__ uint kvq_h2(float lo, float hi) {
    uint y;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(y) : "f"(hi), "f"(lo));
    return y;
}
__device__ __forceinline__ uint kvq_hfma2(uint a, uint b, uint c) {
    uint y;
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(y) : "r"(a), "r"(b), "r"(c));
    return y;
}
__device__ __forceinline__ uint kvq_prmt(uint a, uint b, uint sel) {
    uint y;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(y) : "r"(a), "r"(b), "r"(sel));
    return y;
}
// bits [sh, sh + 32) of the 64-bit word hi:lo (sh in 0..32)
__device__ __forceinline__ uint kvq_funnel(uint lo, uint hi, uint sh) {
    uint y;
    asm("shf.r.clamp.b32 %0, %1, %2, %3;\n" : "=r"(y) : "r"(lo), "r"(hi), "r"(sh));
    return y;
}
__device__ __forceinline__ float kvq_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// a GPU-scope acquire-release fence: orders a block's stores of its partial results before the split counter's
// atomic and the merging block's loads after it (the pattern of CUDA's threadFenceReduction; __threadfence() is a
// sequentially consistent fence, which this pattern does not need and which cost about 5% of a short call's
// samples on the H200)
__device__ __forceinline__ void kvq_fence_acq_rel() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }
// the in-place fast Walsh-Hadamard transform (unnormalised) of the R rows of D floats of the shared array x, one
// warp per row (warp, warp + NWARP, ...), by the shared fragment warp_hadamard.kvq: a lane holds D / 32 consecutive
// coordinates, so the sums are hadamard_rows.kvq's, in the same order, without its barrier per stage (D a power of
// two from 32 to 256). The caller synchronises the block before (x written) and after (x read)
template <int D, int R, int NWARP>
__device__ __forceinline__ void kvq_fwht_rows_warp(float* x, const int warp, const int lane) {
    constexpr int E = D / 32 > 0 ? D / 32 : 1;
    for (int r = warp; r < R; r += NWARP) {
        float y[E];
#pragma unroll
        for (int e = 0; e < E; ++e) y[e] = x[r * D + lane * E + e];
#include "warp_hadamard.kvq"
#pragma unroll
        for (int e = 0; e < E; ++e) x[r * D + lane * E + e] = y[e];
    }
}

// The steps of the tensor-core decode kernels' online softmax and warp merge (decode_attend_tc.cu and
// decode_attend_streams_tc.cu): the lane (g = lane / 4, c = lane % 4) holds scores of query rows 2c, 2c + 1
// (entries 0, 2 and 1, 3 of a tile's accumulator), in log2 units.

// one step over a warp's NT tiles of scores sc: the rows' running max m and sum l; z the max the step's
// probabilities are taken against (0 while still -inf, so exp2 stays finite) and al the factor that rescales what
// was accumulated before. Returns whether the caller must rescale its accumulators (warp-uniform). SLACK 0: the
// running max follows every step. SLACK > 0: it moves only where a row's new scores exceed it by more than SLACK
// (log2 units: probabilities stay below 2^SLACK; the output, its normaliser and the merge are all taken against the
// same kept max, so the softmax is the same), which at long context is rare after the first steps, and otherwise al
// is 1 and the caller skips the accumulators' multiplies (FlashAttention-4's conditional rescaling). A per-vector
// value scale folded into the probabilities before their float16 conversion (kvq_pfrag) must stay below
// 65,504 / 2^SLACK (kvq_metal.knobs.AttendKnobs.slack)
template <int SLACK, int NT>
__device__ __forceinline__ bool kvq_softmax_step(const float (&sc)[NT][4], float& m0, float& m1, float& l0,
                                                 float& l1, float& z0, float& z1, float& al0, float& al1) {
    float x0 = -KVQ_INF, x1 = -KVQ_INF;
#pragma unroll
    for (int st = 0; st < NT; ++st) {
        x0 = KVQ_FMAX(x0, KVQ_FMAX(sc[st][0], sc[st][2]));
        x1 = KVQ_FMAX(x1, KVQ_FMAX(sc[st][1], sc[st][3]));
    }
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
        x0 = KVQ_FMAX(x0, KVQ_SHFL_XOR(x0, off));
        x1 = KVQ_FMAX(x1, KVQ_SHFL_XOR(x1, off));
    }
    // -inf + SLACK is -inf: a row that has seen no token moves to its first finite score
    const bool move = SLACK == 0 || __any_sync(0xffffffffu, x0 > m0 + (float)SLACK || x1 > m1 + (float)SLACK);
    if (move) {
        const float n0 = KVQ_FMAX(m0, x0), n1 = KVQ_FMAX(m1, x1);
        z0 = n0 == -KVQ_INF ? 0.0f : n0;
        z1 = n1 == -KVQ_INF ? 0.0f : n1;
        al0 = kvq_exp2(m0 - z0);
        al1 = kvq_exp2(m1 - z1);
        m0 = n0; m1 = n1;
        l0 *= al0; l1 *= al1;
    } else {
        z0 = m0 == -KVQ_INF ? 0.0f : m0;
        z1 = m1 == -KVQ_INF ? 0.0f : m1;
        al0 = 1.0f; al1 = 1.0f;
    }
    return move;
}
// the first N m-tiles of accumulators acc times the rows' factors f0, f1
template <int N, int M>
__device__ __forceinline__ void kvq_rescale(float (&acc)[M][4], const float f0, const float f1) {
#pragma unroll
    for (int i = 0; i < N; ++i) { acc[i][0] *= f0; acc[i][1] *= f1; acc[i][2] *= f0; acc[i][3] *= f1; }
}
// the probabilities p = exp2(s - z) of one tile's scores s, added to the rows' sums l
__device__ __forceinline__ void kvq_probs(const float (&s)[4], const float z0, const float z1, float& l0, float& l1,
                                          float (&p)[4]) {
    p[0] = kvq_exp2(s[0] - z0); p[1] = kvq_exp2(s[1] - z1);
    p[2] = kvq_exp2(s[2] - z0); p[3] = kvq_exp2(s[3] - z1);
    l0 += p[0] + p[2]; l1 += p[1] + p[3];
}
// the B operand (P^T) of the values' mma from a tile's probabilities p, times the per-token weights w0 (token g)
// and w1 (token g + 8)
__device__ __forceinline__ void kvq_pfrag(const float (&p)[4], const float w0, const float w1, uint& b0, uint& b1) {
    b0 = kvq_trans(kvq_h2(p[0] * w0, p[1] * w0));
    b1 = kvq_trans(kvq_h2(p[2] * w1, p[3] * w1));
}
// d += V^T P^T for one m-tile: x[u] the half2 pair of the lane's four tokens (2c, 2c + 1, 2c + 8, 2c + 9) at its
// two coordinates, the A operand's rows (coordinates) and columns (tokens)
__device__ __forceinline__ void kvq_mma_vt(float (&d)[4], const uint (&x)[4], const uint b0, const uint b1) {
    kvq_mma(d, kvq_prmt(x[0], x[1], 0x5410u), kvq_prmt(x[0], x[1], 0x7632u), kvq_prmt(x[2], x[3], 0x5410u),
            kvq_prmt(x[2], x[3], 0x7632u), b0, b1);
}
// the first half of merging the block's NWARP warps: the rows' sums reduced over the warp, each warp's (max, sum)
// of its 8 rows into mw_s, lw_s, then (after a barrier) f = exp2(m - the block's max), the factor that takes this
// warp's outputs to the block's max (0 for a row that saw no token)
template <int NWARP>
__device__ __forceinline__ void kvq_warp_merge(float* mw_s, float* lw_s, const int warp, const int g, const int c,
                                               const float m0, const float m1, float& l0, float& l1, float& f0,
                                               float& f1) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
        l0 += KVQ_SHFL_XOR(l0, off);
        l1 += KVQ_SHFL_XOR(l1, off);
    }
    if (g == 0) {
        mw_s[warp * 8 + 2 * c] = m0; mw_s[warp * 8 + 2 * c + 1] = m1;
        lw_s[warp * 8 + 2 * c] = l0; lw_s[warp * 8 + 2 * c + 1] = l1;
    }
    KVQ_BARRIER();
    float top0 = -KVQ_INF, top1 = -KVQ_INF;
#pragma unroll
    for (int w = 0; w < NWARP; ++w) {
        top0 = KVQ_FMAX(top0, mw_s[w * 8 + 2 * c]);
        top1 = KVQ_FMAX(top1, mw_s[w * 8 + 2 * c + 1]);
    }
    f0 = m0 == -KVQ_INF ? 0.0f : kvq_exp2(m0 - top0);
    f1 = m1 == -KVQ_INF ? 0.0f : kvq_exp2(m1 - top1);
}
// NW half2 words (coordinates j0 + 2k, j0 + 2k + 1) of a row of uncompressed keys or values into dst: V-word
// vector loads when vec (16-bit dtype, contiguous, aligned, D long: DT 0 float16 as is, 1 bfloat16 converted),
// else element by element through float, zero past the row's length len
template <int V, int DT, int NW, typename T>
__device__ __forceinline__ void kvq_dense_row(uint (&dst)[NW], const T* row, const int j0, const bool vec,
                                              const int64_t s3, const int len) {
    if (DT < 2 && vec) {
        const uint* w = reinterpret_cast<const uint*>(row + j0);
#pragma unroll
        for (int k = 0; k < NW / V; ++k) {
            if (V == 4) {
                const uint4 x = reinterpret_cast<const uint4*>(w)[k];
                dst[4 * k] = x.x; dst[4 * k + 1] = x.y; dst[4 * k + 2] = x.z; dst[4 * k + 3] = x.w;
            } else if (V == 2) {
                const uint2 x = reinterpret_cast<const uint2*>(w)[k];
                dst[2 * k] = x.x; dst[2 * k + 1] = x.y;
            } else {
                dst[k] = w[k];
            }
        }
        if (DT == 1) {
#pragma unroll
            for (int k = 0; k < NW; ++k) dst[k] = kvq_h2(__uint_as_float(dst[k] << 16), __uint_as_float(dst[k] & 0xffff0000u));
        }
    } else {
        // one word at a time into a local array, in a loop that is not unrolled, then copied: rows a cache never
        // passes (strided, unaligned, other dtypes) take this path, and unrolled, the scheduler hoisted all its
        // loads and held them in registers, which bound the occupancy of the common path (nvcc: the streams
        // kernel's uncompressed role took 189 registers, 152 without this path)
        uint tmp[NW];
        const T* e = row + j0 * s3;
#pragma unroll 1
        for (int k = 0; k < NW; ++k) {
            const int j = j0 + 2 * k;
            tmp[k] = kvq_h2(j < len ? static_cast<float>(e[0]) : 0.0f, j + 1 < len ? static_cast<float>(e[s3]) : 0.0f);
            e += 2 * s3;
        }
#pragma unroll
        for (int k = 0; k < NW; ++k) dst[k] = tmp[k];
    }
}
// 4-bit integer levels (affine codes: x = code * scale + bias) decoded without a table, after FasterTransformer's
// int4-to-half conversion (Kim et al. 2022, "Who Says Elephants Can't Run?"): a nibble OR'd into the top four
// mantissa bits of 16.0 is the half 16 + code, exactly, and 16 subtracted leaves the code as the table holds it
// (so the caller's half2 fma with the group's scale and bias rounds exactly as the table path does; folding the 16
// into the bias instead rounds bias - 16 scale, which failed the parity tests with pure MLX on an H100).
// Pair j of a slice of aligned words w holds the codes of nibbles j % 4 and j % 4 + 4 of word j / 4 (kvq_pair_first,
// kvq_pair_gap with LIN): one shift, one lop3 and one subtraction per pair
template <int NW>
__device__ __forceinline__ uint kvq_lin4(const uint (&w)[NW], const int j) {
    const uint x = w[j >> 2];
    const int k = j & 3;  // nibbles k (bits 4k) and k + 4 to bits 6..9 of each half
    const uint y = k < 2 ? x << (6 - 4 * k) : x >> (4 * k - 6);
    uint h;  // (y & 0x03c003c0) | 0x4c004c00 as one lop3 (written in C, it took two: one immediate per lop3)
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(h) : "r"(y), "n"(0x03c003c0), "n"(0x4c004c00));
    uint c;
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(c) : "r"(h), "r"(0x4c004c00u));
    return c;
}
// 32-bit words a thread's slice of s bits spans at most, in a row of such slices laid end to end from bit 0: slice
// i starts at bit i s, whose offset within its word is a multiple of gcd(s, 32), so at most 32 - gcd(s, 32); the
// words that cover that offset plus s bits (s / 32 when slices fall on words). One word fewer than the general
// bound (s + 31) / 32 + 1 where slices do not (3-bit values at head_dim 128: 48-bit slices, 2 words, not 3)
__device__ __forceinline__ constexpr int kvq_slice_words(const int s) {
    int a = s, b = 32;
    while (b != 0) { const int r = a % b; a = b; b = r; }
    return (32 - a + s + 31) / 32;
}
// pair j of a thread's slice: its first coordinate in the slice and the distance to its second, (2 j, 1), or with
// LIN kvq_lin4's order (8 (j / 4) + j % 4, 4). The query fragments, the decode's group index and the output's
// coordinates all read them, so keys meet their queries' coordinates and values land on their own
template <bool LIN>
__device__ __forceinline__ constexpr int kvq_pair_first(const int j) { return LIN ? 8 * (j >> 2) + (j & 3) : 2 * j; }
template <bool LIN>
__device__ __forceinline__ constexpr int kvq_pair_gap() { return LIN ? 4 : 1; }
// Offsets of the decode kernels' loads within a (batch, KV head) row. kvq_offset<OFF32>: element (token t, column
// j) of an array of token stride ts and column stride cs, in 32 bits with OFF32 (one multiply-add for an address,
// not 64-bit arithmetic), else in 64. kvq_fits32: whether OFF32 is exact for an array read at tokens below rows
// with token stride ts and columns spanning extent elements: strides of no sign (a view running backwards wraps)
// and the last offset below 2^31 (checked once per block; an input standing in for an absent one is checked like
// the rest)
template <bool OFF32>
__device__ __forceinline__ int64_t kvq_offset(const int t, const int64_t ts, const int j, const int64_t cs) {
    return OFF32 ? (int64_t)(uint)(t * (uint)ts + j * (uint)cs) : (int64_t)t * ts + j * cs;
}
// kvq_offset_at<OFF32, FLAT>: the same from an array's start, its (batch, KV head) row at element base: base plus
// kvq_offset, or with OFF32 and FLAT all of it in 32 bits (the caller then checks the row with kvq_fits32, the base
// included in the extent). Flat, the base joins the lane's loop-invariant part and an address is one 32-bit
// multiply-add and a scaled add to the array's pointer (with the 64-bit base added in the loop nvcc spent two more
// instructions on each load's address), at the cost of registers for those invariants (nvcc sm_90, the bound step
// at head_dim 128: turboquant-4 148 -> 223, turboquant-3 139 -> 167, affine-4 144 -> 202). A block whose row ends
// beyond 2^31 elements of an array's start then takes the general 64-bit path (kvq_metal.attend_tc.flat32)
template <bool OFF32, bool FLAT>
__device__ __forceinline__ int64_t kvq_offset_at(const int64_t base, const int t, const int64_t ts, const int j,
                                                 const int64_t cs) {
    return OFF32 && FLAT ? (int64_t)(uint)((uint)base + t * (uint)ts + j * (uint)cs)
                         : base + kvq_offset<OFF32>(t, ts, j, cs);
}
__device__ __forceinline__ bool kvq_fits32(const int rows, const int64_t ts, const int64_t extent) {
    return ts >= 0 && extent >= 0 && (int64_t)(rows > 0 ? rows - 1 : 0) * ts + extent < ((int64_t)1 << 31);
}
// Code tables looked up by shared-space address. kvq_table_base(tab): the table's 32-bit address in the shared state
// space, passed through a shuffle from lane 0 so that the compiler knows it is the same in every lane (a warp's
// loop bounds depend on threadIdx.x >> 5, which it cannot prove uniform, and then it kept the address, formed from
// the CTA's rank in its cluster on sm_90, in an ordinary register and added it in one more instruction per
// lookup); in a uniform register the load adds it itself (LDS [R + UR]). kvq_lds / kvq_lds64: one 32 / 64-bit
// load at such an address. KVQ_FIELD_AT: NB bits at bit offset OFF of the register array w as the byte offset of
// that entry in a table whose entries lie 1 << SH bytes apart, OR'd with lo (the lane's copy, below bit SH): one
// shift (a funnel shift where the field crosses a word) and one and-or (OFF, NB compile-time after unrolling;
// NB + SH <= 32). A lookup is then three instructions (nvcc sm_90: turboquant-3's decode loop 1,283 -> 1,033
// instructions per warp step, turboquant-4's 1,052 -> 921)
__device__ __forceinline__ uint kvq_table_base(const void* tab) {
    return __shfl_sync(0xffffffffu, (uint)__cvta_generic_to_shared(tab), 0);
}
__device__ __forceinline__ uint kvq_lds(const uint a) {
    uint y;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(y) : "r"(a));
    return y;
}
__device__ __forceinline__ uint2 kvq_lds64(const uint a) {
    uint2 y;
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(y.x), "=r"(y.y) : "r"(a));
    return y;
}
#define KVQ_FIELD_AT(w, OFF, NB, SH, lo)                                                                    \
    (((((OFF) & 31) + (NB) <= 32                                                                            \
           ? (((OFF) & 31) >= (SH) ? (w)[(OFF) >> 5] >> (((OFF) & 31) - (SH))                               \
                                   : (w)[(OFF) >> 5] << ((SH) - ((OFF) & 31)))                              \
           : kvq_funnel((w)[(OFF) >> 5], (w)[((OFF) >> 5) + 1], ((OFF) & 31) - (SH)))                       \
      & (((1u << (NB)) - 1u) << (SH))) | (lo))
// the half2 of coordinate pair j (coordinates 2j, 2j + 1, the first in the low half) of a slice of B-bit codes
// whose words u start at bit 0: one lookup of a pair table (PAIR: entry (a | b << B) = (table[a], table[b])) or
// two of a single table (entry c = (table[c], table[c])) joined by one prmt; a is the table's kvq_table_base, lo
// the byte offset of the lane's copy, entries 1 << SH bytes apart (KVQ_DECODE_PAIR's
// sides of one stream and the streams kernel's streams)
#define KVQ_TABLE_PAIR(u, j, B, PAIR, a, lo, SH)                                                           \
    ((PAIR) ? kvq_lds((a) + KVQ_FIELD_AT(u, (j) * 2 * (B), 2 * (B), SH, lo))                                 \
            : kvq_prmt(kvq_lds((a) + KVQ_FIELD_AT(u, (j) * 2 * (B), (B), SH, lo)),                           \
                       kvq_lds((a) + KVQ_FIELD_AT(u, (j) * 2 * (B) + (B), (B), SH, lo)), 0x7610u))
// NB bits at bit offset OFF of the register array w (OFF, NB compile-time after unrolling; NB <= 16); a whole
// byte is one prmt
#define KVQ_BITS_SHIFT(w, OFF, NB) \
    ((((OFF) & 31) + (NB) <= 32 ? ((w)[(OFF) >> 5] >> ((OFF) & 31)) \
                                : (((w)[(OFF) >> 5] >> ((OFF) & 31)) | ((w)[((OFF) >> 5) + 1] << (32 - ((OFF) & 31))))) \
     & ((1u << (NB)) - 1u))
#define KVQ_BITS(w, OFF, NB) \
    ((NB) == 8 && ((OFF) & 7) == 0 ? kvq_prmt((w)[(OFF) >> 5], 0u, 0x4440u + (((OFF) & 31) >> 3)) \
                                   : KVQ_BITS_SHIFT(w, OFF, NB))
// NW words of a thread's slice from row (word stride s3) into dst: VEC-word vector loads when vec (unit stride,
// aligned rows: VEC is a compile-time 1, 2 or 4), else word by word, reading words first + k >= lim as 0 unless
// ALIGNED (a slice that ends on a word)
#define KVQ_LOAD_SLICE(dst, row, NW, VEC, vec, s3, first, lim, ALIGNED)                                   \
    if ((VEC) == 4 && (vec)) {                                                                          \
        _Pragma("unroll") for (int k_ = 0; k_ < (NW) / 4; ++k_) {                                       \
            const uint4 v_ = reinterpret_cast<const uint4*>(row)[k_];                                   \
            dst[4 * k_] = v_.x; dst[4 * k_ + 1] = v_.y; dst[4 * k_ + 2] = v_.z; dst[4 * k_ + 3] = v_.w; \
        }                                                                                               \
    } else if ((VEC) == 2 && (vec)) {                                                                   \
        _Pragma("unroll") for (int k_ = 0; k_ < (NW) / 2; ++k_) {                                       \
            const uint2 v_ = reinterpret_cast<const uint2*>(row)[k_];                                   \
            dst[2 * k_] = v_.x; dst[2 * k_ + 1] = v_.y;                                                 \
        }                                                                                               \
    } else {                                                                                            \
        _Pragma("unroll") for (int k_ = 0; k_ < (NW); ++k_)                                             \
            dst[k_] = (ALIGNED) || (first) + k_ < (lim) ? (uint)(row)[k_ * (s3)] : 0u;                  \
    }
// one side's code table in shared memory from its staged values: SIDE is the side's template-argument prefix (K
// or V: SIDE##PAIR, SIDE##B, SIDE##B2, SIDE##MASK, SIDE##MASK2, SIDE##REP, SIDE##TW) and side its arrays' (k or v:
// side##t0_s the staged values, side##tab_s the table); pair or single entries, one copy per lane (written four
// copies per 128-bit store) or one in all
#define KVQ_FILL_TABLE(SIDE, side)                                                                                  \
    {                                                                                                               \
        /* entry e of the table: (value of code a, value of code b) for a pair table, (value, value) otherwise */   \
        auto entry = [&](const uint e) -> uint {                                                                    \
            if (SIDE##PAIR) {                                                                                       \
                const uint p1 = e >> (2 * SIDE##B2), p2 = e & ((1u << (2 * SIDE##B2)) - 1u);                        \
                return kvq_h2(side##t0_s[((p1 & SIDE##MASK) << SIDE##B2) | (p2 & SIDE##MASK2)],                     \
                              side##t0_s[((p1 >> SIDE##B) << SIDE##B2) | (p2 >> SIDE##B2)]);                        \
            }                                                                                                       \
            return kvq_h2(side##t0_s[e], side##t0_s[e]);                                                            \
        };                                                                                                          \
        if (SIDE##REP) {                                                                                            \
            for (int i = tid; i < SIDE##TW / 4; i += THREADS) {                                                     \
                const uint x = entry((uint)i >> 3);                                                                 \
                reinterpret_cast<uint4*>(side##tab_s)[i] = make_uint4(x, x, x, x);                                  \
            }                                                                                                       \
        } else {                                                                                                    \
            for (int i = tid; i < SIDE##TW; i += THREADS) side##tab_s[i] = entry((uint)i);                          \
        }                                                                                                           \
    }
// the code words of this thread's slice of token t of one side (both streams) into step st's buffer, slice u
// (KVQ_LOAD_SLICE: vector loads where VECS, a compile-time true, or side##vec says so; with VECS the token's
// offset in 32 bits, kvq_offset, its word stride 1 as vector loads need); SIDE and side as in KVQ_FILL_TABLE
#define KVQ_LOAD_CODES(SIDE, side)                                                                                  \
    const auto* row = side##c + kvq_offset_at<VECS, FLAT32>(side##base, t, side##c_strides[2], side##bit >> 5,             \
                                                    VECS ? 1 : side##c_strides[3]);                                \
    KVQ_LOAD_SLICE(buf.side##w[st][u], row, SIDE##NW, SIDE##VEC, VECS || side##vec, VECS ? 1 : side##c_strides[3], side##bit >> 5,      \
                   side##wl, SIDE##AL)                                                                             \
    if (SIDE##B2 > 0) {                                                                                            \
        const auto* row2 = side##c2 + kvq_offset_at<VECS, FLAT32>(side##base2, t, side##c2_strides[2], side##bit2 >> 5,   \
                                                          VECS ? 1 : side##c2_strides[3]);                         \
        KVQ_LOAD_SLICE(buf.side##w2[st][u], row2, SIDE##NW2, SIDE##VEC2, VECS || side##vec2, VECS ? 1 : side##c2_strides[3],          \
                       side##bit2 >> 5, side##wl2, SIDE##AL)                                                       \
    }
// the words of slice u of one side in step st, aligned to bit 0 (side##u, side##u2; a no-op when every slice starts
// on a word), and its group scales and biases as half2 pairs (side##h, side##bh); SIDE and side as in KVQ_FILL_TABLE
#define KVQ_SLICE_WORDS(SIDE, side)                                                                                 \
    _Pragma("unroll") for (int k = 0; k < SIDE##NW; ++k)                                                          \
        side##u[u][k] = SIDE##AL ? buf.side##w[st][u][k]                                                          \
                                 : kvq_funnel(buf.side##w[st][u][k], k + 1 < SIDE##NW ? buf.side##w[st][u][k + 1] : 0u, \
                                              side##bit & 31);                                                     \
    _Pragma("unroll") for (int k = 0; k < SIDE##NW2; ++k)                                                         \
        side##u2[u][k] = SIDE##AL ? buf.side##w2[st][u][k]                                                        \
                                  : kvq_funnel(buf.side##w2[st][u][k], k + 1 < SIDE##NW2 ? buf.side##w2[st][u][k + 1] \
                                                                                         : 0u, side##bit2 & 31);   \
    _Pragma("unroll") for (int k = 0; k < SIDE##NG; ++k) {                                                        \
        side##h[u][k] = kvq_h2(buf.side##sc[st][u][k], buf.side##sc[st][u][k]);                                   \
        side##bh[u][k] = kvq_h2(buf.side##bi[st][u][k], buf.side##bi[st][u][k]);                                  \
    }
// x (declared by the caller) = the half2 of coordinate pair j of slice u of one side: its two codes from the
// aligned words, looked up in the side's table (pair or single entries; side##tab_a its kvq_table_base, side##lo
// the lane's copy) or, SIDE##LIN, decoded without one
// (kvq_lin4: coordinates kvq_pair_first<true>(j) and kvq_pair_gap<true>() after it), times the pair's group scale plus its bias where the side
// has group scales; DENSE: the pair as loaded. SIDE and side as in KVQ_FILL_TABLE
#define KVQ_DECODE_PAIR(SIDE, side, j)                                                                              \
    const uint p1 = KVQ_BITS(side##u[u], j * 2 * SIDE##B, 2 * SIDE##B);                                            \
    const uint p2 = SIDE##B2 > 0 ? KVQ_BITS(side##u2[u], j * 2 * (SIDE##B2 > 0 ? SIDE##B2 : 1),                    \
                                            2 * (SIDE##B2 > 0 ? SIDE##B2 : 1)) : 0u;                               \
    if (DENSE) {                                                                                                   \
        x = buf.d##side[st][u][j];                                                                                 \
    } else if (SIDE##LIN) {                                                                                        \
        x = kvq_lin4(side##u[u], j);                                                                               \
    } else if (SIDE##B2 == 0) {                                                                                    \
        x = KVQ_TABLE_PAIR(side##u[u], j, SIDE##B, SIDE##PAIR, side##tab_a, side##lo, SIDE##SH);                   \
    } else if (SIDE##PAIR) {                                                                                       \
        x = kvq_lds(side##tab_a + ((((p1 << (2 * SIDE##B2)) | p2) << SIDE##SH) | side##lo));                       \
    } else {                                                                                                       \
        const uint ca = ((p1 & SIDE##MASK) << SIDE##B2) | (p2 & SIDE##MASK2);                                      \
        const uint cb = ((p1 >> SIDE##B) << SIDE##B2) | (p2 >> SIDE##B2);                                          \
        x = kvq_prmt(kvq_lds(side##tab_a + ((ca << SIDE##SH) | side##lo)),                                         \
                     kvq_lds(side##tab_a + ((cb << SIDE##SH) | side##lo)), 0x7610u);                               \
    }                                                                                                              \
    if (!SIDE##ONE && !DENSE) {                                                                                    \
        const int gi = S##SIDE >= SIDE##G ? kvq_pair_first<SIDE##LIN>(j) / SIDE##G : 0;                             \
        x = kvq_hfma2(x, side##h[u][gi], side##bh[u][gi]);                                                         \
    }
