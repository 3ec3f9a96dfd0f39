// prefill_attend_tc.cuh: the header prefill_attend_tc.cu is built with: inline-PTX helpers for float16 and bfloat16
// tensor cores (mma.sync m16n8k16 with fp32 accumulators, the pack of two floats into the A operand, ldmatrix with
// and without transpose), 16-byte cp.async copies with zero fill, ex2, the low-bits mask of a tile's visible
// columns (kvq_pf_low_bits) and a compile-time int as a type (kvq_pf_int).
// Used by: prefill_attend_tc.cu (its header, loaded with it by kvq_metal.prefill)

// d += A B for one m16n8k16 tile: A (16 x 16, row-major fragments a), B (16 x 8, column-major fragments b0, b1),
// float16 or bfloat16 in (BF16), float32 accumulators
template <bool BF16>
__device__ __forceinline__ void kvq_pf_mma(float (&d)[4], const uint (&a)[4], const uint b0, const uint b1) {
    if constexpr (BF16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}
// two floats to one float16x2 or bfloat16x2 word, rounded to nearest (lo in the low 16 bits)
template <bool BF16>
__device__ __forceinline__ uint kvq_pf_pack(const float lo, const float hi) {
    uint y;
    if constexpr (BF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(y) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(y) : "f"(hi), "f"(lo));
    }
    return y;
}
// the shared-state-space address of a generic pointer to shared memory: the compiler's intrinsic, which it folds
// into the address arithmetic (a cvta in inline PTX cost 30 registers at head_dim 128: nvcc_prefill.py), and which
// NVRTC provides (MLX's own JIT-compiled CUTLASS kernels use it)
__device__ __forceinline__ uint kvq_pf_smem(const void* p) { return (uint)__cvta_generic_to_shared(p); }
// four 8x8 matrices of 16-bit elements from shared memory: lanes 8i .. 8i + 7 give the row addresses of matrix i;
// TRANS: each matrix transposed (the B operand from row-major values)
template <bool TRANS>
__device__ __forceinline__ void kvq_pf_ldsm4(uint (&r)[4], const void* row) {
    const uint a = kvq_pf_smem(row);
    if constexpr (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    }
}
// an asynchronous 16-byte copy from global to shared memory; ok false reads nothing and writes 16 zero bytes (src
// must still be a mapped address)
__device__ __forceinline__ void kvq_pf_cp16(void* dst, const void* src, const bool ok) {
    const uint a = kvq_pf_smem(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(a), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void kvq_pf_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// wait until every committed copy of this thread has landed (the caller's barrier makes them visible to the block)
__device__ __forceinline__ void kvq_pf_cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ float kvq_pf_exp2(const float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// the n lowest bits set (0 <= n <= 64)
__device__ __forceinline__ kvq_u64 kvq_pf_low_bits(const int n) { return n >= 64 ? ~0ull : (1ull << n) - 1ull; }
// a compile-time int as a type (a generic lambda's argument: the chunks per row of the tile it loads)
template <int V>
struct kvq_pf_int {
    static constexpr int value = V;
};
