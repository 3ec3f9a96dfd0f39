// prefill_attend_tc.cuh: the header prefill_attend_tc.cu is built with: inline-PTX helpers for float16 and bfloat16
// tensor cores (mma.sync m16n8k16 with fp32 accumulators, the pack of two floats into the A operand, ldmatrix with
// and without transpose; on sm_90a the warpgroup's wgmma m64n64k16 with A from registers and B from shared memory
// through a matrix descriptor, its fences, commit and wait, and the async-proxy fence), 16-byte cp.async copies
// with zero fill, ex2, the low-bits mask of a tile's visible columns (kvq_pf_low_bits) and a compile-time int as a
// type (kvq_pf_int).
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
// ---- sm_90a only (wgmma: PTX ISA 8.0, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"); the kernel
// instantiates these only where the template's WG is set, which kvq_metal.prefill does on compute capability 9.x

// a wgmma matrix descriptor of a 16-bit operand tile in shared memory with the 128-byte swizzle: start address,
// leading and stride byte offsets (each >> 4, in their fields of 14 bits), swizzle mode 1 (128 B) in bits 62-63.
// The tile's 1024-byte atoms (8 rows of 128 bytes, 16-byte chunk j of row r at chunk j ^ r) start on 1024 bytes,
// so the base-offset field stays 0 (a start inside an atom's first row, as a k-step's, is allowed: CUTLASS's
// GmmaDescriptor advances it the same way)
__device__ __forceinline__ kvq_u64 kvq_wg_desc(const uint addr, const uint lbo, const uint sbo) {
    return (kvq_u64)((addr & 0x3FFFFu) >> 4) | ((kvq_u64)((lbo >> 4) & 0x3FFFu) << 16) |
           ((kvq_u64)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}
// d (+)= A B for the warpgroup's 64 x 64 tile, k 16: A the warp's m16n8k16-layout fragments (rows 16 w .. 16 w + 15
// of the warpgroup's 64, w its warp), B 16 x 64 through desc (TB 0: K-major, B[k][n] at row n; TB 1: N-major, at
// row k), accumulate 0: d = A B. d: the warp's 16 x 64 fp32 accumulators in mma.sync's C layout per n8 tile
// (d[4 j + e]: row g + 8 (e >> 1), column 8 j + 2 c + (e & 1))
template <bool BF16, int TB>
__device__ __forceinline__ void kvq_wg_mma64(float (&d)[32], const uint (&a)[4], const kvq_u64 desc,
                                             const int accumulate) {
    if constexpr (BF16) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TB), "r"(accumulate));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(TB), "r"(accumulate));
    }
}
// before a warpgroup's first wgmma that reads registers other instructions wrote (its A fragments, accumulators)
__device__ __forceinline__ void kvq_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void kvq_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// until every committed wgmma group of the warpgroup is done (its accumulators written)
__device__ __forceinline__ void kvq_wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// until at most N of the warpgroup's committed wgmma groups are pending (groups complete in order: N = 1 after two
// commits waits for the first only)
template <int N>
__device__ __forceinline__ void kvq_wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// accumulator registers as changed here, so the compiler moves no read or write of them across (CUTLASS's
// warpgroup_fence_operand): around a wgmma group, whose writes the compiler does not see
template <int N>
__device__ __forceinline__ void kvq_wg_fence_operand(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// this thread's writes to shared memory (cp.async's included, once waited for) made visible to the async proxy
// that wgmma reads its shared-memory operands through; a barrier after it publishes them to the block
__device__ __forceinline__ void kvq_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
