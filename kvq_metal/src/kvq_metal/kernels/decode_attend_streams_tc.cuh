// decode_attend_streams_tc.cuh: the header decode_attend_streams_tc.cu is built with: the tensor-core kernel's
// helpers (decode_attend_tc.cuh: mma.sync, movmatrix, half2 conversions, prmt, funnel shift, ex2, the row loader of
// uncompressed tokens, KVQ_FIELD_AT, kvq_table_base, kvq_lds, the pair decoder KVQ_TABLE_PAIR) and the word loader
// of one code stream.
// Used by: decode_attend_streams_tc.cu (its header, loaded with it by kvq_metal.streams)
#include "decode_attend_tc.cuh"

// NW 32-bit words w0 .. w0 + NW - 1 of a token's row of codes (p: the row's first element; CB bytes per element,
// 4: uint32 words, 1: uint8 bytes; es: the element stride) into dst. VEC-word vector loads when vec (contiguous,
// aligned rows; VEC a compile-time 1, 2 or 4; uint8 rows read as words), else word by word, uint8 rows byte by byte.
// CHECK: words at or past rw (the row's word count) read as 0 (a slice that does not end on a word reads one more)
#define KVQ_ROW_WORDS(dst, p, NW, CB, VEC, vec, w0, rw, es, CHECK)                                        \
    if ((vec) && (VEC) == 4) {                                                                          \
        _Pragma("unroll") for (int k_ = 0; k_ < (NW) / 4; ++k_) {                                       \
            const uint4 v_ = reinterpret_cast<const uint4*>(p)[((w0) >> 2) + k_];                       \
            dst[4 * k_] = v_.x; dst[4 * k_ + 1] = v_.y; dst[4 * k_ + 2] = v_.z; dst[4 * k_ + 3] = v_.w; \
        }                                                                                               \
    } else if ((vec) && (VEC) == 2) {                                                                   \
        _Pragma("unroll") for (int k_ = 0; k_ < (NW) / 2; ++k_) {                                       \
            const uint2 v_ = reinterpret_cast<const uint2*>(p)[((w0) >> 1) + k_];                       \
            dst[2 * k_] = v_.x; dst[2 * k_ + 1] = v_.y;                                                 \
        }                                                                                               \
    } else {                                                                                            \
        _Pragma("unroll") for (int k_ = 0; k_ < (NW); ++k_) {                                           \
            const int w_ = (w0) + k_;                                                                   \
            uint x_ = 0u;                                                                               \
            if (!(CHECK) || w_ < (rw)) {                                                                \
                if ((CB) == 4) {                                                                        \
                    x_ = (uint)(p)[(int64_t)w_ * (es)];                                                 \
                } else if (vec) {                                                                       \
                    x_ = reinterpret_cast<const uint*>(p)[w_];                                          \
                } else {                                                                                \
                    _Pragma("unroll") for (int b_ = 0; b_ < 4; ++b_)                                    \
                        x_ |= ((uint)(p)[((int64_t)w_ * 4 + b_) * (es)]) << (8 * b_);                   \
                }                                                                                       \
            }                                                                                           \
            dst[k_] = x_;                                                                               \
        }                                                                                               \
    }
// a stream's code table into shared memory from its float32 values t (2**B of them): pair entries when PAIR,
// single ones otherwise; REP: 32 copies, word e * 32 + lane (every lookup free of bank conflicts), written four
// copies per 128-bit store
#define KVQ_STREAM_TABLE(tab_s, t, B, PAIR, REP)                                                            \
    {                                                                                                       \
        auto entry_ = [&](const uint e) -> uint {                                                           \
            return (PAIR) ? kvq_h2(t[e & ((1u << (B)) - 1u)], t[e >> (B)]) : kvq_h2(t[e], t[e]);            \
        };                                                                                                  \
        constexpr int NE_ = (PAIR) ? (1 << (2 * (B))) : (1 << (B));                                         \
        if (REP) {                                                                                          \
            for (int i_ = tid; i_ < NE_ * 8; i_ += THREADS) {                                               \
                const uint x_ = entry_((uint)i_ >> 3);                                                      \
                reinterpret_cast<uint4*>(tab_s)[i_] = make_uint4(x_, x_, x_, x_);                           \
            }                                                                                               \
        } else {                                                                                            \
            for (int i_ = tid; i_ < NE_; i_ += THREADS) tab_s[i_] = entry_((uint)i_);                       \
        }                                                                                                   \
    }
// a 1-bit stream's nibble table: entry n (4 codes, the first in the low bit) = (half2 of codes 0, 1; half2 of codes
// 2, 3) from the stream's two float32 values t: one 64-bit lookup decodes four coordinates; REP: 32 copies, entry
// n of lane l at uint2 slot n * 32 + l
#define KVQ_QUAD_TABLE(tab_s, t, REP)                                                                       \
    {                                                                                                       \
        const float lo_ = t[0], hi_ = t[1];                                                                 \
        auto h2_ = [&](const uint c2) { return kvq_h2(c2 & 1u ? hi_ : lo_, c2 & 2u ? hi_ : lo_); };         \
        for (int i_ = tid; i_ < 16 * ((REP) ? 32 : 1); i_ += THREADS) {                                     \
            const uint n_ = (uint)i_ >> ((REP) ? 5 : 0);                                                    \
            reinterpret_cast<uint2*>(tab_s)[i_] = make_uint2(h2_(n_ & 3u), h2_(n_ >> 2));                   \
        }                                                                                                   \
    }
// the two half2 words of nibble n (coordinates 4n .. 4n + 3) of a slice of 1-bit codes whose words u start at bit
// 0, from a nibble table at a (kvq_table_base) whose entries lie 1 << SH bytes apart, the lane's copy at byte lo
#define KVQ_STREAM_QUAD(u, n, a, lo, SH) kvq_lds64((a) + KVQ_FIELD_AT(u, 4 * (n), 4, SH, lo))
