// Sparse MLA attention (DeepSeek-V3.2 DSA), FlashMLA-style, for CuPy inputs.
//
// One CTA per (query token, group of 64 heads, split): with splits > 1 (split-KV
// decoding, chosen by the launcher when the units would leave SMs idle) each CTA
// takes an equal share of the token's key tiles and writes a normalised partial row
// and its lse, merged by cps_mla_combine(_few_rows) at the end of this file. Every
// kernel runs a producer warpgroup (two in the fp8 decode: 512 threads, the others 384)
// that fills two K buffers of bf16 [64 keys x 576] in shared memory with the token's keys
// (top-k slots, or a causal range for the dense route), and two math warpgroups:
//   - dense bf16 rows (cps_sparse_mla_bf16: prefill): the producer gathers the rows
//     by 16-byte cp.async; the math warpgroups run FlashMLA's sparse-prefill
//     "ping-pong" schedule ("the ping-pong kernel" below): warpgroup w owns every
//     other tile (S = Q K^T by wgmma m64n64k16 over the whole tile, its softmax),
//     the row max passes between them as a chain, and each computes its 256 output
//     columns of P V for both tiles of a pair (its own P from registers, the other's
//     from shared memory), so one warpgroup's softmax overlaps the other's products;
//   - fp8_ds_mla cache (cps_sparse_mla_fp8: decode) and MODEL1 (cps_sparse_mla_model1):
//     the producer reads the records (one warp load = 512 contiguous code bytes of
//     one record), dequantizes them (e4m3 code * scale -> bf16; RoPE bf16 as is, by
//     cp.async) and hands each buffer over through named barriers, so the
//     dequantization overlaps the MMAs. The fp8 kernel's math warpgroups run
//     FlashMLA's decode schedule ("the fp8 decode schedule" below): warpgroup 0 owns
//     S = Q K^T of the whole tile (wgmma m64n64k16) and the softmax, warpgroup 1 only
//     P V; each owns 256 output columns (V = first 512 columns of the same rows, all
//     64 heads). MODEL1's (att_consume) share each tile: S = Q K^T by wgmma m64n32k16
//     (warpgroup w owns keys 32w..32w+31), online softmax with the row max exchanged
//     through shared memory, O += P V (warpgroup w owns output columns
//     256w..256w+255; P from shared memory).
// Softmax in base 2 (sm_scale * log2 e folded in). Masked keys (-1 / past the row's
// length / outside [0, num_slots)) are zero-filled, never read, and get p = 0; a fully
// masked tile is skipped by MODEL1's schedule (a pair, in the ping-pong kernel), not by
// the fp8 decode's (its P is 0); a row with no valid key ends with out = 0 and
// lse = -inf. lse is returned in natural log.
//
// Shared-memory tiles use the 128-byte swizzle of wgmma (K-major, 8-row x
// 128-byte atoms, 16-byte chunk c of row r at chunk c ^ (r & 7)): a [64 x 576]
// bf16 tile is 9 column blocks of [64 x 64] (8 KB each). Both products run on
// the tensor cores by wgmma, operands straight from shared memory:
//   QK^T by wgmma m64n32k16 / m64n64k16 (A = Q, B = K, both K-major),
//   PV   by wgmma m64n256k16 (A = P K-major from shared memory or registers, B = V
//        MN-major, trans-b).
// Fragment layout of the softmax and the epilogue: warp wi (0..3) of warpgroup
// wg holds heads 16wi + g (+8), g = lane / 4.
// Shared cp.async / fence / wgmma helpers (cps_*): hopper.cuh.

// ATT_WS_THREADS, ATT_DEC_THREADS, ATT_SMEM_BYTES, ATT_MAX_SPLITS, ATT_COMBINE_THREADS,
// ATT_REC_BYTES (the fp8_ds_mla record) and ATT_M1_NOPE / ATT_M1_ROW /
// ATT_M1_SCALE_BYTES (the MODEL1 page layout) are #defined by the launcher
// (raw_kernels/attention.py), which owns them; the tile layout below must fit
// ATT_SMEM_BYTES (static_assert).
#define ATT_D 576
#define ATT_DV 512
#define ATT_ROW_BYTES 1152          // bf16 row of the dense workspace
static_assert(ATT_REC_BYTES == 512 + 4 * 4 + 2 * 64, "fp8_ds_mla: codes, 4 scales, bf16 RoPE");
#define ATT_BLK 8192                // one [64 x 64] bf16 block
#define ATT_TILE (9 * ATT_BLK)      // [64 x 576] bf16
#define ATT_OFF_Q 0
#define ATT_OFF_K 73728             // two K tiles
#define ATT_OFF_P 221184            // [64 x 64] bf16 probabilities
#define ATT_OFF_MAX 229376          // float [2][64] partial row max
#define ATT_OFF_L 229888            // float [2][64] partial row sum
#define ATT_OFF_VALID 230400        // key validity of the two tiles: int [2][64] (MODEL1),
                                    // u64 [2] (the fp8 decode), u64 [2][2] (ping-pong)
#define ATT_SMEM_USED (ATT_OFF_VALID + 2 * 64 * 4)
static_assert(ATT_SMEM_USED + 1024 == ATT_SMEM_BYTES,
              "the launcher's ATT_SMEM_BYTES must be the tile layout + 1024 bytes of "
              "alignment slack");
static_assert(ATT_MAX_SPLITS >= 1 && ATT_MAX_SPLITS <= 1024, "split-KV partials per row");
#define ATT_NEG_INF (-__int_as_float(0x7f800000))
#define ATT_LN2 0.693147180559945309f

__device__ __forceinline__ void att_st_v4(u32 addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n"
                 :: "r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ void att_st_b32(u32 addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ float att_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two floats -> packed bf16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 att_pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Two floats -> the packed 16-bit pair of an out of format OUT (ATT_FMT_BF16 or
// ATT_FMT_F16; lo in the low half), round to nearest even. The format is a template
// argument, not a kernel argument: on a runtime format the compiler copied the row
// store once a format, and the fp8 kernel holding both copies ran 5-7% slower than the
// float32 one (B=128, H100); with one format it matches it.
template <int OUT>
__device__ __forceinline__ u32 att_pack_out16(float lo, float hi) {
    static_assert(OUT == ATT_FMT_BF16 || OUT == ATT_FMT_F16, "a 16-bit out format");
    if constexpr (OUT == ATT_FMT_BF16) return att_pack_bf16(lo, hi);
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Packed f16x2 -> bf16x2 (through float, exact then rounded once).
__device__ __forceinline__ u32 att_f16x2_to_bf16x2(u32 h) {
    float lo, hi;
    asm("{\n.reg .b16 l16, h16;\nmov.b32 {l16, h16}, %2;\n"
        "cvt.f32.f16 %0, l16;\ncvt.f32.f16 %1, h16;\n}\n"
        : "=f"(lo), "=f"(hi) : "r"(h));
    return att_pack_bf16(lo, hi);
}

// Four e4m3 codes (byte 0 first) times scale -> two packed bf16x2.
__device__ __forceinline__ void att_dequant4(u32 w, float scale, u32& out01, u32& out23) {
    u32 h01, h23;
    asm("{\n.reg .b16 a, b;\nmov.b32 {a, b}, %2;\n"
        "cvt.rn.f16x2.e4m3x2 %0, a;\ncvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
        : "=r"(h01), "=r"(h23) : "r"(w));
    float f0, f1, f2, f3;
    asm("{\n.reg .b16 l16, h16;\nmov.b32 {l16, h16}, %2;\n"
        "cvt.f32.f16 %0, l16;\ncvt.f32.f16 %1, h16;\n}\n"
        : "=f"(f0), "=f"(f1) : "r"(h01));
    asm("{\n.reg .b16 l16, h16;\nmov.b32 {l16, h16}, %2;\n"
        "cvt.f32.f16 %0, l16;\ncvt.f32.f16 %1, h16;\n}\n"
        : "=f"(f2), "=f"(f3) : "r"(h23));
    out01 = att_pack_bf16(f0 * scale, f1 * scale);
    out23 = att_pack_bf16(f2 * scale, f3 * scale);
}

// The two wgmma shapes of this module (under hopper.cuh's arch guard, CPS_HAS_WGMMA).
__device__ __forceinline__ void att_wgmma_m64n32_kk(float (&d)[16], u64 da, u64 db, int accumulate) {
#if CPS_HAS_WGMMA
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(accumulate));
#else
    CPS_WGMMA_MISSING();
#endif
}

// The fp32 accumulators of an m64n128 / m64n256 wgmma (64 / 128): the operand list of the
// instruction (%0..) and the matching in-out constraints.
#define ATT_ACC64_REGS \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define ATT_ACC64_OUT(d) \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), "+f"((d)[6]), "+f"((d)[7]), \
    "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), "+f"((d)[12]), "+f"((d)[13]), "+f"((d)[14]), "+f"((d)[15]), \
    "+f"((d)[16]), "+f"((d)[17]), "+f"((d)[18]), "+f"((d)[19]), "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]), \
    "+f"((d)[24]), "+f"((d)[25]), "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), "+f"((d)[30]), "+f"((d)[31]), \
    "+f"((d)[32]), "+f"((d)[33]), "+f"((d)[34]), "+f"((d)[35]), "+f"((d)[36]), "+f"((d)[37]), "+f"((d)[38]), "+f"((d)[39]), \
    "+f"((d)[40]), "+f"((d)[41]), "+f"((d)[42]), "+f"((d)[43]), "+f"((d)[44]), "+f"((d)[45]), "+f"((d)[46]), "+f"((d)[47]), \
    "+f"((d)[48]), "+f"((d)[49]), "+f"((d)[50]), "+f"((d)[51]), "+f"((d)[52]), "+f"((d)[53]), "+f"((d)[54]), "+f"((d)[55]), \
    "+f"((d)[56]), "+f"((d)[57]), "+f"((d)[58]), "+f"((d)[59]), "+f"((d)[60]), "+f"((d)[61]), "+f"((d)[62]), "+f"((d)[63])
#define ATT_ACC128_REGS \
    ATT_ACC64_REGS ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define ATT_ACC128_OUT(d) ATT_ACC64_OUT(d), ATT_ACC64_OUT((d) + 64)

__device__ __forceinline__ void att_wgmma_m64n64_kk(float (&d)[32], u64 da, u64 db, int accumulate) {
#if CPS_HAS_WGMMA
    asm volatile(
        "{\n.reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        :
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate));
#else
    CPS_WGMMA_MISSING();
#endif
}

// The P V products, m64nN with A K-major from shared memory (_kmn) or from registers
// (_rmn), B MN-major (trans-b): N = 256 (128 accumulators) and N = 128 (64; the fp8
// decode's, two a k-step over a warpgroup's 256 columns: its CTA of 512 threads launches
// at 128 registers a thread, and ptxas will not place an m64n256 wgmma, 158 registers
// live, under that target, whatever the region's setmaxnreg). ACC: the accumulator count;
// IA (A from registers: IA0..IA3) / IB / IP: the operand numbers of A, B and the
// accumulate flag after the ACC accumulators.
#if CPS_HAS_WGMMA
#define ATT_WGMMA_PV_KMN(NAME, N, ACC, ACC_REGS, ACC_OUT, IA, IB, IP)                         \
    __device__ __forceinline__ void NAME(float (&d)[ACC], u64 da, u64 db, int accumulate) {   \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                        \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 "              \
                     "{" ACC_REGS "}, %" #IA ", %" #IB ", p, 1, 1, 0, 1;\n}\n"                 \
                     : ACC_OUT(d) : "l"(da), "l"(db), "r"(accumulate));                       \
    }
#define ATT_WGMMA_PV_RMN(NAME, N, ACC, ACC_REGS, ACC_OUT, IA0, IA1, IA2, IA3, IB, IP)         \
    __device__ __forceinline__ void NAME(float (&d)[ACC], const u32 (&a)[4], u64 db,          \
                                         int accumulate) {                                    \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\n"                        \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 "              \
                     "{" ACC_REGS "}, {%" #IA0 ", %" #IA1 ", %" #IA2 ", %" #IA3 "}, %" #IB     \
                     ", p, 1, 1, 1;\n}\n"                                                      \
                     : ACC_OUT(d)                                                             \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate)); \
    }
#else
#define ATT_WGMMA_PV_KMN(NAME, N, ACC, ACC_REGS, ACC_OUT, IA, IB, IP)                         \
    __device__ __forceinline__ void NAME(float (&d)[ACC], u64, u64, int) { CPS_WGMMA_MISSING(); }
#define ATT_WGMMA_PV_RMN(NAME, N, ACC, ACC_REGS, ACC_OUT, IA0, IA1, IA2, IA3, IB, IP)         \
    __device__ __forceinline__ void NAME(float (&d)[ACC], const u32 (&)[4], u64, int) {       \
        CPS_WGMMA_MISSING();                                                                  \
    }
#endif
ATT_WGMMA_PV_KMN(att_wgmma_m64n256_kmn, 256, 128, ATT_ACC128_REGS, ATT_ACC128_OUT, 128, 129, 130)
ATT_WGMMA_PV_RMN(att_wgmma_m64n256_rmn, 256, 128, ATT_ACC128_REGS, ATT_ACC128_OUT,
                 128, 129, 130, 131, 132, 133)
ATT_WGMMA_PV_KMN(att_wgmma_m64n128_kmn, 128, 64, ATT_ACC64_REGS, ATT_ACC64_OUT, 64, 65, 66)
ATT_WGMMA_PV_RMN(att_wgmma_m64n128_rmn, 128, 64, ATT_ACC64_REGS, ATT_ACC64_OUT,
                 64, 65, 66, 67, 68, 69)

__device__ __forceinline__ void att_st_f32(u32 addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;\n" :: "r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ float att_ld_f32(u32 addr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void att_st_u16(u32 addr, u32 v) {
    asm volatile("st.shared.u16 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void att_st_u8(u32 addr, u32 v) {
    asm volatile("st.shared.u8 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void att_st_s32(u32 addr, int v) {
    asm volatile("st.shared.s32 [%0], %1;\n" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ int att_ld_s32(u32 addr) {
    int v;
    asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

// A slot names a key only inside [0, num_slots): anything else (-1 padding, a negative
// or too large value that no host check caught) is masked and never dereferenced.
__device__ __forceinline__ bool att_slot_ok(int slot, int num_slots) {
    return (u32)slot < (u32)num_slots;
}

// A stored entry as a slot: itself where att_slot_ok, else -1 (masked).
__device__ __forceinline__ int att_slot_checked(int raw, int num_slots) {
    return att_slot_ok(raw, num_slots) ? raw : -1;
}

// Top-k entry j of a token's row irow, -1 past nk; not yet checked against the cache
// (att_slot_checked). The fp8 decode's producer calls it directly (indices always given):
// att_slot_raw's null-row branch cost its 80-register warps a spilled register.
__device__ __forceinline__ int att_entry(const int* __restrict__ irow, int nk, int j) {
    return j < nk ? __ldg(irow + j) : -1;
}

// Key j of this CTA's token as stored: the top-k entry, or a causal range; -1 past nk.
__device__ __forceinline__ int att_slot_raw(const int* __restrict__ irow, int rbase, int nk,
                                            int j) {
    return irow != nullptr ? att_entry(irow, nk, j) : (j < nk ? rbase + j : -1);
}

// Slot of key j (< nk) of this CTA's token; -1 when masked or out of range.
__device__ __forceinline__ int att_slot(const int* __restrict__ irow, int rbase, int nk, int j,
                                        int num_slots) {
    return att_slot_checked(att_slot_raw(irow, rbase, nk, j), num_slots);
}

// ---- warp specialization (the fp8 and MODEL1 kernels) ----------------------------------
// Two math warpgroups (threads 0..255: QK^T, softmax, PV, att_consume) and one producer
// warpgroup (threads 256..383; the fp8 decode two, 256..511) that reads the records,
// dequantizes them into the two K buffers and hands each over through named barriers, so
// dequantization overlaps the MMAs.
// Barrier 0 (__syncthreads) is never used after the roles split:
//   ATT_BAR_MATH       the 256 math threads (row max / sum exchange, Q ready);
//   ATT_BAR_FULL + b   K buffer b stored (producer arrives, math threads wait: both
//                      math warpgroups in att_consume, warpgroup 0 alone in the fp8
//                      decode, ATT_DEC_FULL_THREADS);
//   ATT_BAR_EMPTY + b  K buffer b read (math threads arrive, producer waits).
#define ATT_BAR_MATH 1
#define ATT_BAR_FULL 2
#define ATT_BAR_EMPTY 4
#define ATT_MATH_THREADS 256
static_assert(ATT_WS_THREADS == ATT_MATH_THREADS + 128, "two math warpgroups + one producer");
// The fp8 decode (cps_sparse_mla_fp8) runs two producer warpgroups: ATT_DEC_THREADS
// (#defined by the launcher) = the two math warpgroups + 256 producer threads; its FULL
// barriers count the producers and math warpgroup 0.
static_assert(ATT_DEC_THREADS == ATT_MATH_THREADS + 256, "two math + two producer warpgroups");
#define ATT_DEC_FULL_THREADS (256 + 128)

// Not the .aligned forms (bar.sync / bar.arrive): the producer reaches them after
// branches on its rows' validity, where a warp need not be converged.
__device__ __forceinline__ void att_bar_sync(int id, int n) {
    asm volatile("barrier.sync %0, %1;\n" :: "r"(id), "r"(n) : "memory");
}

__device__ __forceinline__ void att_bar_arrive(int id, int n) {
    asm volatile("barrier.arrive %0, %1;\n" :: "r"(id), "r"(n) : "memory");
}

// bar.sync over n threads; returns whether any of them passed pred != 0.
__device__ __forceinline__ int att_bar_or(int id, int n, int pred) {
    int r;
    asm volatile("{\n.reg .pred p, q;\nsetp.ne.s32 p, %1, 0;\n"
                 "bar.red.or.pred q, %2, %3, p;\nselp.s32 %0, 1, 0, q;\n}\n"
                 : "=r"(r) : "r"(pred), "r"(id), "r"(n) : "memory");
    return r;
}

// Register budget per warpgroup (setmaxnreg, sm_90a): the producer gives registers
// back to the CTA's pool, the math warpgroups (O alone is 128 fp32 a thread) take them.
// The pool is what the CTA was launched with, 384 x 168 (the cap of
// __launch_bounds__(384, 1), which ptxas uses: tests/test_kernel_compile.py checks);
// an increase the pool cannot cover blocks forever, so the split must fit it exactly.
#define ATT_PRODUCER_REGS 152
#define ATT_MATH_REGS 176
#define ATT_LAUNCH_REGS 168
static_assert(128 * ATT_PRODUCER_REGS + 256 * ATT_MATH_REGS <= ATT_WS_THREADS * ATT_LAUNCH_REGS,
              "setmaxnreg split exceeds the CTA's register pool");

// Eight records' codes of a producer warp in registers (one pass): lane l holds the
// 16-byte code chunk l (dims 16l..16l+15, scale group l / 8) of each of the 8 rows, so
// one warp load reads 512 contiguous bytes of one record.
struct AttPass {
    uint4 codes[8];
    float scales[8];
};

// Rows of a pass: row k's slot in lane k of `slots`; a masked row (-1) reads nothing and
// stores zeros (the branch is uniform over the warp).
__device__ __forceinline__ void att_load_pass(AttPass& r, const u8* __restrict__ kv, int slots,
                                              int lane) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int slot = __shfl_sync(0xffffffffu, slots, k);
        if (slot >= 0) {
            const u8* rec = kv + (size_t)slot * ATT_REC_BYTES;
            r.codes[k] = __ldg(reinterpret_cast<const uint4*>(rec) + lane);
            r.scales[k] = __ldg(reinterpret_cast<const float*>(rec + 512) + (lane >> 3));
        } else {
            r.codes[k] = make_uint4(0u, 0u, 0u, 0u);
            r.scales[k] = 0.f;
        }
    }
}

// Registers -> bf16 rows row0..row0+7 of the tile at sk (row0 a multiple of 8, so row
// row0 + k has swizzle k): chunk l lies in 64-dim block l / 4, 16-byte chunks 2 (l % 4)
// and 2 (l % 4) + 1 of the swizzled row. Lanes from LANES on hold no codes and store
// nothing (MODEL1: 28 chunks of 448 codes; the block lane 28 would write is the RoPE
// block). Chunk (2q) ^ k of row k, q = l % 4, is 2 (q ^ (k >> 1)) + (k & 1) and its pair
// (2q + 1) ^ k is 2 (q ^ (k >> 1)) + 1 - (k & 1): four lane-dependent bases (q ^ j, j =
// k >> 1) and immediates, where ptxas otherwise held the 16 chunk offsets of the pass in
// registers across the tile loop (an 80-register producer spilled).
// SWAP_ODD (the fp8 decode): no bank conflicts. Lanes of odd column blocks (bit 2 of the
// lane) store their second 16-byte chunk first, so the 8 lanes of a quarter-warp (blocks
// 2p, 2p + 1) write 8 different chunk positions of their row where they wrote 4 twice;
// they dequantize their code words in swapped order (4 selects a row), and the second
// chunk's address is the first's with bit 4 flipped (the row base is 32-byte aligned).
template <int LANES = 32, bool SWAP_ODD = false>
__device__ __forceinline__ void att_store_pass(const AttPass& r, u32 sk, int row0, int lane) {
    if (LANES < 32 && lane >= LANES) return;
    const int q = lane & 3;
    const bool odd = SWAP_ODD && ((lane >> 2) & 1);
    const u32 blk = sk + row0 * 128 + (lane >> 2) * ATT_BLK + (odd ? 16u : 0u);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const uint4 c = r.codes[k];
        uint4 a, b;
        att_dequant4(odd ? c.z : c.x, r.scales[k], a.x, a.y);
        att_dequant4(odd ? c.w : c.y, r.scales[k], a.z, a.w);
        att_dequant4(odd ? c.x : c.z, r.scales[k], b.x, b.y);
        att_dequant4(odd ? c.y : c.w, r.scales[k], b.z, b.w);
        const u32 row = blk + ((q ^ (k >> 1)) << 5) + k * 128;
        if constexpr (SWAP_ODD) {
            const u32 first = (k & 1) ? row ^ 16u : row;
            att_st_v4(first, a);
            att_st_v4(first ^ 16u, b);
        } else {
            att_st_v4(row + ((k & 1) << 4), a);
            att_st_v4(row + ((1 - (k & 1)) << 4), b);
        }
    }
}

// The 64 bf16 RoPE values (block 8) of the warp's 8 rows by cp.async (slot of row row0 + k
// in lane k); zero-filled and unread when masked.
__device__ __forceinline__ void att_copy_rope(const u8* __restrict__ kv, int slots, u32 sk,
                                              int row0, int lane) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const int idx = lane + 32 * j, k = idx >> 3, c = idx & 7;
        const int slot = __shfl_sync(0xffffffffu, slots, k);
        const bool v = slot >= 0;
        const u8* rope = kv + (v ? (size_t)slot * ATT_REC_BYTES + 528 : (size_t)0);
        const int row = row0 + k;
        cps_cp_async16(sk + row * 128 + 8 * ATT_BLK + ((c ^ (row & 7)) << 4), rope + 16 * c, v);
    }
}

// Pull one record (656 bytes, up to 7 lines of 128) into L2 ahead of its load, four
// lanes sharing it: part q (0..3) touches bytes 256 q and 256 q + 128, clamped to the
// record's last byte (655): 0..128, 256..384, 512..640 and 655.
__device__ __forceinline__ void att_prefetch_record(const u8* __restrict__ kv, int slot,
                                                    int part) {
    if (slot < 0) return;
    const u8* rec = kv + (size_t)slot * ATT_REC_BYTES;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int off = min(128 * (2 * part + k), ATT_REC_BYTES - 1);
        asm volatile("prefetch.global.L2 [%0];\n" :: "l"(rec + off));
    }
}

// The fp8 decode's two producer warpgroups (threads p = 0..255 of them): warp pw (0..7)
// owns rows 8 pw..8 pw+7 of every tile of the share, one pass of 8 rows a tile: the pass
// of tile t + 1 is loaded as soon as tile t's is dequantized and stored, so it is in
// flight while the warp hands tile t over and waits for the next buffer. Records two
// tiles ahead are pulled into L2. Lane l holds the slot of row 8 pw + l % 8. The top-k
// entries are loaded three tiles ahead into a register queue (tiles t + 1, t + 2 held,
// t + 3 in flight): loaded in the tile that used them, their wait was a third of the
// producer's stall samples (Nsight, B=128). Each warp writes its 8 bits of the tile's
// key mask (a u64 at ATT_OFF_VALID + 8 buf, bit r: row r valid) before FULL, which it
// shares with math warpgroup 0 only (the fp8 decode schedule). Why two warpgroups of 8
// rows a warp and not one of 16: the one-warpgroup producer was the kernel's bound at
// B=128 (its instruction stream, one warp a scheduler: with half the rows a warp the
// kernel ran 20% faster), and two warps a scheduler overlap each other's waits.
__device__ __forceinline__ void att_produce_fp8(const u8* __restrict__ kv,
                                                const int* __restrict__ irow, int nk_end,
                                                int num_slots, int t_first, int t_end,
                                                u32 base, int p) {
    const int lane = p & 31, pw = p >> 5, row0 = pw * 8, mine = row0 + (lane & 7);
    AttPass a;
    // (keys past nk_end, so every tile past t_end, are -1)
    int slot = att_slot_checked(att_entry(irow, nk_end, t_first * 64 + mine), num_slots);
    int raw1 = att_entry(irow, nk_end, (t_first + 1) * 64 + mine);
    int raw2 = att_entry(irow, nk_end, (t_first + 2) * 64 + mine);
    att_load_pass(a, kv, slot, lane);
    // The loop pulls tile t + 2's records into L2; tile t_first + 1's are pulled here, or
    // a short split-KV share (two tiles at B=1) loads them from HBM after its first tile.
    att_prefetch_record(kv, att_slot_checked(raw1, num_slots), lane >> 3);
    for (int t = t_first; t < t_end; ++t) {
        const int buf = (t - t_first) & 1;
        const u32 sk = base + ATT_OFF_K + buf * ATT_TILE;
        const int raw3 = att_entry(irow, nk_end, (t + 3) * 64 + mine);
        if (t - t_first >= 2) att_bar_sync(ATT_BAR_EMPTY + buf, ATT_DEC_THREADS);
        att_copy_rope(kv, slot, sk, row0, lane);
        {   // bits 8 pw .. 8 pw + 7 of the tile's key mask (lanes l, l + 8, ... agree)
            const u32 bits = __ballot_sync(0xffffffffu, slot >= 0) & 0xffu;
            if (lane == 0) att_st_u8(base + ATT_OFF_VALID + buf * 8 + pw, bits);
        }
        att_store_pass<32, true>(a, sk, row0, lane);
        // (the queue's slots checked where used: not live across the dequantization)
        att_prefetch_record(kv, att_slot_checked(raw2, num_slots), lane >> 3);
        const int next = att_slot_checked(raw1, num_slots);
        att_load_pass(a, kv, next, lane);
        cps_cp_async_wait_all();
        cps_fence_proxy_async();                  // stores -> the async proxy (wgmma)
        att_bar_arrive(ATT_BAR_FULL + buf, ATT_DEC_FULL_THREADS);
        slot = next;
        raw1 = raw2;
        raw2 = raw3;
    }
}

// Issue S[64 heads x 32 keys of warpgroup wg] = Q K^T as KSTEPS wgmma m64n32k16 (async):
// 36 over the 576 dims of fp8_ds_mla / the dense rows, 32 over MODEL1's 512.
template <int KSTEPS>
__device__ __forceinline__ void att_qk_wgmma(float (&s)[16], u32 sq, u32 sk, int wg) {
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    cps_fence_regs(s);
    cps_wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KSTEPS; ++ks) {
        const u32 off = (ks >> 2) * ATT_BLK + (ks & 3) * 32;
        att_wgmma_m64n32_kk(s, cps_wgmma_desc(sq + off, 16, 1024),
                            cps_wgmma_desc(sk + wg * 4096 + off, 16, 1024), 1);
    }
    cps_wgmma_commit();
}

// This CTA's work: token, first head, heads, and its share [t_first, t_end) of the
// token's key tiles (split-KV: keys past nk_end are masked at the load, so nothing of
// another split is read). The token's keys: with indices, its first row_len[t] top-k
// entries (FlashMLA's topk_length, clamped to [0, topk]; all of them when row_len is
// nullptr); without, the causal range [row_start[t], + row_len[t]).
struct AttShare {
    const int* irow;      // top-k row of the token, or nullptr for a causal range
    int rbase, nk, tok, h0, nh, split, t_first, t_end, nk_end;
};

__device__ __forceinline__ AttShare att_share(const int* __restrict__ indices, int topk,
                                              const int* __restrict__ row_start,
                                              const int* __restrict__ row_len, int H,
                                              int splits) {
    AttShare w;
    const int groups = (H + 63) >> 6;
    const int unit = blockIdx.x / splits;          // (token, head group)
    w.split = blockIdx.x - unit * splits;          // which share of the token's keys
    w.tok = unit / groups;
    w.h0 = (unit - w.tok * groups) * 64;
    w.nh = min(64, H - w.h0);
    w.irow = nullptr;
    w.rbase = 0;
    if (indices != nullptr) {
        w.irow = indices + (size_t)w.tok * topk;
        w.nk = row_len == nullptr ? topk : min(max(__ldg(row_len + w.tok), 0), topk);
    } else {
        w.rbase = row_start[w.tok];
        w.nk = row_len[w.tok];
    }
    const int tiles_all = (w.nk + 63) >> 6;
    const int per_split = (tiles_all + splits - 1) / splits;
    w.t_first = min(tiles_all, w.split * per_split);
    w.t_end = min(tiles_all, w.t_first + per_split);
    w.nk_end = min(w.nk, w.t_end * 64);
    return w;
}

// Q rows of this CTA -> bf16 shared [64 x D] (rows past nh zero), by the 256 math
// threads; the caller fences and syncs them before the first QK^T. The loads of a
// group (half the thread's chunks) are all issued before any store: a shared store is
// an asm with a memory clobber, which no global load may pass, so loads interleaved
// with stores would wait for each other one round trip at a time.
template <int D>
__device__ __forceinline__ void att_load_q(const void* __restrict__ q, int q_fmt,
                                           const AttShare& w, int H, u32 sq, int tid) {
    constexpr int CHUNKS = D / 8;                  // 16-byte bf16 chunks of a row
    constexpr int ITERS = 64 * CHUNKS / ATT_MATH_THREADS;
    constexpr int GROUP = ITERS / 2;
    static_assert(64 * CHUNKS % ATT_MATH_THREADS == 0 && ITERS % 2 == 0, "Q chunks per thread");
#pragma unroll
    for (int g0 = 0; g0 < ITERS; g0 += GROUP) {
        uint4 lo[GROUP], hi[GROUP];                // 16-bit: lo; fp32: lo, hi (8 floats)
#pragma unroll
        for (int k = 0; k < GROUP; ++k) {
            const int i = tid + (g0 + k) * ATT_MATH_THREADS;
            const int r = i / CHUNKS, c = i - r * CHUNKS;
            lo[k] = hi[k] = make_uint4(0u, 0u, 0u, 0u);
            if (r < w.nh) {
                const size_t off = ((size_t)w.tok * H + w.h0 + r) * D + (size_t)c * 8;
                if (q_fmt != ATT_FMT_F32) {
                    lo[k] = __ldg(reinterpret_cast<const uint4*>(
                        reinterpret_cast<const u16*>(q) + off));
                } else {
                    const uint4* p = reinterpret_cast<const uint4*>(
                        reinterpret_cast<const float*>(q) + off);
                    lo[k] = __ldg(p);
                    hi[k] = __ldg(p + 1);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < GROUP; ++k) {
            const int i = tid + (g0 + k) * ATT_MATH_THREADS;
            const int r = i / CHUNKS, c = i - r * CHUNKS;
            const uint4 v = q_fmt == ATT_FMT_BF16 ? lo[k]          // already the MMA's form
                : q_fmt == ATT_FMT_F16
                ? make_uint4(att_f16x2_to_bf16x2(lo[k].x), att_f16x2_to_bf16x2(lo[k].y),
                             att_f16x2_to_bf16x2(lo[k].z), att_f16x2_to_bf16x2(lo[k].w))
                : make_uint4(att_pack_bf16(__uint_as_float(lo[k].x), __uint_as_float(lo[k].y)),
                             att_pack_bf16(__uint_as_float(lo[k].z), __uint_as_float(lo[k].w)),
                             att_pack_bf16(__uint_as_float(hi[k].x), __uint_as_float(hi[k].y)),
                             att_pack_bf16(__uint_as_float(hi[k].z), __uint_as_float(hi[k].w)));
            att_st_v4(sq + (c >> 3) * ATT_BLK + r * 128 + (((c & 7) ^ (r & 7)) << 4), v);
        }
    }
}

// Running state of a math thread: O (heads r0, r1 of its warp, 256 output columns of
// its warpgroup), row max and sum.
struct AttRows {
    float o[128];
    float m0, m1, l0, l1;
};

// The row maxima over the 4 threads of a quad (lanes 4g..4g+3 hold one row's columns).
__device__ __forceinline__ void att_quad_max(float& mx0, float& mx1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
}

// One key tile after S = Q K^T of it is in s (valid flags at vld): mask, online
// softmax in base 2 (row max shared between the warpgroups through s_max, P through
// sp), O = alpha O + P V with V the first 512 columns of the tile at sk.
__device__ __forceinline__ void att_softmax_pv(float (&s)[16], AttRows& st, u32 vld, u32 s_max,
                                               u32 sp, u32 sk, float scale_log2, int wg,
                                               int r0, int r1, int g, int t4) {
    float mx0 = ATT_NEG_INF, mx1 = ATT_NEG_INF;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int key = wg * 32 + 8 * j + 2 * t4;
        const bool va = att_ld_s32(vld + 4 * key) != 0;
        const bool vb = att_ld_s32(vld + 4 * key + 4) != 0;
        s[4 * j + 0] = va ? s[4 * j + 0] * scale_log2 : ATT_NEG_INF;
        s[4 * j + 1] = vb ? s[4 * j + 1] * scale_log2 : ATT_NEG_INF;
        s[4 * j + 2] = va ? s[4 * j + 2] * scale_log2 : ATT_NEG_INF;
        s[4 * j + 3] = vb ? s[4 * j + 3] * scale_log2 : ATT_NEG_INF;
        mx0 = fmaxf(mx0, fmaxf(s[4 * j + 0], s[4 * j + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    att_quad_max(mx0, mx1);
    if (t4 == 0) {
        att_st_f32(s_max + 4 * (wg * 64 + r0), mx0);
        att_st_f32(s_max + 4 * (wg * 64 + r1), mx1);
    }
    att_bar_sync(ATT_BAR_MATH, ATT_MATH_THREADS);
    mx0 = fmaxf(mx0, att_ld_f32(s_max + 4 * ((wg ^ 1) * 64 + r0)));
    mx1 = fmaxf(mx1, att_ld_f32(s_max + 4 * ((wg ^ 1) * 64 + r1)));
    const float mn0 = fmaxf(st.m0, mx0), mn1 = fmaxf(st.m1, mx1);
    const float ms0 = mn0 == ATT_NEG_INF ? 0.f : mn0;
    const float ms1 = mn1 == ATT_NEG_INF ? 0.f : mn1;
    const float al0 = att_ex2(st.m0 - ms0), al1 = att_ex2(st.m1 - ms1);   // 0 when m was -inf
    st.m0 = mn0;
    st.m1 = mn1;
    float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float p0 = att_ex2(s[4 * j + 0] - ms0), p1 = att_ex2(s[4 * j + 1] - ms0);
        const float p2 = att_ex2(s[4 * j + 2] - ms1), p3 = att_ex2(s[4 * j + 3] - ms1);
        ps0 += p0 + p1;
        ps1 += p2 + p3;
        const int cc = 4 * wg + j;
        att_st_b32(sp + r0 * 128 + ((cc ^ g) << 4) + 4 * t4, att_pack_bf16(p0, p1));
        att_st_b32(sp + r1 * 128 + ((cc ^ g) << 4) + 4 * t4, att_pack_bf16(p2, p3));
    }
    st.l0 = st.l0 * al0 + ps0;
    st.l1 = st.l1 * al1 + ps1;
    cps_fence_proxy_async();                  // P -> the async proxy (wgmma)
    // The barrier also tells whether any row's running max moved (alpha != 1);
    // if none did, the rescale of O is skipped.
    const int rescale = att_bar_or(ATT_BAR_MATH, ATT_MATH_THREADS, al0 != 1.f || al1 != 1.f);
    if (rescale) {
#pragma unroll
        for (int n = 0; n < 32; ++n) {
            st.o[4 * n + 0] *= al0;
            st.o[4 * n + 1] *= al0;
            st.o[4 * n + 2] *= al1;
            st.o[4 * n + 3] *= al1;
        }
    }
    cps_fence_regs(st.o);
    cps_wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        att_wgmma_m64n256_kmn(st.o, cps_wgmma_desc(sp + ks * 32, 16, 1024),
                              cps_wgmma_desc(sk + wg * 4 * ATT_BLK + ks * 2048, ATT_BLK, 1024),
                              1);
    }
    cps_wgmma_commit();
    cps_wgmma_wait<0>();
    cps_fence_regs(st.o);
}

// Normalise and write out [T, H, d_v] and lse [T, H] (natural log), or with splits > 1
// this split's normalised partial rows [T, H, splits, d_v] and, right after them in the
// same scratch buffer (one allocation), the partial lse [T, H, splits] for
// cps_mla_combine. L == 0: no valid key (out 0, lse -inf); a NaN score makes L NaN,
// and NaN flows into out and lse (never the "no valid key" marker). With an attention
// sink [H] (or nullptr; splits == 1 here, else cps_mla_combine applies it) out is
// scaled by att_sink_factor; lse is not. out is float32, bf16 or f16 (OUT, one of the
// ATT_FMT_* Python defines), rounded once from the float32 row; the partials and lse are
// float32.
__device__ __forceinline__ float att_sink_factor(const float* __restrict__ sink, int h,
                                                 float row_lse) {
    // exp(lse) / (exp(lse) + exp(sink)): +inf sink -> 0, -inf -> 1. An empty row (lse
    // -inf) keeps out = 0: factor 1, not the NaN of -inf - -inf.
    if (sink == nullptr || row_lse == ATT_NEG_INF) return 1.f;
    return 1.f / (1.f + expf(__ldg(sink + h) - row_lse));
}

// A 16-bit row (splits == 1, OUT bf16 or f16) from a thread's fragment: its
// column pairs (8 n + 2 t4, + 1) of each 8-column block n, scaled by inv. The four
// threads of a quad regroup the pairs of blocks 2m and 2m + 1 by two shuffles, so each
// stores 4 adjacent values (8 bytes; a quad's store covers one 32-byte sector of the
// row, as the float32 rows' float2 stores do): thread t4 gets the pairs of threads
// 2 (t4 & 1) and 2 (t4 & 1) + 1 of block 2m + (t4 >> 1). (4-byte stores of single pairs
// would issue as many store instructions as float32 rows, for half the bytes.) Rows of
// d_v % 4 == 2 are not 8-byte aligned: one pair a store there.
template <int FRAG, int OUT>
__device__ __forceinline__ void att_store_row16(const float (&o)[128], u16* __restrict__ row,
                                                float inv, int col0, int d_v, bool mine,
                                                int t4) {
    const int lane = threadIdx.x & 31;
    const int src1 = (lane & ~3) | ((0x3021 >> (4 * t4)) & 3);   // t4 0..3 <- 1, 2, 0, 3
    const int src2 = (lane & ~3) | ((0x2130 >> (4 * t4)) & 3);   // t4 0..3 <- 0, 3, 1, 2
    if ((d_v & 3) == 0) {
#pragma unroll
        for (int m = 0; m < 16; ++m) {
            const u32 a = att_pack_out16<OUT>(o[8 * m + FRAG] * inv, o[8 * m + FRAG + 1] * inv);
            const u32 b = att_pack_out16<OUT>(o[8 * m + 4 + FRAG] * inv,
                                              o[8 * m + 5 + FRAG] * inv);
            const u32 s1 = __shfl_sync(0xffffffffu, t4 == 0 ? b : a, src1);
            const u32 s2 = __shfl_sync(0xffffffffu, t4 == 3 ? a : b, src2);
            const int c = col0 + 16 * m + 4 * t4;
            if (mine && c < d_v)
                *reinterpret_cast<uint2*>(row + c) =
                    t4 == 0 ? make_uint2(a, s1) : t4 == 3 ? make_uint2(s2, b) : make_uint2(s1, s2);
        }
    } else {
#pragma unroll
        for (int n = 0; n < 32; ++n) {
            const int c = col0 + 8 * n + 2 * t4;
            if (mine && c < d_v)
                *reinterpret_cast<u32*>(row + c) =
                    att_pack_out16<OUT>(o[4 * n + FRAG] * inv, o[4 * n + FRAG + 1] * inv);
        }
    }
}

template <int OUT>
__device__ __forceinline__ void att_write_rows(AttRows& st, const AttShare& w, u32 s_l,
                                               void* __restrict__ out, float* __restrict__ lse,
                                               float* __restrict__ part_out, int H, int d_v,
                                               int splits, int wg, int r0, int r1, int t4,
                                               const float* __restrict__ sink = nullptr) {
    float l0 = st.l0, l1 = st.l1;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (t4 == 0) {
        att_st_f32(s_l + 4 * (wg * 64 + r0), l0);
        att_st_f32(s_l + 4 * (wg * 64 + r1), l1);
    }
    att_bar_sync(ATT_BAR_MATH, ATT_MATH_THREADS);
    const float L0 = att_ld_f32(s_l + 4 * r0) + att_ld_f32(s_l + 4 * (64 + r0));
    const float L1 = att_ld_f32(s_l + 4 * r1) + att_ld_f32(s_l + 4 * (64 + r1));
    const float lse0 = L0 == 0.f ? ATT_NEG_INF : st.m0 * ATT_LN2 + logf(L0);
    const float lse1 = L1 == 0.f ? ATT_NEG_INF : st.m1 * ATT_LN2 + logf(L1);
    float inv0 = L0 == 0.f ? 0.f : 1.f / L0;
    float inv1 = L1 == 0.f ? 0.f : 1.f / L1;
    if (sink != nullptr && splits == 1) {
        if (r0 < w.nh) inv0 *= att_sink_factor(sink, w.h0 + r0, lse0);
        if (r1 < w.nh) inv1 *= att_sink_factor(sink, w.h0 + r1, lse1);
    }
    const int groups = (H + 63) >> 6;
    const size_t part_rows = (size_t)(gridDim.x / splits / groups) * H * splits;
    float* const dst_lse = splits == 1 ? lse : part_out + part_rows * d_v;
    // A 16-bit-out kernel runs unsplit only (the launcher's plan: split, the float32
    // kernel writes the partials and the merge of the out's format the out), so it has
    // one epilogue: a kernel holding both ran its whole loop 4-13% slower (ptxas).
    if constexpr (OUT != ATT_FMT_F32) {
        u16* const out16 = reinterpret_cast<u16*>(out);
        att_store_row16<0, OUT>(st.o, out16 + ((size_t)w.tok * H + w.h0 + r0) * d_v, inv0,
                                wg * 256, d_v, r0 < w.nh, t4);
        att_store_row16<2, OUT>(st.o, out16 + ((size_t)w.tok * H + w.h0 + r1) * d_v, inv1,
                                wg * 256, d_v, r1 < w.nh, t4);
    } else {
        float* const dst = splits == 1 ? reinterpret_cast<float*>(out) : part_out;
        float* out0 = dst + (((size_t)w.tok * H + w.h0 + r0) * splits + w.split) * d_v;
        float* out1 = dst + (((size_t)w.tok * H + w.h0 + r1) * splits + w.split) * d_v;
#pragma unroll
        for (int n = 0; n < 32; ++n) {
            const int c = wg * 256 + 8 * n + 2 * t4;
            if (c < d_v) {
                if (r0 < w.nh)
                    *reinterpret_cast<float2*>(out0 + c) = make_float2(st.o[4 * n] * inv0,
                                                                       st.o[4 * n + 1] * inv0);
                if (r1 < w.nh)
                    *reinterpret_cast<float2*>(out1 + c) = make_float2(st.o[4 * n + 2] * inv1,
                                                                       st.o[4 * n + 3] * inv1);
            }
        }
    }
    if (wg == 0 && t4 == 0) {
        float* lrow = dst_lse + ((size_t)w.tok * H + w.h0) * splits + w.split;
        if (r0 < w.nh) lrow[r0 * splits] = lse0;
        if (r1 < w.nh) lrow[r1 * splits] = lse1;
    }
}

__device__ __forceinline__ void att_rows_init(AttRows& st) {
#pragma unroll
    for (int i = 0; i < 128; ++i) st.o[i] = 0.f;
    st.m0 = ATT_NEG_INF;
    st.m1 = ATT_NEG_INF;
    st.l0 = 0.f;
    st.l1 = 0.f;
}

#define ATT_PARAMS                                                                          \
    const void* __restrict__ q, int q_fmt, const u8* __restrict__ kv,                       \
        const int* __restrict__ indices, int topk, int num_slots,                           \
        const int* __restrict__ row_start, const int* __restrict__ row_len,                 \
        void* __restrict__ out, float* __restrict__ lse, int H, int d_v, float scale_log2,  \
        int splits, float* __restrict__ part_out, const float* __restrict__ sink

// What every math thread of the warp-specialized kernels does first: its share of Q to
// shared memory, visible to wgmma and to the other math warpgroup.
template <int D>
__device__ __forceinline__ void att_math_start(const void* __restrict__ q, int q_fmt,
                                               const AttShare& w, int H, u32 sq, int tid) {
    att_load_q<D>(q, q_fmt, w, H, sq, tid);
    cps_fence_proxy_async();
    att_bar_sync(ATT_BAR_MATH, ATT_MATH_THREADS);
}

// The math warpgroups of the MODEL1 kernel (threads 0..255): Q (D wide) to shared
// memory, then for each tile the producer filled: QK^T over D / 16 k-steps, softmax, PV;
// then the rows (scaled by the sink, if any).
template <int D, int OUT>
__device__ __forceinline__ void att_consume(const void* __restrict__ q, int q_fmt,
                                            const AttShare& w, int H, u32 base,
                                            float scale_log2, void* __restrict__ out,
                                            float* __restrict__ lse,
                                            float* __restrict__ part_out, int d_v, int splits,
                                            const float* __restrict__ sink, int tid) {
    const u32 sq = base + ATT_OFF_Q, sp = base + ATT_OFF_P;
    const u32 s_max = base + ATT_OFF_MAX, s_valid = base + ATT_OFF_VALID;
    cps_setmaxnreg_inc<ATT_MATH_REGS>();
    const int lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wi = warp & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const int r0 = wi * 16 + g, r1 = r0 + 8;
    att_math_start<D>(q, q_fmt, w, H, sq, tid);
    AttRows st;
    att_rows_init(st);
    for (int it = w.t_first; it < w.t_end; ++it) {
        const int buf = (it - w.t_first) & 1;
        const u32 sk = base + ATT_OFF_K + buf * ATT_TILE;
        const u32 vld = s_valid + buf * 256;
        att_bar_sync(ATT_BAR_FULL + buf, ATT_WS_THREADS);
        // Whether any key of the tile is valid (this thread's 8 keys, then all 64).
        int mine = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int key = wg * 32 + 8 * j + 2 * t4;
            mine |= att_ld_s32(vld + 4 * key) | att_ld_s32(vld + 4 * key + 4);
        }
        if (att_bar_or(ATT_BAR_MATH, ATT_MATH_THREADS, mine)) {
            float s[16];
            att_qk_wgmma<D / 16>(s, sq, sk, wg);
            cps_wgmma_wait<0>();
            cps_fence_regs(s);
            att_softmax_pv(s, st, vld, s_max, sp, sk, scale_log2, wg, r0, r1, g, t4);
        }
        if (it + 2 < w.t_end) att_bar_arrive(ATT_BAR_EMPTY + buf, ATT_WS_THREADS);
    }
    att_write_rows<OUT>(st, w, s_max, out, lse, part_out, H, d_v, splits, wg, r0, r1, t4,
                        sink);
}


// ---- the ping-pong kernel (dense bf16 rows: prefill) ----------------------------------
// FlashMLA's sparse-prefill schedule. A producer warpgroup gathers the rows of two tiles
// at a time (a pair: tile 2p into K buffer 0, 2p + 1 into buffer 1) by 16-byte cp.async,
// each buffer in two halves (L = blocks 0..3, the value columns 0..255; R = blocks 4..8);
// math warpgroup w owns buffer w: S = Q K^T over its whole tile by wgmma m64n64k16 (one
// product per warpgroup and pair instead of two m64n32 halves: Q is read from shared
// memory once per 64 keys, not per 32), its softmax, and O[:, 256w..] += P V for both
// tiles of the pair: its own P straight from registers (wgmma with A in registers), the
// other warpgroup's P through shared memory. The row max runs as a chain: warpgroup 0
// takes the max with its tile and hands it over (s_max), warpgroup 1 takes the max with
// its tile and hands the pair's max back, warpgroup 0 rescales its P and O to it. So
// warpgroup 1's QK^T overlaps warpgroup 0's softmax, and warpgroup 0 issues the next
// pair's QK^T while its P V products run.
//   FULL[b][h] (mbarriers, 128 producer arrivals by cp.async completion): half h of
//     buffer b holds the pair's rows; VALID[p & 1]: the pair's key masks are written
//     (one 64-bit mask a tile, bit r = row r valid; double buffered by pair parity, so
//     warpgroup 0 can read the next pair's while warpgroup 1 still reads this one's).
//   ATT_PP_BAR_EMPTY + 2b + h (named, producer syncs): the warpgroup that reads half h
//     of buffer b last is done with it: L0 and L1 warpgroup 0, R0 and R1 warpgroup 1.
//   M0 / M1 / S0 / S1 (named, between the math warpgroups): a row max or a P handed over.
// A pair with no valid key at all (the -1 padding of short rows) is skipped by all three
// warpgroups (the producer copies nothing, the barriers keep their rhythm). Masked keys
// are zero-filled (P = 0 times finite values) and get S = -inf; the running max starts at
// -1e30, not -inf, so an all-masked tile gives exp2(-inf) = 0, never -inf - -inf.
#define ATT_PP_BAR_EMPTY 2          // + 2 * buffer + half
#define ATT_PP_BAR_M0 6
#define ATT_PP_BAR_M1 7
#define ATT_PP_BAR_S0 8
#define ATT_PP_BAR_S1 9
#define ATT_PP_BAR_PRODUCER 10      // the producer warpgroup alone
#define ATT_PP_OFF_S0 (ATT_OFF_K + 8 * ATT_BLK)   // K0's RoPE block, free after the QK^T
#define ATT_PP_OFF_S1 ATT_OFF_P
#define ATT_PP_OFF_MBAR (ATT_OFF_MAX + 256)       // FULL[2][2], VALID[2] (8 bytes each)
#define ATT_PP_OFF_MASKS ATT_OFF_VALID            // u64 [pair & 1][buffer]
#define ATT_PP_MAX_INIT (-1e30f)
#define ATT_PP_PRODUCER_REGS 72
#define ATT_PP_MATH_REGS 216
static_assert(128 * ATT_PP_PRODUCER_REGS + 256 * ATT_PP_MATH_REGS <=
                  ATT_WS_THREADS * ATT_LAUNCH_REGS,
              "setmaxnreg split exceeds the CTA's register pool");
static_assert(ATT_PP_OFF_MBAR + 48 <= ATT_OFF_L && ATT_PP_OFF_MASKS + 32 <= ATT_SMEM_USED,
              "ping-pong barriers and masks fit the row-max and validity areas");

__device__ __forceinline__ uint2 att_ld_v2(u32 addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr) : "memory");
    return v;
}

// Whether the pair at `masks` (two 64-bit tile masks) has any valid key.
__device__ __forceinline__ int att_pp_any(u32 masks) {
    const uint2 a = att_ld_v2(masks), b = att_ld_v2(masks + 8);
    return (a.x | a.y | b.x | b.y) != 0u;
}

// Producer rows: warp pw owns rows 16 pw..16 pw+15 of each tile, row 16 pw + 4 r + lane / 8
// in step r; thread sub = lane % 8 of the row's 8 copies 16 bytes of each 128-byte block
// row (a warp instruction: 4 rows x 128 bytes).
__device__ __forceinline__ int att_pp_row(int pt, int r) {
    return 16 * (pt >> 5) + 4 * r + ((pt >> 3) & 3);
}

// This warp's 16 bits of a tile mask (bit 4 r + i: row 16 pw + 4 r + i valid), from the
// slots of its four steps (the 8 lanes of a row agree: lanes 0, 8, 16, 24 speak for them).
__device__ __forceinline__ u32 att_pp_warp_mask(const int (&slot)[4]) {
    u32 m = 0;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const u32 b = __ballot_sync(0xffffffffu, slot[r] >= 0);
        m |= ((b & 1u) | ((b >> 7) & 2u) | ((b >> 14) & 4u) | ((b >> 21) & 8u)) << (4 * r);
    }
    return m;
}

// The producer thread's four slots of tiles t0 and t0 + 1 (-1: masked, nothing to read).
// All eight index loads are issued before any is tested: att_slot's load-then-check
// compiles to one round trip per key (a branch around each load), eight in a row. The
// address is clamped into [0, nk_end) instead (a valid entry of the row), so the loads
// need no branch, and keys past nk_end are masked after.
__device__ __forceinline__ void att_pp_slots(int (&s0)[4], int (&s1)[4], const AttShare& w,
                                             int t0, int num_slots, int pt) {
    int v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int j = t0 * 64 + (i >> 2) * 64 + att_pp_row(pt, i & 3);
        v[i] = w.irow != nullptr ? 0 : w.rbase + j;
    }
    if (w.irow != nullptr && w.nk_end > 0) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int j = t0 * 64 + (i >> 2) * 64 + att_pp_row(pt, i & 3);
            v[i] = __ldg(w.irow + min(j, w.nk_end - 1));
        }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int j = t0 * 64 + (i >> 2) * 64 + att_pp_row(pt, i & 3);
        const int slot = j < w.nk_end ? att_slot_checked(v[i], num_slots) : -1;
        if (i < 4) s0[i] = slot;
        else s1[i - 4] = slot;
    }
}

// Blocks [B0, B1) of the producer thread's four rows of one tile.
template <int B0, int B1>
__device__ __forceinline__ void att_pp_copy(u32 sk, const u8* __restrict__ kv,
                                            const int (&slot)[4], int pt, int sub) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int row = att_pp_row(pt, r);
        const bool v = slot[r] >= 0;
        const u8* src = kv + (v ? (size_t)slot[r] * ATT_ROW_BYTES : (size_t)0) + sub * 16;
        const u32 dst = sk + row * 128 + ((sub ^ (row & 7)) << 4);
#pragma unroll
        for (int b = B0; b < B1; ++b) cps_cp_async16(dst + b * ATT_BLK, src + b * 128, v);
    }
}

// The producer warpgroup (pt = thread 0..127 of it).
__device__ __forceinline__ void att_produce_bf16(const u8* __restrict__ kv, const AttShare& w,
                                                 int num_slots, u32 base, int pt) {
    const int sub = pt & 7;
    const u32 k0 = base + ATT_OFF_K, k1 = k0 + ATT_TILE;
    const u32 mbar = base + ATT_PP_OFF_MBAR, masks = base + ATT_PP_OFF_MASKS;
    const int pairs = (w.t_end - w.t_first + 1) >> 1;
    // The slots of a pair are loaded one pair ahead: their latency (an index read from
    // global memory, then the copies' addresses) overlaps the previous pair's EMPTY waits
    // instead of stalling every pair's masks and copies. Keys past nk_end read nothing.
    int s0[4], s1[4];
    att_pp_slots(s0, s1, w, w.t_first, num_slots, pt);
    for (int p = 0; p < pairs; ++p) {
        const int t0 = w.t_first + 2 * p, par = p & 1;
        const u32 m0 = att_pp_warp_mask(s0), m1 = att_pp_warp_mask(s1);
        if ((pt & 31) == 0) {
            att_st_u16(masks + par * 16 + 2 * (pt >> 5), m0);
            att_st_u16(masks + par * 16 + 8 + 2 * (pt >> 5), m1);
        }
        const int any = att_bar_or(ATT_PP_BAR_PRODUCER, 128, (m0 | m1) != 0u);
        cps_mbar_arrive(mbar + 32 + 8 * par);
        int n0[4], n1[4];
        att_pp_slots(n0, n1, w, t0 + 2, num_slots, pt);
        // In the order the math warpgroups free the halves: L0, R1, R0, L1.
        if (p > 0) att_bar_sync(ATT_PP_BAR_EMPTY + 0, 256);
        if (any) att_pp_copy<0, 4>(k0, kv, s0, pt, sub);
        cps_mbar_arrive_cp_async(mbar + 0);
        if (p > 0) att_bar_sync(ATT_PP_BAR_EMPTY + 3, 256);
        if (any) att_pp_copy<4, ATT_D / 64>(k1, kv, s1, pt, sub);
        cps_mbar_arrive_cp_async(mbar + 24);
        if (p > 0) att_bar_sync(ATT_PP_BAR_EMPTY + 1, 256);
        if (any) att_pp_copy<4, ATT_D / 64>(k0, kv, s0, pt, sub);
        cps_mbar_arrive_cp_async(mbar + 8);
        if (p > 0) att_bar_sync(ATT_PP_BAR_EMPTY + 2, 256);
        if (any) att_pp_copy<0, 4>(k1, kv, s1, pt, sub);
        cps_mbar_arrive_cp_async(mbar + 16);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            s0[r] = n0[r];
            s1[r] = n1[r];
        }
    }
    cps_cp_async_wait_all();
}

// S (+)= Q K^T over blocks [B0, B1) of the tile at sk (all 64 keys), issued, not
// committed; FIRST starts the sum.
template <int B0, int B1, bool FIRST>
__device__ __forceinline__ void att_pp_qk(float (&s)[32], u32 sq, u32 sk) {
    cps_wgmma_fence();
#pragma unroll
    for (int b = B0; b < B1; ++b) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            const u32 off = b * ATT_BLK + kk * 32;
            att_wgmma_m64n64_kk(s, cps_wgmma_desc(sq + off, 16, 1024),
                                cps_wgmma_desc(sk + off, 16, 1024),
                                !(FIRST && b == B0 && kk == 0));
        }
    }
}

// O *= f0 (row r0) / f1 (row r1), skipped when no row of the warp changes (f == 1 is
// exactly ex2(0): the max did not move; the skip leaves every bit as it was).
__device__ __forceinline__ void att_pp_rescale(float (&o)[128], float f0, float f1) {
    if (!__any_sync(0xffffffffu, f0 != 1.f || f1 != 1.f)) return;
#pragma unroll
    for (int n = 0; n < 32; ++n) {
        o[4 * n + 0] *= f0;
        o[4 * n + 1] *= f0;
        o[4 * n + 2] *= f1;
        o[4 * n + 3] *= f1;
    }
}

// Mask S of the tile (its 64-bit key mask at mask), the row max with m_in (the running max this
// warpgroup continues from), O rescaled to it, P = exp2(S scale - max) in s (fp32) and
// pk (bf16 pairs, the A fragment of wgmma), l; the new max to st.m and s_max.
// SCALE_FIRST: S is scaled before the masks (the fp8 decode: any sm_scale, zero and
// negative too; masking first, -inf times a scale <= 0 is NaN or +inf, which is why the
// dense rows take the reference then); otherwise the scale is folded into the exp2's
// argument (the prefill's FFMA). For a positive scale the two agree to rounding (the
// FFMA rounds once, scale-first twice), not bit for bit.
template <bool SCALE_FIRST = false>
__device__ __forceinline__ void att_pp_softmax(float (&s)[32], u32 (&pk)[16], AttRows& st,
                                               float m_in0, float m_in1, u32 mask, u32 s_max,
                                               float scale_log2, int r0, int r1, int t4) {
    if constexpr (SCALE_FIRST) {
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] *= scale_log2;
    }
    const float c = SCALE_FIRST ? 1.f : scale_log2;
    const uint2 mw = att_ld_v2(mask);
    if ((mw.x & mw.y) != 0xffffffffu) {           // some key masked (uniform: one tile)
        // Keys 8 j + 2 t4 and + 1 of this thread: bits 8 (j % 4) and + 1 of word j / 4,
        // shifted by 2 t4 once.
        const u32 lo = mw.x >> (2 * t4), hi = mw.y >> (2 * t4);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 word = j < 4 ? lo : hi;
            const bool va = (word >> (8 * (j & 3))) & 1u;
            const bool vb = (word >> (8 * (j & 3) + 1)) & 1u;
            s[4 * j + 0] = va ? s[4 * j + 0] : ATT_NEG_INF;
            s[4 * j + 1] = vb ? s[4 * j + 1] : ATT_NEG_INF;
            s[4 * j + 2] = va ? s[4 * j + 2] : ATT_NEG_INF;
            s[4 * j + 3] = vb ? s[4 * j + 3] : ATT_NEG_INF;
        }
    }
    float mx0 = ATT_NEG_INF, mx1 = ATT_NEG_INF;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        mx0 = fmaxf(mx0, fmaxf(s[4 * j + 0], s[4 * j + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    att_quad_max(mx0, mx1);
    const float n0 = fmaxf(m_in0, mx0 * c), n1 = fmaxf(m_in1, mx1 * c);
    const float so0 = att_ex2(st.m0 - n0), so1 = att_ex2(st.m1 - n1);
    att_pp_rescale(st.o, so0, so1);
    float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        s[4 * j + 0] = att_ex2(s[4 * j + 0] * c - n0);
        s[4 * j + 1] = att_ex2(s[4 * j + 1] * c - n0);
        s[4 * j + 2] = att_ex2(s[4 * j + 2] * c - n1);
        s[4 * j + 3] = att_ex2(s[4 * j + 3] * c - n1);
        ps0 += s[4 * j + 0] + s[4 * j + 1];
        ps1 += s[4 * j + 2] + s[4 * j + 3];
        pk[2 * j] = att_pack_bf16(s[4 * j + 0], s[4 * j + 1]);
        pk[2 * j + 1] = att_pack_bf16(s[4 * j + 2], s[4 * j + 3]);
    }
    st.l0 = st.l0 * so0 + ps0;
    st.l1 = st.l1 * so1 + ps1;
    st.m0 = n0;
    st.m1 = n1;
    if (t4 == 0) {
        att_st_f32(s_max + 4 * r0, n0);
        att_st_f32(s_max + 4 * r1, n1);
    }
}

// O[:, 256 half..] += P V over the tile at sk: P from registers (pk), committed. N: the
// instruction's width, 256 (one m64n256 a k-step) or 128 (two m64n128, O's column halves:
// the accumulator of column c of an m64nN wgmma is the same register index for any N).
template <int N = 256>
__device__ __forceinline__ void att_pp_pv_regs(float (&o)[128], const u32 (&pk)[16], u32 sk,
                                               int half) {
    cps_wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        const u32 a[4] = {pk[4 * ks], pk[4 * ks + 1], pk[4 * ks + 2], pk[4 * ks + 3]};
        const u32 v = sk + half * 4 * ATT_BLK + ks * 2048;
        if constexpr (N == 256) {
            att_wgmma_m64n256_rmn(o, a, cps_wgmma_desc(v, ATT_BLK, 1024), 1);
        } else {
            att_wgmma_m64n128_rmn(*reinterpret_cast<float(*)[64]>(o), a,
                                  cps_wgmma_desc(v, ATT_BLK, 1024), 1);
            att_wgmma_m64n128_rmn(*reinterpret_cast<float(*)[64]>(o + 64), a,
                                  cps_wgmma_desc(v + 2 * ATT_BLK, ATT_BLK, 1024), 1);
        }
    }
    cps_wgmma_commit();
}

// The same with P from shared memory at sp (the other warpgroup's), committed.
template <int N = 256>
__device__ __forceinline__ void att_pp_pv_smem(float (&o)[128], u32 sp, u32 sk, int half) {
    cps_wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        const u64 pa = cps_wgmma_desc(sp + ks * 32, 16, 1024);
        const u32 v = sk + half * 4 * ATT_BLK + ks * 2048;
        if constexpr (N == 256) {
            att_wgmma_m64n256_kmn(o, pa, cps_wgmma_desc(v, ATT_BLK, 1024), 1);
        } else {
            att_wgmma_m64n128_kmn(*reinterpret_cast<float(*)[64]>(o), pa,
                                  cps_wgmma_desc(v, ATT_BLK, 1024), 1);
            att_wgmma_m64n128_kmn(*reinterpret_cast<float(*)[64]>(o + 64), pa,
                                  cps_wgmma_desc(v + 2 * ATT_BLK, ATT_BLK, 1024), 1);
        }
    }
    cps_wgmma_commit();
}

// bf16 P [64 heads x 64 keys] -> the K-major swizzled tile at sp.
__device__ __forceinline__ void att_pp_store_p(u32 sp, const u32 (&pk)[16], int r0, int r1,
                                               int g, int t4) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        att_st_b32(sp + r0 * 128 + ((j ^ g) << 4) + 4 * t4, pk[2 * j]);
        att_st_b32(sp + r1 * 128 + ((j ^ g) << 4) + 4 * t4, pk[2 * j + 1]);
    }
}

// ---- the fp8 decode schedule (cps_sparse_mla_fp8) -------------------------------------
// FlashMLA's sparse decode schedule over the producer above: math warpgroup 0 owns S = Q
// K^T of the whole tile (wgmma m64n64k16: Q is read from shared memory once a tile, not
// once per half) and the softmax; it stores P (bf16) and the new row max, hands them to
// warpgroup 1 (P_READY) and multiplies its own P (from registers) by V's columns 0..255,
// while warpgroup 1 rescales its O by the same exp2(old max - new max) and multiplies P
// (from shared memory) by columns 256..511. So warpgroup 0 issues tile t + 1's QK^T
// while warpgroup 1's P V of tile t runs, and the two exchange nothing else a tile (no row
// max exchange, no rescale vote: att_consume's two extra barriers). A tile with no valid
// key is not skipped (its P is 0). Barriers: FULL + b (producer arrives, warpgroup 0
// waits: ATT_DEC_FULL_THREADS), EMPTY + b (both math warpgroups arrive, the producer
// waits), P_READY (warpgroup 0 arrives, 1 waits), P_FREE (the reverse: P and the row max
// of the tile before are read). The tile's key mask: the producer's u64 at
// ATT_OFF_VALID + 8 b. Registers: warpgroup 0 holds O's half, S and P (192 a thread),
// warpgroup 1 O's half (160), each producer warpgroup 80 (one pass of 8 rows): the pool of
// 512 x 128 exactly (__launch_bounds__(512, 1): 128 a thread at launch; ptxas allocates
// each region to its setmaxnreg count, tests/test_kernel_compile.py checks no spill).
#define ATT_BAR_P_READY 6
#define ATT_BAR_P_FREE 7
#define ATT_DEC_WG0_REGS 192
#define ATT_DEC_WG1_REGS 160
#define ATT_DEC_PRODUCER_REGS 80
#define ATT_DEC_LAUNCH_REGS 128
static_assert(128 * (2 * ATT_DEC_PRODUCER_REGS + ATT_DEC_WG0_REGS + ATT_DEC_WG1_REGS) <=
                  ATT_DEC_THREADS * ATT_DEC_LAUNCH_REGS,
              "setmaxnreg split exceeds the CTA's register pool");

// Math warpgroup WG of the fp8 decode. 0: QK^T, softmax, P V over value columns 0..255.
// 1: O's columns 256..511, rescaled as warpgroup 0 rescales its own (the same exp2 of the
// same two maxima), P from shared memory; its row sums stay 0 (warpgroup 0 holds them
// all; att_write_rows adds the two).
template <int WG, int D, int OUT>
__device__ __forceinline__ void att_dec_math(const void* __restrict__ q, int q_fmt,
                                             const AttShare& w, int H, u32 base,
                                             float scale_log2, void* __restrict__ out,
                                             float* __restrict__ lse,
                                             float* __restrict__ part_out, int d_v, int splits,
                                             const float* __restrict__ sink, int tid) {
    const u32 sq = base + ATT_OFF_Q, sp = base + ATT_OFF_P, s_max = base + ATT_OFF_MAX;
    const int lane = tid & 31, wi = WG == 0 ? tid >> 5 : (tid >> 5) & 3;   // warp of its group
    const int g = lane >> 2, t4 = lane & 3;
    const int r0 = wi * 16 + g, r1 = r0 + 8;
    AttRows st;
    att_math_start<D>(q, q_fmt, w, H, sq, tid);
    att_rows_init(st);
    st.m0 = st.m1 = ATT_PP_MAX_INIT;
    for (int it = w.t_first; it < w.t_end; ++it) {
        const int buf = (it - w.t_first) & 1;
        const u32 sk = base + ATT_OFF_K + buf * ATT_TILE;
        if constexpr (WG == 0) {
            float s[32];
            u32 pk[16];
            att_bar_sync(ATT_BAR_FULL + buf, ATT_DEC_FULL_THREADS);
            att_pp_qk<0, D / 64, true>(s, sq, sk);
            cps_wgmma_commit();
            cps_wgmma_wait<0>();
            cps_fence_regs(s);
            if (it > w.t_first) att_bar_sync(ATT_BAR_P_FREE, ATT_MATH_THREADS);
            att_pp_softmax<true>(s, pk, st, st.m0, st.m1, base + ATT_OFF_VALID + buf * 8,
                                 s_max, scale_log2, r0, r1, t4);
            att_pp_store_p(sp, pk, r0, r1, g, t4);
            cps_fence_proxy_async();              // P -> the async proxy (wgmma)
            att_bar_arrive(ATT_BAR_P_READY, ATT_MATH_THREADS);
            cps_fence_regs(st.o);
            att_pp_pv_regs<128>(st.o, pk, sk, 0);
            cps_wgmma_wait<0>();
            cps_fence_regs(st.o);
            if (it + 2 < w.t_end) att_bar_arrive(ATT_BAR_EMPTY + buf, ATT_DEC_THREADS);
        } else {
            att_bar_sync(ATT_BAR_P_READY, ATT_MATH_THREADS);
            const float n0 = att_ld_f32(s_max + 4 * r0), n1 = att_ld_f32(s_max + 4 * r1);
            att_pp_rescale(st.o, att_ex2(st.m0 - n0), att_ex2(st.m1 - n1));
            st.m0 = n0;
            st.m1 = n1;
            cps_fence_regs(st.o);
            att_pp_pv_smem<128>(st.o, sp, sk, 1);
            cps_wgmma_wait<0>();
            cps_fence_regs(st.o);
            if (it + 2 < w.t_end) att_bar_arrive(ATT_BAR_EMPTY + buf, ATT_DEC_THREADS);
            if (it + 1 < w.t_end) att_bar_arrive(ATT_BAR_P_FREE, ATT_MATH_THREADS);
        }
    }
    att_write_rows<OUT>(st, w, base + ATT_OFF_L, out, lse, part_out, H, d_v, splits, WG, r0,
                        r1, t4, sink);
}

// The kernels' bodies are templates of the out's format OUT (ATT_FMT_*): the _out_bf16
// and _out_f16 kernels write a 16-bit out, the others float32 rows, each with its own
// epilogue only.
#define ATT_ARGS                                                                           \
    q, q_fmt, kv, indices, topk, num_slots, row_start, row_len, out, lse, H, d_v,           \
        scale_log2, splits, part_out, sink

// The fp8_ds_mla cache: warp-specialized (see "warp specialization" above).
template <int OUT>
__device__ __forceinline__ void att_fp8_kernel(ATT_PARAMS) {
    extern __shared__ __align__(1024) u8 att_smem_raw[];
    const u32 base = (cps_smem_u32(att_smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    const AttShare w = att_share(indices, topk, nullptr, row_len, H, splits);
    if (tid >= ATT_MATH_THREADS) {
        cps_setmaxnreg_dec<ATT_DEC_PRODUCER_REGS>();
        att_produce_fp8(kv, w.irow, w.nk_end, num_slots, w.t_first, w.t_end, base,
                        tid - ATT_MATH_THREADS);
        return;
    }
    if (tid < 128) {
        cps_setmaxnreg_inc<ATT_DEC_WG0_REGS>();
        att_dec_math<0, ATT_D, OUT>(q, q_fmt, w, H, base, scale_log2, out, lse, part_out,
                                    d_v, splits, sink, tid);
    } else {
        cps_setmaxnreg_inc<ATT_DEC_WG1_REGS>();
        att_dec_math<1, ATT_D, OUT>(q, q_fmt, w, H, base, scale_log2, out, lse, part_out,
                                    d_v, splits, sink, tid);
    }
}

extern "C" __global__ void __launch_bounds__(ATT_DEC_THREADS, 1) cps_sparse_mla_fp8(ATT_PARAMS) {
    CPS_PDL_WAIT();
    att_fp8_kernel<ATT_FMT_F32>(ATT_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_DEC_THREADS, 1)
cps_sparse_mla_fp8_out_bf16(ATT_PARAMS) {
    CPS_PDL_WAIT();
    att_fp8_kernel<ATT_FMT_BF16>(ATT_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_DEC_THREADS, 1)
cps_sparse_mla_fp8_out_f16(ATT_PARAMS) {
    CPS_PDL_WAIT();
    att_fp8_kernel<ATT_FMT_F16>(ATT_ARGS);
}

// The math warpgroups of the ping-pong kernel (threads 0..255).
template <int D, int OUT>
__device__ __forceinline__ void att_consume_pp(const void* __restrict__ q, int q_fmt,
                                               const AttShare& w, int H, u32 base,
                                               float scale_log2, void* __restrict__ out,
                                               float* __restrict__ lse,
                                               float* __restrict__ part_out, int d_v,
                                               int splits, const float* __restrict__ sink,
                                               int tid) {
    constexpr int NB = D / 64;                     // QK^T blocks of a row
    cps_setmaxnreg_inc<ATT_PP_MATH_REGS>();
    const int lane = tid & 31, warp = tid >> 5;
    const int wg = warp >> 2, wi = warp & 3;
    const int g = lane >> 2, t4 = lane & 3;
    const int r0 = wi * 16 + g, r1 = r0 + 8;
    const u32 sq = base + ATT_OFF_Q, s_max = base + ATT_OFF_MAX;
    const u32 k0 = base + ATT_OFF_K, k1 = k0 + ATT_TILE;
    const u32 sS0 = base + ATT_PP_OFF_S0, sS1 = base + ATT_PP_OFF_S1;
    const u32 mbar = base + ATT_PP_OFF_MBAR, masks = base + ATT_PP_OFF_MASKS;
    att_math_start<D>(q, q_fmt, w, H, sq, tid);
    AttRows st;
    att_rows_init(st);
    st.m0 = ATT_PP_MAX_INIT;
    st.m1 = ATT_PP_MAX_INIT;
    float s[32];
    u32 pk[16];
    const int pairs = (w.t_end - w.t_first + 1) >> 1;
    if (wg == 0) {
        bool ready = false;                        // S of this pair's tile 0 is in s
        for (int p = 0; p < pairs; ++p) {
            const int par = p & 1;
            const bool more = p + 1 < pairs;
            if (!ready) {
                cps_mbar_wait(mbar + 32 + 8 * par, (p >> 1) & 1);
                const int any = att_pp_any(masks + par * 16);
                cps_mbar_wait(mbar + 0, par);
                if (!any) {
                    // A skipped pair keeps the barriers' rhythm. The EMPTY L1 arrival
                    // waits for FULL L1: the producer arrives on it after its EMPTY L1
                    // sync of this pair, so this arrival cannot complete that sync's
                    // barrier together with the previous pair's (FULL R0 alone, which
                    // the producer arrives on before that sync, would not order them).
                    cps_mbar_wait(mbar + 8, par);
                    cps_mbar_wait(mbar + 16, par);
                    if (more) {
                        att_bar_arrive(ATT_PP_BAR_EMPTY + 0, 256);
                        att_bar_arrive(ATT_PP_BAR_EMPTY + 2, 256);
                    }
                    continue;
                }
                // (Every wgmma issued here is committed on the same path: a wgmma left
                // uncommitted on a branch makes ptxas serialize them all, C7518.)
                att_pp_qk<0, 4, true>(s, sq, k0);
                cps_mbar_wait(mbar + 8, par);
                att_pp_qk<4, NB, false>(s, sq, k0);
                cps_wgmma_commit();
                cps_wgmma_wait<0>();
                cps_fence_regs(s);
            }
            ready = false;
            att_pp_softmax(s, pk, st, st.m0, st.m1, masks + par * 16, s_max, scale_log2, r0,
                           r1, t4);
            att_bar_arrive(ATT_PP_BAR_M0, 256);
            att_pp_pv_regs(st.o, pk, k0, 0);
            cps_wgmma_wait<0>();
            cps_fence_regs(st.o);
            cps_fence_regs(pk);
            if (more) att_bar_arrive(ATT_PP_BAR_EMPTY + 0, 256);
            // The pair's max from warpgroup 1: P of tile 0 and O rescaled to it.
            att_bar_sync(ATT_PP_BAR_M1, 256);
            const float n0 = att_ld_f32(s_max + 4 * r0), n1 = att_ld_f32(s_max + 4 * r1);
            const float f0 = att_ex2(st.m0 - n0), f1 = att_ex2(st.m1 - n1);
            st.m0 = n0;
            st.m1 = n1;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                pk[2 * j] = att_pack_bf16(s[4 * j + 0] * f0, s[4 * j + 1] * f0);
                pk[2 * j + 1] = att_pack_bf16(s[4 * j + 2] * f1, s[4 * j + 3] * f1);
            }
            att_pp_store_p(sS0, pk, r0, r1, g, t4);
            cps_fence_proxy_async();
            att_bar_arrive(ATT_PP_BAR_S0, 256);
            att_pp_rescale(st.o, f0, f1);
            st.l0 *= f0;
            st.l1 *= f1;
            att_bar_sync(ATT_PP_BAR_S1, 256);
            att_pp_pv_smem(st.o, sS1, k1, 0);
            if (more) {
                // The next pair's QK^T while P V of tile 1 runs.
                const int nxt = par ^ 1;
                cps_mbar_wait(mbar + 32 + 8 * nxt, ((p + 1) >> 1) & 1);
                const int any = att_pp_any(masks + nxt * 16);
                if (any) {
                    cps_mbar_wait(mbar + 0, nxt);
                    att_pp_qk<0, 4, true>(s, sq, k0);
                    cps_wgmma_commit();
                    cps_wgmma_wait<1>();
                    cps_fence_regs(st.o);
                    att_bar_arrive(ATT_PP_BAR_EMPTY + 2, 256);
                    cps_mbar_wait(mbar + 8, nxt);
                    att_pp_qk<4, NB, false>(s, sq, k0);
                    cps_wgmma_commit();
                    cps_wgmma_wait<0>();
                    cps_fence_regs(s);
                    ready = true;
                } else {
                    cps_wgmma_wait<0>();
                    cps_fence_regs(st.o);
                    att_bar_arrive(ATT_PP_BAR_EMPTY + 2, 256);
                }
            } else {
                cps_wgmma_wait<0>();
                cps_fence_regs(st.o);
            }
        }
    } else {
        for (int p = 0; p < pairs; ++p) {
            const int par = p & 1;
            const bool more = p + 1 < pairs;
            cps_mbar_wait(mbar + 32 + 8 * par, (p >> 1) & 1);
            const int any = att_pp_any(masks + par * 16);
            cps_mbar_wait(mbar + 24, par);
            if (!any) {
                cps_mbar_wait(mbar + 16, par);
                if (more) {
                    att_bar_arrive(ATT_PP_BAR_EMPTY + 3, 256);
                    att_bar_arrive(ATT_PP_BAR_EMPTY + 1, 256);
                }
                continue;
            }
            att_pp_qk<4, NB, true>(s, sq, k1);
            cps_mbar_wait(mbar + 16, par);
            att_pp_qk<0, 4, false>(s, sq, k1);
            cps_wgmma_commit();
            cps_wgmma_wait<0>();
            cps_fence_regs(s);
            // Continue from warpgroup 0's max of this pair.
            att_bar_sync(ATT_PP_BAR_M0, 256);
            const float m0 = att_ld_f32(s_max + 4 * r0), m1 = att_ld_f32(s_max + 4 * r1);
            att_pp_softmax(s, pk, st, m0, m1, masks + par * 16 + 8, s_max, scale_log2, r0, r1,
                           t4);
            att_bar_arrive(ATT_PP_BAR_M1, 256);
            // P to shared memory first: the registers of pk are the A operand of the
            // next wgmma, which no instruction may touch while it runs.
            att_pp_store_p(sS1, pk, r0, r1, g, t4);
            att_pp_pv_regs(st.o, pk, k1, 1);
            att_bar_sync(ATT_PP_BAR_S0, 256);
            att_pp_pv_smem(st.o, sS0, k0, 1);
            cps_fence_proxy_async();
            att_bar_arrive(ATT_PP_BAR_S1, 256);
            cps_wgmma_wait<1>();
            cps_fence_regs(pk);
            if (more) att_bar_arrive(ATT_PP_BAR_EMPTY + 3, 256);
            cps_wgmma_wait<0>();
            cps_fence_regs(st.o);
            if (more) att_bar_arrive(ATT_PP_BAR_EMPTY + 1, 256);
        }
    }
    att_write_rows<OUT>(st, w, base + ATT_OFF_L, out, lse, part_out, H, d_v, splits, wg, r0,
                        r1, t4, sink);
}

// Dense bf16 rows (the workspace of the dense and sparse routes), ping-pong schedule.
template <int OUT>
__device__ __forceinline__ void att_bf16_kernel(ATT_PARAMS) {
    extern __shared__ __align__(1024) u8 att_smem_raw[];
    const u32 base = (cps_smem_u32(att_smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    const AttShare w = att_share(indices, topk, row_start, row_len, H, splits);
    if (tid == 0) {
        const u32 mbar = base + ATT_PP_OFF_MBAR;
#pragma unroll
        for (int i = 0; i < 6; ++i) cps_mbar_init(mbar + 8 * i, 128);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (tid >= ATT_MATH_THREADS) {
        cps_setmaxnreg_dec<ATT_PP_PRODUCER_REGS>();
        att_produce_bf16(kv, w, num_slots, base, tid - ATT_MATH_THREADS);
        return;
    }
    att_consume_pp<ATT_D, OUT>(q, q_fmt, w, H, base, scale_log2, out, lse, part_out, d_v,
                               splits, sink, tid);
}

extern "C" __global__ void __launch_bounds__(ATT_WS_THREADS, 1) cps_sparse_mla_bf16(ATT_PARAMS) {
    CPS_PDL_WAIT();
    att_bf16_kernel<ATT_FMT_F32>(ATT_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_WS_THREADS, 1)
cps_sparse_mla_bf16_out_bf16(ATT_PARAMS) {
    CPS_PDL_WAIT();
    att_bf16_kernel<ATT_FMT_BF16>(ATT_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_WS_THREADS, 1)
cps_sparse_mla_bf16_out_f16(ATT_PARAMS) {
    CPS_PDL_WAIT();
    att_bf16_kernel<ATT_FMT_F16>(ATT_ARGS);
}


// ---- the MODEL1 cache (DeepSeek-V4, FlashMLA's MODEL1_FP8Sparse) ----------------------
// A page of block_size tokens (page_stride bytes apart): the tokens' 576-byte rows
// first (448 e4m3 NoPE codes, then 64 bf16 RoPE values), then per token 8 bytes (7 ue8m0
// scales, one per 64 codes, and a pad byte). The key is 512 wide (codes * scale, RoPE)
// and is also the value: the tile's blocks 0..6 hold the dequantized NoPE part, block 7
// the RoPE part, block 8 is never written nor read (QK^T runs 32 k-steps, PV the first
// 512 columns as for fp8_ds_mla). The key list of a token is its first n_a =
// min(topk_length, topk) entries of `indices`, then (with an extra cache, e.g. the
// sliding window) its first n_b entries of `extra_indices`, each list padded to whole
// tiles of 64: tiles [0, tiles_a) read the main cache, the rest the extra one, and all
// of them enter one softmax. Every slot outside [0, num_slots) of its own cache is
// masked and never read.
// ATT_M1_NOPE (e4m3 codes a token), ATT_M1_ROW (codes + bf16 RoPE) and ATT_M1_SCALE_BYTES
// (the ue8m0 scales + 1 pad byte a token) come from the launcher.
#define ATT_M1_D (ATT_M1_NOPE + 64)
#define ATT_M1_CODE_LANES (ATT_M1_NOPE / 16)   // 16-byte code chunks of a row
static_assert(ATT_M1_D == 512 && ATT_M1_ROW == ATT_M1_NOPE + 2 * 64 &&
                  ATT_M1_SCALE_BYTES == ATT_M1_NOPE / 64 + 1,
              "MODEL1: 448 codes, 64 bf16 RoPE, one scale byte per 64 codes and a pad byte");

struct AttM1Cache {
    const u8* kv;
    long long page_stride;
    int block_size, num_slots;
};

// The token's two key lists (n_a, n_b valid-prefix lengths) and the first tile of the
// extra one.
struct AttM1Keys {
    const int* row_a;
    const int* row_b;
    int n_a, n_b, tiles_a;
};

// The cache of tile t, field by field (a select of references would put both structs in
// local memory).
__device__ __forceinline__ AttM1Cache att_m1_pick(const AttM1Keys& m, const AttM1Cache& ca,
                                                  const AttM1Cache& cb, int t) {
    const bool a = t < m.tiles_a;
    AttM1Cache c;
    c.kv = a ? ca.kv : cb.kv;
    c.page_stride = a ? ca.page_stride : cb.page_stride;
    c.block_size = a ? ca.block_size : cb.block_size;
    c.num_slots = a ? ca.num_slots : cb.num_slots;
    return c;
}

// ue8m0 byte -> 2 ** (byte - 127); byte 0 is 2 ** -127 (a float denormal), 255 (NaN in
// the ue8m0 format, never written by the quantizer) gives inf.
__device__ __forceinline__ float att_ue8m0(u32 byte) {
    return byte != 0u ? __int_as_float(byte << 23) : __int_as_float(0x00400000);
}

// A row of the tile being loaded, held by the lane that owns it: page (-1 when masked),
// offset in the page, and its 8 scale bytes (loaded here, a tile ahead of their use: as
// 28 byte loads per row in the pass they cost 40% of the kernel's time).
struct AttM1Row {
    int page, off;
    u32 scales_lo, scales_hi;
};

// Page and offset of the row of tile t, key r of the token's combined list (page -1 when
// masked); c is the tile's cache.
__device__ __forceinline__ void att_m1_find(const AttM1Keys& m, const AttM1Cache& c, int t,
                                            int r, int& page, int& off) {
    const bool extra = t >= m.tiles_a;
    const int j = (extra ? t - m.tiles_a : t) * 64 + r;
    page = -1;
    off = 0;
    if (j < (extra ? m.n_b : m.n_a)) {
        const int slot = __ldg((extra ? m.row_b : m.row_a) + j);
        if (att_slot_ok(slot, c.num_slots)) {
            page = (int)((u32)slot / (u32)c.block_size);
            off = slot - page * c.block_size;
        }
    }
}

// att_m1_find, then the row's scale word.
__device__ __forceinline__ AttM1Row att_m1_locate(const AttM1Keys& m, const AttM1Cache& c,
                                                  int t, int r) {
    AttM1Row row{-1, 0, 0u, 0u};
    att_m1_find(m, c, t, r, row.page, row.off);
    if (row.page >= 0) {
        const uint2 sc = __ldg(reinterpret_cast<const uint2*>(
            c.kv + (size_t)row.page * (size_t)c.page_stride
            + (size_t)c.block_size * ATT_M1_ROW + (size_t)row.off * ATT_M1_SCALE_BYTES));
        row.scales_lo = sc.x;
        row.scales_hi = sc.y;
    }
    return row;
}

// One pass of 8 rows (row base + k held by lane base + k): lane l < 28 loads code chunk l
// (dims 16 l .. 16 l + 15) and takes its scale byte (group l / 4) from the row's word.
__device__ __forceinline__ void att_m1_load_pass(AttPass& r, const AttM1Cache& c,
                                                 const AttM1Row& mine, int base, int lane) {
    const int group = lane >> 2;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int pg = __shfl_sync(0xffffffffu, mine.page, base + k);
        const int of = __shfl_sync(0xffffffffu, mine.off, base + k);
        const u32 lo = __shfl_sync(0xffffffffu, mine.scales_lo, base + k);
        const u32 hi = __shfl_sync(0xffffffffu, mine.scales_hi, base + k);
        r.codes[k] = make_uint4(0u, 0u, 0u, 0u);
        r.scales[k] = 0.f;
        if (pg >= 0 && lane < ATT_M1_CODE_LANES) {
            r.codes[k] = __ldg(reinterpret_cast<const uint4*>(
                c.kv + (size_t)pg * (size_t)c.page_stride + (size_t)of * ATT_M1_ROW) + lane);
            r.scales[k] = att_ue8m0(((group < 4 ? lo : hi) >> (8 * (group & 3))) & 0xFFu);
        }
    }
}

// The 64 bf16 RoPE values of the warp's 16 rows -> block 7, by cp.async (zero-filled and
// unread when masked: the RoPE part is in the value too).
__device__ __forceinline__ void att_m1_copy_rope(const AttM1Cache& c, const AttM1Row& mine,
                                                 u32 sk, int row0, int lane) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int idx = lane + 32 * j, k = idx >> 3, ch = idx & 7;
        const int pg = __shfl_sync(0xffffffffu, mine.page, k);
        const int of = __shfl_sync(0xffffffffu, mine.off, k);
        const bool v = pg >= 0;
        const u8* rope = c.kv + (v ? (size_t)pg * (size_t)c.page_stride
                                         + (size_t)of * ATT_M1_ROW + ATT_M1_NOPE : (size_t)0);
        const int row = row0 + k;
        cps_cp_async16(sk + row * 128 + 7 * ATT_BLK + ((ch ^ (row & 7)) << 4), rope + 16 * ch, v);
    }
}

// Pull a row (576 bytes, up to 6 lines) and its scale bytes into L2 ahead of its load.
__device__ __forceinline__ void att_m1_prefetch(const AttM1Cache& c, int page, int off,
                                                int half) {
    if (page < 0) return;
    const u8* pbase = c.kv + (size_t)page * (size_t)c.page_stride;
    const u8* row = pbase + (size_t)off * ATT_M1_ROW;
#pragma unroll
    for (int k = 0; k < 3; ++k) {
        const u8* p = half ? (k < 2 ? row + 384 + 191 * k
                                    : pbase + (size_t)c.block_size * ATT_M1_ROW
                                          + (size_t)off * ATT_M1_SCALE_BYTES)
                           : row + 128 * k;
        asm volatile("prefetch.global.L2 [%0];\n" :: "l"(p));
    }
}

// The producer warpgroup for MODEL1, as att_produce_fp8 (rows 16 pw .. 16 pw + 15 of
// every tile in two passes of 8, one in flight while the other is dequantized, rows
// three tiles ahead pulled into L2), reading each tile from its own cache.
__device__ __forceinline__ void att_produce_m1(const AttM1Cache& ca, const AttM1Cache& cb,
                                               const AttM1Keys& m, int t_first, int t_end,
                                               u32 base, int p) {
    const int lane = p & 31, row0 = (p >> 5) * 16, mine = row0 + (lane & 15);
    AttPass a, b;
    AttM1Cache c = att_m1_pick(m, ca, cb, t_first);
    AttM1Row row{-1, 0, 0u, 0u};
    if (t_first < t_end) row = att_m1_locate(m, c, t_first, mine);
    att_m1_load_pass(a, c, row, 0, lane);
    for (int t = t_first; t < t_end; ++t) {
        const int buf = (t - t_first) & 1;
        const u32 sk = base + ATT_OFF_K + buf * ATT_TILE;
        const AttM1Cache cn = att_m1_pick(m, ca, cb, t + 1);
        const AttM1Row next = t + 1 < t_end ? att_m1_locate(m, cn, t + 1, mine)
                                            : AttM1Row{-1, 0, 0u, 0u};
        int page_3 = -1, off_3 = 0;
        const AttM1Cache c3 = att_m1_pick(m, ca, cb, t + 3);
        if (t + 3 < t_end) att_m1_find(m, c3, t + 3, mine, page_3, off_3);
        att_m1_load_pass(b, c, row, 8, lane);
        if (t - t_first >= 2) att_bar_sync(ATT_BAR_EMPTY + buf, ATT_WS_THREADS);
        att_m1_copy_rope(c, row, sk, row0, lane);
        if (lane < 16) att_st_s32(base + ATT_OFF_VALID + buf * 256 + 4 * mine, row.page >= 0);
        att_store_pass<ATT_M1_CODE_LANES>(a, sk, row0, lane);
        att_m1_prefetch(c3, page_3, off_3, lane >> 4);
        att_m1_load_pass(a, cn, next, 0, lane);
        att_store_pass<ATT_M1_CODE_LANES>(b, sk, row0 + 8, lane);
        cps_cp_async_wait_all();
        cps_fence_proxy_async();                  // stores -> the async proxy (wgmma)
        att_bar_arrive(ATT_BAR_FULL + buf, ATT_WS_THREADS);
        row = next;
        c = cn;
    }
}

// Sparse decode / prefill over MODEL1 caches, with FlashMLA's extras fused: per-token
// list lengths, the extra cache in the same softmax, the attention sink. Same three
// warpgroups as cps_sparse_mla_fp8; the split-KV share is over the token's combined
// tiles (computed here from its lengths: the launch shape stays a function of shapes).
#define ATT_M1_PARAMS                                                                       \
    const void* __restrict__ q, int q_fmt, const u8* __restrict__ kv,                       \
        const int* __restrict__ indices, const int* __restrict__ lengths, int topk,         \
        int block_size, long long page_stride, int num_slots, const u8* __restrict__ ekv,   \
        const int* __restrict__ eindices, const int* __restrict__ elengths, int etopk,      \
        int eblock_size, long long epage_stride, int enum_slots,                            \
        const float* __restrict__ sink, void* __restrict__ out, float* __restrict__ lse,    \
        int H, int d_v, float scale_log2, int splits, float* __restrict__ part_out

#define ATT_M1_ARGS                                                                         \
    q, q_fmt, kv, indices, lengths, topk, block_size, page_stride, num_slots, ekv,          \
        eindices, elengths, etopk, eblock_size, epage_stride, enum_slots, sink, out, lse, H, \
        d_v, scale_log2, splits, part_out

template <int OUT>
__device__ __forceinline__ void att_model1_kernel(ATT_M1_PARAMS) {
    extern __shared__ __align__(1024) u8 att_smem_raw[];
    const u32 base = (cps_smem_u32(att_smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x;
    AttShare w = att_share(indices, topk, nullptr, nullptr, H, splits);
    AttM1Keys m;
    m.row_a = w.irow;
    m.n_a = lengths != nullptr ? min(max(__ldg(lengths + w.tok), 0), topk) : topk;
    m.row_b = eindices != nullptr ? eindices + (size_t)w.tok * etopk : nullptr;
    m.n_b = eindices == nullptr ? 0
            : elengths != nullptr ? min(max(__ldg(elengths + w.tok), 0), etopk) : etopk;
    m.tiles_a = (m.n_a + 63) >> 6;
    {
        const int tiles_all = m.tiles_a + ((m.n_b + 63) >> 6);
        const int per_split = (tiles_all + splits - 1) / splits;
        w.t_first = min(tiles_all, w.split * per_split);
        w.t_end = min(tiles_all, w.t_first + per_split);
    }
    if (tid >= ATT_MATH_THREADS) {
        cps_setmaxnreg_dec<ATT_PRODUCER_REGS>();
        const AttM1Cache ca{kv, page_stride, block_size, num_slots};
        const AttM1Cache cb{ekv, epage_stride, eblock_size, enum_slots};
        att_produce_m1(ca, cb, m, w.t_first, w.t_end, base, tid - ATT_MATH_THREADS);
        return;
    }
    att_consume<ATT_M1_D, OUT>(q, q_fmt, w, H, base, scale_log2, out, lse, part_out, d_v,
                               splits, sink, tid);
}

extern "C" __global__ void __launch_bounds__(ATT_WS_THREADS, 1)
cps_sparse_mla_model1(ATT_M1_PARAMS) {
    CPS_PDL_WAIT();
    att_model1_kernel<ATT_FMT_F32>(ATT_M1_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_WS_THREADS, 1)
cps_sparse_mla_model1_out_bf16(ATT_M1_PARAMS) {
    CPS_PDL_WAIT();
    att_model1_kernel<ATT_FMT_BF16>(ATT_M1_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_WS_THREADS, 1)
cps_sparse_mla_model1_out_f16(ATT_M1_PARAMS) {
    CPS_PDL_WAIT();
    att_model1_kernel<ATT_FMT_F16>(ATT_M1_ARGS);
}


// Merge the splits of split-KV decoding: one CTA per (token, head) row.
//   lse = log sum_s exp(lse_s),  out = sum_s exp(lse_s - lse) out_s
// (out_s already normalised by its split's sum). A split with no valid key has
// lse_s = -inf and weight 0; a row with none at all ends with out = 0, lse = -inf
// as in one pass; a NaN partial lse (a NaN score) makes the row NaN. An attention
// sink [H] (or nullptr) scales out by att_sink_factor of the merged lse.
// Two kernels of one body, bit-identical results; the launcher picks by the number of
// rows. Every warp computes the row's weights itself from the partial lse (a lane a
// split, shuffles: no shared memory, no block barrier), after issuing its columns'
// partial rows of the first CHUNK splits, which travel while the weights are computed.
// Each thread owns two float2 columns; each column sums its splits in split order.
//   cps_mla_combine_few_rows (CHUNK 16): a small decode batch waits on the merge's
//     latency, not its bytes (B=1, H=128: 128 rows of 16 splits of 2 KB): every load
//     in flight at once.
//   cps_mla_combine (CHUNK 8, at most 64 registers): many rows (B=8, H=128: 1024 rows
//     of 8 splits): 8 CTAs an SM, the whole batch in one wave.
#define ATT_COMBINE_PARAMS                                                                  \
    const float* __restrict__ part_out, void* __restrict__ out, float* __restrict__ lse,    \
        const float* __restrict__ sink, int splits, int d_v, int H

static_assert(2 * ATT_COMBINE_THREADS * 2 >= ATT_DV, "two float2 value columns a thread");
static_assert(ATT_MAX_SPLITS <= 64, "two splits' weights a lane");
template <int CHUNK, int OUT>
__device__ __forceinline__ void att_combine_row(ATT_COMBINE_PARAMS) {
    const size_t row = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, ncol = d_v >> 1;  // float2 columns
    const float2* po = reinterpret_cast<const float2*>(part_out + row * splits * d_v);
    float2 v[2][CHUNK];
    auto load = [&](int s0) {
#pragma unroll
        for (int j = 0; j < CHUNK; ++j) {
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int c = tid + k * ATT_COMBINE_THREADS;
                v[k][j] = s0 + j < splits && c < ncol
                              ? __ldg(po + (size_t)(s0 + j) * ncol + c) : make_float2(0.f, 0.f);
            }
        }
    };
    load(0);
    // Lane l weighs splits l and l + 32 (an absent split: lse -inf, weight 0).
    const float* pl = part_out + (size_t)gridDim.x * splits * d_v + row * splits;
    const float x_lo = lane < splits ? pl[lane] : ATT_NEG_INF;
    const float x_hi = lane + 32 < splits ? pl[lane + 32] : ATT_NEG_INF;
    const bool nan = __any_sync(0xffffffffu, x_lo != x_lo || x_hi != x_hi);
    float mx = fmaxf(fmaxf(ATT_NEG_INF, x_lo), x_hi);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float e_lo = mx == ATT_NEG_INF ? 0.f : expf(x_lo - mx);
    const float e_hi = mx == ATT_NEG_INF ? 0.f : expf(x_hi - mx);
    float total = e_lo + e_hi;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    const float inv = total > 0.f ? 1.f / total : 0.f;
    const float merged = mx == ATT_NEG_INF ? ATT_NEG_INF : mx + logf(total);
    const float f = att_sink_factor(sink, (int)(row % (size_t)H), merged);
    const float w_lo = e_lo * (inv * f), w_hi = e_hi * (inv * f);
    float2 acc[2] = {make_float2(0.f, 0.f), make_float2(0.f, 0.f)};
    for (int s0 = 0; s0 < splits; s0 += CHUNK) {
        if (s0 > 0) load(s0);
#pragma unroll
        for (int j = 0; j < CHUNK; ++j) {
            const int s = s0 + j;           // warp-uniform: every lane reads one register
            const float wt = __shfl_sync(0xffffffffu, s < 32 ? w_lo : w_hi, s & 31);
#pragma unroll
            for (int k = 0; k < 2; ++k) {   // (a split past the row's: v 0, weight 0)
                acc[k].x += wt * v[k][j].x;
                acc[k].y += wt * v[k][j].y;
            }
        }
    }
    const float qnan = __int_as_float(0x7fc00000);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int c = tid + k * ATT_COMBINE_THREADS;
        if (c < ncol) {
            const float2 o = nan ? make_float2(qnan, qnan) : acc[k];
            if constexpr (OUT != ATT_FMT_F32)
                reinterpret_cast<u32*>(out)[row * ncol + c] = att_pack_out16<OUT>(o.x, o.y);
            else
                reinterpret_cast<float2*>(out)[row * ncol + c] = o;
        }
    }
    if (tid == 0) lse[row] = nan ? qnan : merged;
}

#define ATT_COMBINE_ARGS part_out, out, lse, sink, splits, d_v, H
// (_out_bf16 / _out_f16: a 16-bit out of that format; the others float32)
extern "C" __global__ void __launch_bounds__(ATT_COMBINE_THREADS)
cps_mla_combine_few_rows(ATT_COMBINE_PARAMS) {
    CPS_PDL_WAIT();
    att_combine_row<16, ATT_FMT_F32>(ATT_COMBINE_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_COMBINE_THREADS)
cps_mla_combine_few_rows_out_bf16(ATT_COMBINE_PARAMS) {
    CPS_PDL_WAIT();
    att_combine_row<16, ATT_FMT_BF16>(ATT_COMBINE_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_COMBINE_THREADS)
cps_mla_combine_few_rows_out_f16(ATT_COMBINE_PARAMS) {
    CPS_PDL_WAIT();
    att_combine_row<16, ATT_FMT_F16>(ATT_COMBINE_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_COMBINE_THREADS, 8)
cps_mla_combine(ATT_COMBINE_PARAMS) {
    CPS_PDL_WAIT();
    att_combine_row<8, ATT_FMT_F32>(ATT_COMBINE_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_COMBINE_THREADS, 8)
cps_mla_combine_out_bf16(ATT_COMBINE_PARAMS) {
    CPS_PDL_WAIT();
    att_combine_row<8, ATT_FMT_BF16>(ATT_COMBINE_ARGS);
}

extern "C" __global__ void __launch_bounds__(ATT_COMBINE_THREADS, 8)
cps_mla_combine_out_f16(ATT_COMBINE_PARAMS) {
    CPS_PDL_WAIT();
    att_combine_row<8, ATT_FMT_F16>(ATT_COMBINE_ARGS);
}

// Dense workspace -> bf16 bit patterns (round to nearest even).
extern "C" __global__ void cps_f32_to_bf16(const float* __restrict__ x, u16* __restrict__ y,
                                           long long n) {
    CPS_PDL_WAIT();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = (u16)(att_pack_bf16(x[i], 0.f) & 0xFFFFu);
    }
}

extern "C" __global__ void cps_f16_to_bf16(const u16* __restrict__ x, u16* __restrict__ y,
                                           long long n) {
    CPS_PDL_WAIT();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = (u16)(att_f16x2_to_bf16x2((u32)x[i]) & 0xFFFFu);
    }
}

// Request-local top-k positions -> global cache slots. -1 for a masked position and
// for anything out of range: a negative position, a request id outside [0, num_reqs),
// a position past the request's block-table row, a negative page id, or a slot that
// does not fit int32 (it would wrap onto another request's page).
extern "C" __global__ void cps_local_to_global_slots(const int* __restrict__ indices,
                                                     const int* __restrict__ req_ids,
                                                     const int* __restrict__ block_table,
                                                     int num_reqs, int max_blocks, int topk,
                                                     long long n, int block_size,
                                                     int* __restrict__ out) {
    CPS_PDL_WAIT();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int pos = indices[i];
        const int req = req_ids[i / topk];
        int slot = -1;
        if (pos >= 0 && (u32)req < (u32)num_reqs && pos / block_size < max_blocks) {
            const long long page = block_table[(long long)req * max_blocks + pos / block_size];
            const long long s = page * block_size + pos % block_size;
            slot = page >= 0 && s <= 0x7FFFFFFFll ? (int)s : -1;
        }
        out[i] = slot;
    }
}
