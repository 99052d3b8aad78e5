// Lightning-indexer scoring on the tensor cores (DESIGN.md section 5):
//
//   I[t, s] = s_k[s] * sum_h W[t, h] * relu(sum_d q8[t, h, d] * k8[s, d])
//
// inside each query row's window, -inf outside (every output element written).
//
// Prefill on Hopper runs the persistent warp-specialized cps_mqa_logits_ws*, and decode of
// 1 or 2 query rows of 64 padded heads over pages of 64 keys (fp8 or MXFP4)
// cps_paged_mqa_logits{,_fp4}_ws_h64n{1,2} (both at the end of this file); everything else
// is cps_idx_cta:
// One CTA = one warpgroup (128 threads) = a block of query rows ("rows"):
//   * prefill (cps_mqa_logits_mma): 128 // hp query tokens, all their heads, against
//     the key tiles of [min ks, max ke) of those rows (tiles outside every row's window
//     are skipped and written -inf by a vectorised fill);
//   * decode (cps_paged_mqa_logits_*): the next_n rows of one request against one
//     fixed-size piece of its context (grid = pieces x requests, sized on the host to
//     fill whole waves of resident CTAs; long and short contexts balance because every
//     CTA gets at most `piece_tiles` pages, and pieces past a context only write -inf).
//     Each page is read once for all next_n rows (more than 128 columns: several
//     column chunks per page, weights in smem).
//
// Key tiles are streamed with cp.async into a ring of STAGES buffers (one barrier per
// tile); a tile of 64 contiguous keys (prefill, or a page of >= 64 keys) is copied with
// per-thread constant offsets, smaller pages go key by key through the page table.
//
// Operand swap: the key tile is the M side (64 keys, one warp = 16 keys), the query
// block is the N side (columns n = row * hp + head, hp = H rounded up to 8, zero
// padded). So the fp32 accumulator of a thread holds, for its two keys (g, g + 8),
// the columns 8i + 2t + {0, 1}: the ReLU-weighted head sum stays in registers
// (x + |x| = 2 relu(x), the 1/2 folded into the key scale), two shuffle-xor steps
// finish it across the 4 lanes that share a key, and the key scale is applied once.
//
// Shared memory holds the query block and a ring of key tiles, both K-major with
// 128-byte rows (D = 128 e4m3 codes) in the 128B-swizzled layout (16-byte chunk c of
// row r stored at chunk c ^ (r & 7)), filled with cp.async (zero-fill outside), so the
// same bytes feed either
//   * WG = true : wgmma.m64nNCk32 e4m3 (sm_90a), both operands by smem descriptor, or
//   * WG = false: mma.sync.m16n8k32 e4m3 with ldmatrix (any sm_89+).
// The accumulator layout of both is the same, so they share the epilogue. MXFP4 keys
// (FP4) differ: their packed codes stay unswizzled in the tile's upper half, each thread
// expands its wgmma A fragments from them into registers, and the head dimension of
// both operands runs in the MXFP4 order of cps_fp4_unit.

// CPS_IDX_D, CPS_IDX_TILE, CPS_IDX_THREADS, CPS_IDX_STAGES (key tiles in the prefill
// ring), CPS_IDX_MAX_ROWS and CPS_IDX_BT_CAP are #defined by the launcher
// (raw_kernels/indexer.py), which owns them.
#define CPS_IDX_TILE_BYTES (CPS_IDX_TILE * CPS_IDX_D)
#define CPS_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ void cps_cp_async4(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}

// ---- wgmma (sm_90a; CPS_HAS_WGMMA and the shared helpers in hopper.cuh) -----------

// The accumulator operands of an m64nN wgmma (N / 2 floats a thread): the register
// list of the instruction text and the asm outputs.
#define CPS_IDX_ACC32_REGS \
    "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define CPS_IDX_ACC32_OUT(d) \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), \
    "+f"((d)[6]), "+f"((d)[7]), "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), \
    "+f"((d)[12]), "+f"((d)[13]), "+f"((d)[14]), "+f"((d)[15]), "+f"((d)[16]), \
    "+f"((d)[17]), "+f"((d)[18]), "+f"((d)[19]), "+f"((d)[20]), "+f"((d)[21]), \
    "+f"((d)[22]), "+f"((d)[23]), "+f"((d)[24]), "+f"((d)[25]), "+f"((d)[26]), \
    "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), "+f"((d)[30]), "+f"((d)[31])
#define CPS_IDX_ACC64_REGS \
    CPS_IDX_ACC32_REGS "," \
    "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
    "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
#define CPS_IDX_ACC64_OUT(d) CPS_IDX_ACC32_OUT(d), CPS_IDX_ACC32_OUT((d) + 32)

__device__ __forceinline__ void cps_wgmma_m64n64k32(float* d, u64 da, u64 db, int scale_d) {
#if CPS_HAS_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
        CPS_IDX_ACC32_REGS
        "}, %32, %33, p, 1, 1;\n}\n"
        : CPS_IDX_ACC32_OUT(d)
        : "l"(da), "l"(db), "r"(scale_d));
#else
    CPS_WGMMA_MISSING();
#endif
}

__device__ __forceinline__ void cps_wgmma_m64n128k32(float* d, u64 da, u64 db, int scale_d) {
#if CPS_HAS_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        CPS_IDX_ACC64_REGS
        "}, %64, %65, p, 1, 1;\n}\n"
        : CPS_IDX_ACC64_OUT(d)
        : "l"(da), "l"(db), "r"(scale_d));
#else
    CPS_WGMMA_MISSING();
#endif
}

// A from registers (MXFP4 keys expanded to e4m3 in registers): a[0..3] hold k-bytes
// [4t, 4t + 4) of rows g and g + 8, then [16 + 4t, 20 + 4t) of the same rows (lane
// 4 g + t of each warp's 16 rows), as the A fragment of mma.sync m16n8k32. A is scaled
// by -1 (imm-scale-a): the fragments hold the keys' negations (cps_e2m1x8_to_neg_e4m3),
// an exact sign flip.
__device__ __forceinline__ void cps_wgmma_m64n64k32_rs(float* d, const u32* a, u64 db,
                                                         int scale_d) {
#if CPS_HAS_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
        CPS_IDX_ACC32_REGS
        "}, {%32, %33, %34, %35}, %36, p, -1, 1;\n}\n"
        : CPS_IDX_ACC32_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
#else
    CPS_WGMMA_MISSING();
#endif
}

__device__ __forceinline__ void cps_wgmma_m64n128k32_rs(float* d, const u32* a, u64 db,
                                                         int scale_d) {
#if CPS_HAS_WGMMA
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        CPS_IDX_ACC64_REGS
        "}, {%64, %65, %66, %67}, %68, p, -1, 1;\n}\n"
        : CPS_IDX_ACC64_OUT(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
#else
    CPS_WGMMA_MISSING();
#endif
}

// ---- mma.sync (sm_89+) ---------------------------------------------------------

__device__ __forceinline__ void cps_mma_e4m3(float* d, const u32* a, u32 b0, u32 b1, bool zero) {
    const float c0 = zero ? 0.f : d[0], c1 = zero ? 0.f : d[1];
    const float c2 = zero ? 0.f : d[2], c3 = zero ? 0.f : d[3];
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1),
          "f"(c0), "f"(c1), "f"(c2), "f"(c3));
}

// ---- the shared CTA body -------------------------------------------------------

// -inf into row[c0:c1) by NT threads (tid < NT; 16-byte stores where aligned).
template <int NT = CPS_IDX_THREADS>
__device__ __forceinline__ void cps_fill_neg_inf(float* row, int c0, int c1, int tid) {
    if (c1 <= c0) return;
    float* p = row + c0;
    const int n = c1 - c0;
    int head = (int)(((16u - ((u32)(size_t)p & 15u)) & 15u) >> 2);
    head = min(head, n);
    const float ninf = CPS_NEG_INF;
    if (tid < head) p[tid] = ninf;
    float4* p4 = reinterpret_cast<float4*>(p + head);
    const int n4 = (n - head) >> 2;
    const float4 v = make_float4(ninf, ninf, ninf, ninf);
    for (int i = tid; i < n4; i += NT) p4[i] = v;
    const int t0 = head + 4 * n4;
    if (tid < n - t0) p[t0 + tid] = ninf;
}

// The epilogue's head sum, one column group (8 columns; 2 a thread, of keys key0 and
// key0 + 8) at a time: x + |x| = 2 relu(x) (the 1/2 is folded into the key scale).
__device__ __forceinline__ void cps_head_sum_add(float (&hs)[4], float w0, float w1, float x0,
                                                 float x1, float x2, float x3) {
    hs[0] = fmaf(w0, x0 + fabsf(x0), hs[0]);
    hs[1] = fmaf(w1, x1 + fabsf(x1), hs[1]);
    hs[2] = fmaf(w0, x2 + fabsf(x2), hs[2]);
    hs[3] = fmaf(w1, x3 + fabsf(x3), hs[3]);
}

// DeepGEMM's order of a row's head sum. nvcc compiles DeepGEMM's epilogue (sum =
// relu(x_0) w_0, then sum += relu(x_j) w_j for each later column group j) with its first
// addition fused the other way round: group 1's products rounded, group 0's fused onto
// them, then groups 2, 3, ... fused in turn (the SASS of sm90_fp8_paged_mqa_logits and
// sm90_fp8_mqa_logits; benchmarks/probe_deepgemm_bits.py: in the order written, about
// 11% of the logits differed from DeepGEMM's in the last bits). cps_head_sum_add rounds
// the first group it is given (hs = 0) and fuses the rest onto it, so a row's first two
// groups go to it swapped.
//
// cps_groups_in_dg_order visits NG column groups so: where group i begins a row of two or
// more (bit i of hold), add(i + 1) then add(i), and add(i + 1) is not repeated; after
// each i, end(i) (the caller's row-end test). hold known at compile time folds to a
// fixed order.
template <int NG, class Add, class End>
__device__ __forceinline__ void cps_groups_in_dg_order(u32 hold, Add&& add, End&& end) {
#pragma unroll
    for (int i = 0; i < NG; ++i) {
        if (i + 1 < NG && ((hold >> i) & 1u)) {
            add(i + 1);
            add(i);
        } else if (i == 0 || !((hold >> (i - 1)) & 1u)) {
            add(i);
        }
        end(i);
    }
}

// Bits over a column chunk's ngroups groups (8 columns each) of rpc rows of hp padded
// heads: done, bit i where a row ends with group i; hold, bit i where a row of two or
// more groups begins with group i (cps_groups_in_dg_order).
struct CpsRowGroups {
    u32 done, hold;
};
__device__ __forceinline__ CpsRowGroups cps_row_groups(int rpc, int hp, int ngroups) {
    CpsRowGroups m = {0u, 0u};
    for (int k = 0; k < rpc; ++k) {
        const int b = k * hp / 8, e = (k + 1) * hp / 8 - 1;
        if (e < ngroups) {
            m.done |= 1u << e;
            if (e > b) m.hold |= 1u << b;
        }
    }
    return m;
}

// A row's logits of keys key0 / key0 + 8: the head sums times the key scales (s0, s1,
// with the 1/2 of x + |x|), then summed across the 4 lanes that share those keys (every
// lane gets them). Scale, then lane sum: DeepGEMM's order of operations.
__device__ __forceinline__ float2 cps_head_sum_finish(const float (&hs)[4], float s0, float s1) {
    float v0 = (hs[0] + hs[1]) * s0, v1 = (hs[2] + hs[3]) * s1;
    v0 += __shfl_xor_sync(0xffffffffu, v0, 1);
    v1 += __shfl_xor_sync(0xffffffffu, v1, 1);
    v0 += __shfl_xor_sync(0xffffffffu, v0, 2);
    v1 += __shfl_xor_sync(0xffffffffu, v1, 2);
    return make_float2(v0, v1);
}

// ... only the logit of key key0 + 8 (t & 1), for lane t of the quad (the warp-specialized
// kernels' lanes 0 and 1 store keys key0 and key0 + 8): a reduce-scatter, two shuffles
// where every lane getting both keys takes four (and a select at the store). The same
// additions in the same order: lane t adds its partner's partial to its own, then the
// pair's sum across the quad, (a_t + a_t^1) + (a_t^2 + a_t^3), and a sum of two floats
// does not depend on their order, so the bits are cps_head_sum_finish's.
__device__ __forceinline__ float cps_head_sum_finish_lane(const float (&hs)[4], float s0,
                                                         float s1, int t) {
    const float v0 = (hs[0] + hs[1]) * s0, v1 = (hs[2] + hs[3]) * s1;
    const bool odd = t & 1;
    const float v = (odd ? v1 : v0) + __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

struct CpsIdxSmem {
    u8* q;          // [nch * NC rows][128 B], swizzled
    u8* k;          // [STAGES][64 rows][128 B], swizzled
    float* ks;      // [STAGES][64] key scales
    float* w;       // [nch * NC] head weights of the columns (decode)
    int* lo;        // [MAX_ROWS] window start of each row
    int* hi;        // [MAX_ROWS] window end of each row
    int* bt;        // [BT_CAP] page ids of the piece (decode)
};

__host__ __device__ __forceinline__ constexpr int cps_idx_smem_bytes(int q_rows, int stages) {
    return 1024 + q_rows * CPS_IDX_D + stages * (CPS_IDX_TILE_BYTES + CPS_IDX_TILE * 4)
           + q_rows * 4 + 2 * CPS_IDX_MAX_ROWS * 4 + CPS_IDX_BT_CAP * 4;
}
// The launcher's smem_bytes() at three CTAs it plans: both are affine in q_rows and
// stages, so three points not on one line make them the same function. A launch with
// less shared memory than cps_idx_carve lays out would write past it.
static_assert(cps_idx_smem_bytes(64, 3) == CPS_IDX_SMEM_Q64_S3
                  && cps_idx_smem_bytes(128, 4) == CPS_IDX_SMEM_Q128_S4
                  && cps_idx_smem_bytes(512, 4) == CPS_IDX_SMEM_Q512_S4,
              "the launcher's smem_bytes() is not what cps_idx_carve lays out");

__device__ __forceinline__ CpsIdxSmem cps_idx_carve(u8* raw, int q_rows, int stages) {
    const u32 a = cps_smem_u32(raw);
    u8* base = raw + ((1024u - (a & 1023u)) & 1023u);
    CpsIdxSmem s;
    s.q = base;
    s.k = s.q + q_rows * CPS_IDX_D;
    s.ks = reinterpret_cast<float*>(s.k + stages * CPS_IDX_TILE_BYTES);
    s.w = s.ks + stages * CPS_IDX_TILE;
    s.lo = reinterpret_cast<int*>(s.w + q_rows);
    s.hi = s.lo + CPS_IDX_MAX_ROWS;
    s.bt = s.hi + CPS_IDX_MAX_ROWS;
    return s;
}

// Everything after the row windows are known (in s.lo / s.hi for rows < nrows).
//   q_row0:  global row of the CTA's row 0 in q [rows, H, 128] and w [rows, H]
//   rpc:     rows per column chunk (NC // hp); nch chunks
//   own:     [own_lo, own_hi) the output columns this CTA writes for its rows
//   key source: PAGED ? pages (cache, bt_row, page_bytes, bs_shift) : kc / ksc rows
// ---- MXFP4 keys -----------------------------------------------------------------
// A key of D = 128 values is 64 bytes of packed e2m1 codes (the even element in the
// low nibble) and one int32 of 4 ue8m0 scale bytes, one per 32 values. Hopper has no
// fp4 MMA, but every e2m1 value times a power of two down to 2**-9 is an e4m3 value:
// a group g with scale byte e_g is expanded into the e4m3 A fragments (in registers,
// cps_idx_cta) as code * 2**(e_g - E), E = the key's largest scale byte, and the key
// scale becomes
// 2**(E - 127), applied after the MMA like an fp8 key's. Exact unless a group is
// more than 2**9 below the key's largest (its values then round to e4m3 subnormals
// or 0: a relative error far below the e2m1 rounding of the large groups).

// The MXFP4 kernels' order of the head dimension in the MMA (any permutation of it,
// applied to both operands, leaves every dot product as it is): k-step ks, position
// p = 16 piece + 4 t + j (the byte j of the A-fragment word of lane t) is value
// 32 t + 8 ks + 4 piece + j, so lane t's values are group t (one scale) and 16
// contiguous packed bytes. In 4-byte units: MMA unit u = 8 ks + 4 piece + t holds value
// unit 8 t + 2 ks + piece (the query block is stored in this order).
__host__ __device__ __forceinline__ int cps_fp4_unit(int u) {
    return 8 * (u & 3) + 2 * (u >> 3) + ((u >> 2) & 1);
}

// Two floats to two e4m3 bytes (lo in the low byte), round to nearest even, saturating.
__device__ __forceinline__ u32 cps_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return (u32)r;
}

// The e4m3 bytes of the 8 e2m1 magnitudes times 2**d (d <= 0) as a byte-permute table
// (magnitude code m picks byte m of {lo, hi}). While every nonzero entry stays normal
// (d >= -5: 0.5 * 2**-5 is e4m3's least normal, 2**-6) the exponent field just drops by
// -d: two integer operations; below that they are converted (4 cvt, round to nearest
// even, down to subnormals and 0). Both give the bytes cvt gives (the values are exact).
__device__ __forceinline__ void cps_e2m1_table(int d, u32& lo, u32& hi) {
    if (d >= -5) {
        const u32 drop = (u32)(-d) << 3;                   // exponent field: bits 3..6
        lo = 0x3C383000u - drop * 0x01010100u;             // 0, 0.5, 1, 1.5 (0 stays 0)
        hi = 0x4C484440u - drop * 0x01010101u;             // 2, 3, 4, 6
    } else {
        const float f = __uint_as_float((u32)(127 + max(d, -100)) << 23);    // 2**d
        lo = cps_e4m3x2(0.f, 0.5f * f) | (cps_e4m3x2(f, 1.5f * f) << 16);
        hi = cps_e4m3x2(2.f * f, 3.f * f) | (cps_e4m3x2(4.f * f, 6.f * f) << 16);
    }
}

// Eight e2m1 codes (nibble i of c is element i) to the e4m3 bytes of their negations:
// byte i of lo4 is element i, byte i of hi4 element 4 + i, each times -1 (the wgmma that
// reads them scales A by -1: cps_wgmma_m64n*k32_rs). The magnitude comes from the table,
// the sign from bit 3 of each nibble: prmt with a selector nibble's msb set replicates
// the selected byte's msb (its sign mode), so permuting the bytes of k40 = 0x40404040 by
// the codes gives 0x40 where a code is positive and 0 where negative; doubled and added
// to the magnitude (disjoint bits, no carry) it sets the sign bit of the positive codes.
// That is one instruction (an IMAD) where the code's own sign (0x80 / 0xFF from k80) took a
// shift and a mask-or. k40 comes in a register: as an immediate, ptxas re-materialized
// it before every one of these prmt (16 moves a page a thread).
__device__ __forceinline__ void cps_e2m1x8_to_neg_e4m3(u32 c, u32 lo, u32 hi, u32 k40,
                                                       u32& lo4, u32& hi4) {
    const u32 ch = c >> 16;
    u32 p_lo, p_hi;
    asm("prmt.b32 %0, %1, %1, %2;" : "=r"(p_lo) : "r"(k40), "r"(c));
    asm("prmt.b32 %0, %1, %1, %2;" : "=r"(p_hi) : "r"(k40), "r"(ch));
    lo4 = __byte_perm(lo, hi, c & 0x7777u) + (p_lo << 1);      // (no sign mode in the table)
    hi4 = __byte_perm(lo, hi, ch & 0x7777u) + (p_hi << 1);
}

// 0 in a register ptxas cannot fold (the kernels' threads number at most 1024: tid >> 10
// is 0), for a value the compiler must not see as a constant (cps_k40, the ws decode
// producer's early copies).
__device__ __forceinline__ u32 cps_opaque_zero() {
    return threadIdx.x >> 10;
}

// 0x40404040 in a register ptxas cannot fold back into an immediate (cps_opaque_zero). A
// compiler that used tid's range would fold it again and bring the 16 moves back,
// silently (the logits stay the same): the SASS shows them as an IMAD.U32 / MOV of
// 0x40404040 before each sign PRMT.
__device__ __forceinline__ u32 cps_k40() {
    return 0x40404040u | cps_opaque_zero();
}

// Byte i of w, zero-extended: one prmt (shift-and-mask takes two).
__device__ __forceinline__ int cps_byte(u32 w, int i) {
    return (int)__byte_perm(w, 0u, 0x4440u | (u32)i);
}

// A thread's A fragments of a 64-key MXFP4 tile (keys key0 and key0 + 8, lane t of the
// quad), expanded from the packed codes into registers. ``codes``: the tile's codes in
// shared memory, key r at 64 r; ``words``: its 4 scale bytes a key. In the MXFP4 k order
// (cps_fp4_unit) lane t's values of every k-step are group t of the key, 16 contiguous
// bytes: one shared load and one table (its codes times 2**(e_t - E), E the key's largest
// scale byte) a key; word ks holds k-step ks, its low half a[0] / a[1], its high half
// a[2] / a[3]. The key scales (times the epilogue's 0.5) become 0.5 * 2**(E - 127).
// k40: cps_k40(). The fragments hold the keys' negations (cps_e2m1x8_to_neg_e4m3).
__device__ __forceinline__ void cps_fp4_a_fragments(const u8* codes, const u32* words, int key0,
                                                    int t, u32 k40, u32 (&afp4)[16], float& sk0,
                                                    float& sk1) {
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        const int r = key0 + 8 * rh;
        const u32 word = words[r];
        const uint4 pk = *reinterpret_cast<const uint4*>(codes + r * (CPS_IDX_D / 2) + 16 * t);
        const int e_max = max(max(cps_byte(word, 0), cps_byte(word, 1)),
                              max(cps_byte(word, 2), cps_byte(word, 3)));
        const float ks_f = 0.5f * __uint_as_float((u32)e_max << 23);
        if (rh == 0) sk0 = ks_f; else sk1 = ks_f;
        u32 lo, hi;
        cps_e2m1_table(cps_byte(word, t) - e_max, lo, hi);
        const u32 pw[4] = {pk.x, pk.y, pk.z, pk.w};
#pragma unroll
        for (int ks = 0; ks < 4; ++ks)
            cps_e2m1x8_to_neg_e4m3(pw[ks], lo, hi, k40, afp4[4 * ks + rh], afp4[4 * ks + 2 + rh]);
    }
}

// HP > 0: the padded head count hp is HP, known at compile time (then rpc = NC / HP):
// the column decomposition folds to constants and so does the epilogue's row-end mask,
// whose 8-column groups otherwise each carry a runtime test and a branch that keeps the
// compiler from moving the next group's weight loads ahead (decode kernels _h64).
template <int NC, bool WG, bool PAGED, bool WREG, int STAGES, bool FP4 = false, int HP = 0>
__device__ __forceinline__ void cps_idx_cta(
        const CpsIdxSmem& s, int nrows, int rpc, int nch, int H, int hp,
        const u8* __restrict__ q, const float* __restrict__ w, long long q_row0,
        const u8* __restrict__ kc, const float* __restrict__ ksc,
        int bt_first, long long page_bytes, int bs_shift,
        float* __restrict__ out, long long out_row0, long long ld, int own_lo, int own_hi) {
    static_assert(HP == 0 || (HP % 8 == 0 && NC % HP == 0), "HP: a multiple of 8 dividing NC");
    static_assert(!FP4 || WG, "MXFP4 A fragments hold the keys' negations: only the wgmma "
                              "path (imm-scale-a -1) multiplies them back");
    if constexpr (HP > 0) {
        hp = HP;
        rpc = NC / HP;
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;

    // Key range of the block: [lo, hi) over the non-empty windows, within own; and
    // [lo_all, hi_all), the keys inside every row's window (a tile within it, on a
    // present page, is written without per-key window checks).
    int lo = 0x7FFFFFFF, hi = -0x7FFFFFFF, lo_all = -0x7FFFFFFF, hi_all = 0x7FFFFFFF;
    for (int r = 0; r < nrows; ++r) {
        const int a = s.lo[r], b = s.hi[r];
        if (b > a) { lo = min(lo, a); hi = max(hi, b); }
        lo_all = max(lo_all, a);
        hi_all = min(hi_all, b);
    }
    lo = max(lo, own_lo);
    hi = min(hi, own_hi);
    int t_lo = own_lo, t_hi = own_lo, ntiles = 0;
    if (hi > lo) {
        t_lo = own_lo + ((lo - own_lo) & ~(CPS_IDX_TILE - 1));
        ntiles = (hi - t_lo + CPS_IDX_TILE - 1) / CPS_IDX_TILE;
        t_hi = min(t_lo + ntiles * CPS_IDX_TILE, own_hi);
    }
    // -inf outside the visited tiles.
    for (int r = 0; r < nrows; ++r) {
        float* row = out + (out_row0 + r) * ld;
        cps_fill_neg_inf(row, own_lo, t_lo, tid);
        cps_fill_neg_inf(row, t_hi, own_hi, tid);
    }
    if (ntiles == 0) return;
    const int bs_mask = (1 << bs_shift) - 1;

    // Query block (cp.async group 0) and column weights.
    const int q_rows = nch * NC;
    const u32 sq = cps_smem_u32(s.q);
    // Two copies of the column decomposition (fp8: 16-byte copies; MXFP4: 4-byte ones
    // in the MXFP4 order): one loop over both changed every decode kernel's SASS.
    if constexpr (!FP4) {
        for (int idx = tid; idx < q_rows * 8; idx += CPS_IDX_THREADS) {
            const int n = idx >> 3, c = idx & 7;
            const int ch = n / NC, nn = n % NC;
            const int rl = nn / hp, h = nn - rl * hp;
            const int r = ch * rpc + rl;
            const bool valid = rl < rpc && r < nrows && h < H;
            const u8* src = valid ? q + ((q_row0 + r) * H + h) * CPS_IDX_D + c * 16 : q;
            cps_cp_async16(sq + n * CPS_IDX_D + ((c ^ (n & 7)) << 4), src, valid);
        }
    } else {
        // MXFP4 keys: the head dimension in the MXFP4 order (cps_fp4_unit), 4 bytes a
        // copy; byte unit u of a row (of the MMA's k order) holds query unit
        // cps_fp4_unit(u).
        for (int idx = tid; idx < q_rows * 32; idx += CPS_IDX_THREADS) {
            const int n = idx >> 5, u = idx & 31;
            const int ch = n / NC, nn = n % NC;
            const int rl = nn / hp, h = nn - rl * hp;
            const int r = ch * rpc + rl;
            const bool valid = rl < rpc && r < nrows && h < H;
            const u8* src =
                valid ? q + ((q_row0 + r) * H + h) * CPS_IDX_D + 4 * cps_fp4_unit(u) : q;
            cps_cp_async4(sq + n * CPS_IDX_D + ((((u >> 2) ^ (n & 7))) << 4) + 4 * (u & 3), src,
                          valid);
        }
    }
    cps_cp_async_commit();
    // Column weights: registers (one chunk: the thread's columns 8i + 2t + {0,1}) or smem.
    float wreg[WREG ? NC / 4 : 1];
    if constexpr (!WREG) {
        for (int n = tid; n < q_rows; n += CPS_IDX_THREADS) {
            const int ch = n / NC, nn = n % NC;
            const int rl = nn / hp, h = nn - rl * hp;
            const int r = ch * rpc + rl;
            const bool valid = rl < rpc && r < nrows && h < H;
            s.w[n] = valid ? w[(q_row0 + r) * H + h] : 0.f;
        }
    } else {
#pragma unroll
        for (int i = 0; i < NC / 4; ++i) {
            const int n = 8 * (i >> 1) + 2 * t + (i & 1);
            const int rl = n / hp, h = n - rl * hp;
            const bool valid = rl < rpc && rl < nrows && h < H;
            wreg[WREG ? i : 0] = valid ? w[(q_row0 + rl) * H + h] : 0.f;
        }
    }
    const CpsRowGroups groups = cps_row_groups(rpc, hp, NC / 8);
    const u32 done_mask = groups.done;

    const u32 sk = cps_smem_u32(s.k);
    const u32 sks = cps_smem_u32(s.ks);
    // A tile whose 64 keys are contiguous in memory (prefill rows; a page of >= 64 keys)
    // is copied with per-thread constant offsets: thread tid moves bytes [16 tid, +16) of
    // each 2 KB quarter (key rows 16 it + tid / 8, chunk tid % 8).
    const bool contiguous = !PAGED || bs_shift >= 6;
    const int rr = tid >> 3;
    const u32 dst_off = rr * CPS_IDX_D + (((tid & 7) ^ (rr & 7)) << 4);
    auto load_tile = [&](int j) {
        if (j < ntiles) {
            const int buf = j % STAGES;
            const int t0 = t_lo + j * CPS_IDX_TILE;
            const u32 kdst = sk + buf * CPS_IDX_TILE_BYTES;
            if (contiguous) {
                const u8* codes;
                const u8* scales;
                int lim_keys = hi - t0;                // keys of the tile that exist
                // key bytes of the codes: 128 (e4m3) or 64 (packed e2m1)
                constexpr int KB = FP4 ? CPS_IDX_D / 2 : CPS_IDX_D;
                if constexpr (PAGED) {
                    const int pg = s.bt[(t0 >> bs_shift) - bt_first];
                    if (pg < 0) lim_keys = 0;          // out-of-range page: nothing read
                    const u8* page = kc + (long long)max(pg, 0) * page_bytes;
                    codes = page + (long long)(t0 & bs_mask) * KB;
                    scales = page + (long long)(1 << bs_shift) * KB + (t0 & bs_mask) * 4;
                } else {
                    codes = kc + (long long)t0 * CPS_IDX_D;
                    scales = reinterpret_cast<const u8*>(ksc + t0);
                }
                if constexpr (FP4) {
                    // The 4 KB of packed codes go, unswizzled (key r at 64 r), to the
                    // tile's upper half; each thread expands its A fragments from there.
#pragma unroll
                    for (int it = 0; it < 2; ++it) {
                        const bool valid = 32 * it + (tid >> 2) < lim_keys;
                        cps_cp_async16(kdst + CPS_IDX_TILE_BYTES / 2 + it * 2048 + tid * 16,
                                       valid ? codes + it * 2048 + tid * 16 : kc, valid);
                    }
                } else {
                    const int lim = lim_keys - rr;     // rows 16 it + rr < lim_keys are keys
#pragma unroll
                    for (int it = 0; it < 4; ++it) {
                        const bool valid = 16 * it < lim;
                        cps_cp_async16(kdst + it * 2048 + dst_off,
                                       valid ? codes + it * 2048 + tid * 16 : kc, valid);
                    }
                }
                if (tid < CPS_IDX_TILE) {
                    const bool valid = tid < lim_keys;
                    cps_cp_async4(sks + (buf * CPS_IDX_TILE + tid) * 4, valid ? scales + tid * 4 : kc,
                                  valid);
                }
            } else if constexpr (!FP4) {   // (MXFP4 kernels run on pages >= 64 keys only)
#pragma unroll
                for (int it = 0; it < 4; ++it) {
                    const int idx = it * CPS_IDX_THREADS + tid;
                    const int r = idx >> 3, c = idx & 7;
                    const int pos = t0 + r;
                    const long long pg = pos < hi ? s.bt[(pos >> bs_shift) - bt_first] : -1;
                    const bool valid = pg >= 0;
                    const u8* src = kc;
                    if (valid) {
                        src = kc + pg * page_bytes + (long long)(pos & bs_mask) * CPS_IDX_D + c * 16;
                    }
                    cps_cp_async16(kdst + r * CPS_IDX_D + ((c ^ (r & 7)) << 4), src, valid);
                }
                if (tid < CPS_IDX_TILE) {
                    const int pos = t0 + tid;
                    const long long pg = pos < hi ? s.bt[(pos >> bs_shift) - bt_first] : -1;
                    const bool valid = pg >= 0;
                    const void* src = kc;
                    if (valid) {
                        src = kc + pg * page_bytes + ((long long)(1 << bs_shift) << 7)
                              + (long long)(pos & bs_mask) * 4;
                    }
                    cps_cp_async4(sks + (buf * CPS_IDX_TILE + tid) * 4, src, valid);
                }
            }
        }
        cps_cp_async_commit();
    };

#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) load_tile(j);

    float acc[WG ? NC / 2 : 1];
    for (int j = 0; j < ntiles; ++j) {
        cps_cp_async_wait<STAGES - 2>();
        cps_fence_proxy_async();
        __syncthreads();
        load_tile(j + STAGES - 1);
        const int buf = j % STAGES;
        const int t0 = t_lo + j * CPS_IDX_TILE;
        const u32 a_addr = sk + buf * CPS_IDX_TILE_BYTES;
        // Decode: every key of the tile inside every row's window and on a present page (one
        // page a tile when contiguous): the epilogue stores without checks (uniform). Not in
        // prefill, whose causal windows rarely contain a whole tile for every row: there the
        // extra state cost more (measured: T=S=8192 0.82 -> 0.90 ms) than it saved.
        bool whole = false;
        if constexpr (PAGED) {
            whole = t0 >= lo_all && t0 + CPS_IDX_TILE <= min(hi_all, t_hi);
            whole = whole && contiguous && s.bt[(t0 >> bs_shift) - bt_first] >= 0;
        }
        const int key0 = 16 * warp + g;
        float sk0, sk1;
        // MXFP4: each thread expands its own A fragments (cps_fp4_a_fragments).
        u32 afp4[FP4 ? 16 : 1];
        if constexpr (FP4) {
            cps_fp4_a_fragments(s.k + buf * CPS_IDX_TILE_BYTES + CPS_IDX_TILE_BYTES / 2,
                                reinterpret_cast<const u32*>(s.ks) + buf * CPS_IDX_TILE, key0, t,
                                cps_k40(), afp4, sk0, sk1);
        } else {
            sk0 = 0.5f * s.ks[buf * CPS_IDX_TILE + key0];
            sk1 = 0.5f * s.ks[buf * CPS_IDX_TILE + key0 + 8];
        }

        u32 afr[WG ? 1 : 16];
        if constexpr (!WG) {
            // A fragments (16 keys of this warp x 128 d): matrices (rows +0/+8) x (chunk 2ks/2ks+1)
            const int m = lane >> 3;
            const int row = 16 * warp + (lane & 7) + ((m & 1) << 3);
#pragma unroll
            for (int ks = 0; ks < 4; ++ks)
                cps_ldmatrix_x4(&afr[WG ? 0 : 4 * ks],
                                a_addr + row * CPS_IDX_D + (((2 * ks + (m >> 1)) ^ (lane & 7)) << 4));
        }

        for (int ch = 0; ch < nch; ++ch) {
            const u32 b_addr = sq + ch * NC * CPS_IDX_D;
            // Epilogue state: relu-weighted head sums of keys key0 / key0 + 8, one row at
            // a time (row r's columns end at column group i when bit i of done_mask is set;
            // a row's groups added in DeepGEMM's order, cps_groups_in_dg_order).
            float hs[4] = {0.f, 0.f, 0.f, 0.f};
            int r = ch * rpc;
            auto add = [&](int i, float x0, float x1, float x2, float x3) {
                float w0, w1;
                if constexpr (!WREG) {
                    const float2 wv = *reinterpret_cast<const float2*>(s.w + ch * NC + 8 * i + 2 * t);
                    w0 = wv.x;
                    w1 = wv.y;
                } else {
                    w0 = wreg[WREG ? 2 * i : 0];
                    w1 = wreg[WREG ? 2 * i + 1 : 0];
                }
                cps_head_sum_add(hs, w0, w1, x0, x1, x2, x3);
            };
            auto end = [&](int i) {
                if ((done_mask >> i) & 1u) {
                    const float2 v2 = cps_head_sum_finish(hs, sk0, sk1);
                    if (r < nrows && t < 2 && whole) {
                        out[(out_row0 + r) * ld + t0 + key0 + 8 * t] = t ? v2.y : v2.x;
                    } else if (r < nrows && t < 2) {
                        const int col = t0 + key0 + 8 * t;
                        if (col < t_hi) {
                            const float v = t ? v2.y : v2.x;
                            bool in = col >= s.lo[r] && col < s.hi[r];
                            if constexpr (PAGED) in = in && s.bt[(col >> bs_shift) - bt_first] >= 0;
                            out[(out_row0 + r) * ld + col] = in ? v : CPS_NEG_INF;
                        }
                    }
                    ++r;
                    hs[0] = hs[1] = hs[2] = hs[3] = 0.f;
                }
            };
            if constexpr (WG) {
                if constexpr (FP4) cps_fence_regs(afp4);     // written before the fence
                cps_wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < 4; ++ks) {
                    const u64 db = cps_wgmma_desc(b_addr + 32 * ks, 0, 1024);
                    if constexpr (FP4) {
                        const u32* a = &afp4[FP4 ? 4 * ks : 0];
                        if constexpr (NC == 64) cps_wgmma_m64n64k32_rs(acc, a, db, ks);
                        else cps_wgmma_m64n128k32_rs(acc, a, db, ks);
                    } else {
                        const u64 da = cps_wgmma_desc(a_addr + 32 * ks, 0, 1024);
                        if constexpr (NC == 64) cps_wgmma_m64n64k32(acc, da, db, ks);
                        else cps_wgmma_m64n128k32(acc, da, db, ks);
                    }
                }
                cps_wgmma_commit();
                cps_wgmma_wait<0>();
                cps_fence_regs(acc);
                if constexpr (FP4) cps_fence_regs(afp4);     // the next tile rewrites them
                cps_groups_in_dg_order<NC / 8>(
                    groups.hold,
                    [&](int i) {
                        add(i, acc[4 * i], acc[4 * i + 1], acc[4 * i + 2], acc[4 * i + 3]);
                    },
                    end);
            } else {
                // Each group's products made where they are added (a row's second group's
                // before its first: no group's outputs held across another's).
                const int m = lane >> 3;
                cps_groups_in_dg_order<NC / 8>(
                    groups.hold,
                    [&](int i) {
                        const u32 brow = b_addr + (8 * i + (lane & 7)) * CPS_IDX_D;
                        u32 b[8];
                        cps_ldmatrix_x4(b, brow + ((m ^ (lane & 7)) << 4));
                        cps_ldmatrix_x4(b + 4, brow + (((4 + m) ^ (lane & 7)) << 4));
                        float d[4];
#pragma unroll
                        for (int ks = 0; ks < 4; ++ks)
                            cps_mma_e4m3(d, &afr[WG ? 0 : 4 * ks], b[2 * ks], b[2 * ks + 1], ks == 0);
                        add(i, d[0], d[1], d[2], d[3]);
                    },
                    end);
            }
        }
    }
    cps_cp_async_wait<0>();
}

// ---- prefill -------------------------------------------------------------------

__device__ __forceinline__ void cps_mqa_logits_body(
        const u8* __restrict__ q, const u8* __restrict__ kc, const float* __restrict__ ksc,
        const float* __restrict__ w, const int* __restrict__ ks, const int* __restrict__ ke,
        float* __restrict__ out, int M, int N, int H, int hp, int nblocks) {
    extern __shared__ u8 cps_idx_smem_raw[];
    const int rpc = 128 / hp;
    const CpsIdxSmem s = cps_idx_carve(cps_idx_smem_raw, 128, CPS_IDX_STAGES);
    const int blk = nblocks - 1 - (int)blockIdx.x;      // longest causal windows first
    const long long tok0 = (long long)blk * rpc;
    const int nrows = (int)min((long long)rpc, (long long)M - tok0);
    if (threadIdx.x < nrows) {
        // Windows are clamped to the keys that exist: an out-of-range ks / ke (production
        // mode, no host check) never reads past k codes or writes past the row.
        s.lo[threadIdx.x] = max(ks[tok0 + threadIdx.x], 0);
        s.hi[threadIdx.x] = min(ke[tok0 + threadIdx.x], N);
    }
    __syncthreads();
    cps_idx_cta<128, false, false, true, CPS_IDX_STAGES>(s, nrows, rpc, 1, H, hp, q, w, tok0, kc, ksc, 0, 0, 0,
                                out, tok0, (long long)N, 0, N);
}

extern "C" __global__ void __launch_bounds__(CPS_IDX_THREADS, 3)
cps_mqa_logits_mma(const u8* __restrict__ q, const u8* __restrict__ kc,
                   const float* __restrict__ ksc, const float* __restrict__ w,
                   const int* __restrict__ ks, const int* __restrict__ ke,
                   float* __restrict__ out, int M, int N, int H, int hp, int nblocks) {
    CPS_PDL_ENTRY();
    cps_mqa_logits_body(q, kc, ksc, w, ks, ke, out, M, N, H, hp, nblocks);
}

// ---- paged decode --------------------------------------------------------------

// grid (pieces, B): CTA (p, b) writes columns [p * piece_tiles * 64, ...) of the next_n
// rows of request b. Row (b, j) sees positions < L_b - next_n + j + 1 (1-D lens) or
// < lens[b, j] (2-D lens). The page ids of the piece are read together with the lengths
// (entries past the context are read but never used).
template <int NC, bool WG, bool WREG, int STAGES, bool FP4, int HP>
__device__ __forceinline__ void cps_paged_body(
        const u8* __restrict__ q, const u8* __restrict__ cache, const float* __restrict__ w,
        const int* __restrict__ lens, int lens_2d, const int* __restrict__ bt, int bt_cols,
        int num_blocks, float* __restrict__ out, int width, int next_n, int H, int hp, int nch,
        int bs_shift, int piece_tiles) {
    extern __shared__ u8 cps_idx_smem_raw[];
    const int rpc = NC / hp;
    const CpsIdxSmem s = cps_idx_carve(cps_idx_smem_raw, nch * NC, STAGES);
    const int b = blockIdx.y;
    const int own_lo = (int)blockIdx.x * piece_tiles * CPS_IDX_TILE;
    const int own_hi = min(own_lo + piece_tiles * CPS_IDX_TILE, width);
    const int tid = threadIdx.x;
    if (tid < next_n) {
        const int end = lens_2d ? lens[b * next_n + tid] : max(lens[b] - next_n + tid + 1, 0);
        s.lo[tid] = 0;
        s.hi[tid] = min(end, width);
    }
    const int bt_first = own_lo >> bs_shift;
    const int n_pages = ((own_hi - 1) >> bs_shift) - bt_first + 1;
    const int* bt_row = bt + (long long)b * bt_cols;
    // A page id outside [0, num_blocks), or a position past the table row, is stored
    // as -1: its keys are never read and score -inf.
    for (int i = tid; i < n_pages; i += CPS_IDX_THREADS) {
        const int p = bt_first + i;
        const int pg = p < bt_cols ? bt_row[p] : -1;
        s.bt[i] = (u32)pg < (u32)num_blocks ? pg : -1;
    }
    __syncthreads();
    const long long row0 = (long long)b * next_n;
    // fp8 pages: 128 code bytes and a float32 scale a key; MXFP4: 64 and an int32
    const long long page_bytes = (long long)(1 << bs_shift) * ((FP4 ? CPS_IDX_D / 2 : CPS_IDX_D) + 4);
    cps_idx_cta<NC, WG, true, WREG, STAGES, FP4, HP>(s, next_n, rpc, nch, H, hp, q, w, row0, cache, nullptr,
                                      bt_first, page_bytes, bs_shift,
                                      out, row0, (long long)width, own_lo, own_hi);
}

#define CPS_PAGED_KERNEL(NAME, NC, WG, WREG, STAGES, MINB, FP4, HP)                           \
    extern "C" __global__ void __launch_bounds__(CPS_IDX_THREADS, MINB)                       \
    NAME(const u8* __restrict__ q, const u8* __restrict__ cache, const float* __restrict__ w, \
         const int* __restrict__ lens, int lens_2d, const int* __restrict__ bt, int bt_cols,  \
         int num_blocks, float* __restrict__ out, int width, int next_n, int H, int hp,       \
         int nch, int bs_shift, int piece_tiles) {                                            \
        CPS_PDL_ENTRY();                                                                      \
        cps_paged_body<NC, WG, WREG, STAGES, FP4, HP>(q, cache, w, lens, lens_2d, bt,         \
                                                      bt_cols, num_blocks, out, width,        \
                                                      next_n, H, hp, nch, bs_shift,           \
                                                      piece_tiles);                           \
    }

// _n64: one chunk of 64 columns (weights in registers); _n128m: chunks of 128 columns,
// one or several (weights in smem: CPS_IDX_N128M_MINB = 5 CTAs an SM, measured faster
// than 4 with the weights in registers); _sS: S key tiles in the ring (the launcher's
// DECODE_STAGES = 3 for wgmma, MMA_STAGES = 4 for mma.sync); _h64: built for 64 padded
// heads (DeepSeek-V3.2's indexer; the launcher picks it when hp == 64), the others take
// hp at run time.
CPS_PAGED_KERNEL(cps_paged_mqa_logits_wgmma_n64_s3, 64, true, true, 3, 6, false, 0)
CPS_PAGED_KERNEL(cps_paged_mqa_logits_wgmma_n128m_s3, 128, true, false, 3, CPS_IDX_N128M_MINB,
                 false, 0)
CPS_PAGED_KERNEL(cps_paged_mqa_logits_wgmma_n64_h64_s3, 64, true, true, 3, 6, false, 64)
CPS_PAGED_KERNEL(cps_paged_mqa_logits_wgmma_n128m_h64_s3, 128, true, false, 3,
                 CPS_IDX_N128M_H64_MINB, false, 64)
CPS_PAGED_KERNEL(cps_paged_mqa_logits_mma_n64_s4, 64, false, true, 4, 3, false, 0)
CPS_PAGED_KERNEL(cps_paged_mqa_logits_mma_n128m_s4, 128, false, false, 4, 3, false, 0)
// MXFP4 keys (pages of at least 64 keys: the contiguous tile path), wgmma only; the
// 128-column kernel at 4 CTAs an SM (its A fragments in registers: at 5 it spilled).
CPS_PAGED_KERNEL(cps_paged_mqa_logits_fp4_wgmma_n64_s3, 64, true, true, 3, 6, true, 0)
CPS_PAGED_KERNEL(cps_paged_mqa_logits_fp4_wgmma_n128m_s3, 128, true, false, 3,
                 CPS_IDX_N128M_FP4_MINB, true, 0)
CPS_PAGED_KERNEL(cps_paged_mqa_logits_fp4_wgmma_n64_h64_s3, 64, true, true, 3,
                 CPS_IDX_N64_FP4_H64_MINB, true, 64)
CPS_PAGED_KERNEL(cps_paged_mqa_logits_fp4_wgmma_n128m_h64_s3, 128, true, false, 3,
                 CPS_IDX_N128M_FP4_MINB, true, 64)

// ---- prefill, warp-specialized (sm_90a) ---------------------------------------------
// Persistent CTAs (grid <= SMs) of CPS_IDX_WS_MATH math warpgroups and a producer
// warpgroup (the last). The CTA takes query blocks blockIdx.x, + gridDim.x, ... of the reversed
// block order (longest causal windows first, as cps_mqa_logits_*), 128 // hp tokens a
// block as there.
//   producer: per block, the rows' windows and the block's key range go into the Q
//     slot's metadata, the query block and its column weights into the slot (two slots:
//     the next block's queries load while this one's keys are scored); then the keys of
//     [t_lo, t_hi) in stages of CPS_IDX_WS_KEYS (64 a math warpgroup) with their scales
//     into a ring of CPS_IDX_WS_STAGES; then -inf outside [t_lo, t_hi) of the rows,
//     while the math warpgroups still work through the ring.
//   math warpgroup g: keys [64 g, 64 g + 64) of each stage against the whole query block,
//     the products and the epilogue of cps_idx_cta (bit-identical logits); a quarter
//     past t_hi is skipped.
// mbarriers: QFULL[2] (128 cp.async-completion arrivals for the weights, 32 after the
// metadata stores, one with the query block's TMA bytes), QEMPTY[2] and KEMPTY[S] (every
// math thread, after its wgmma read the slot), KFULL[S] (one arrival with the stage's TMA
// bytes). One producer thread issues the TMA copies: a query block (qmap: the query codes
// as [M][H][128 B]) and each stage's two (kmap: the keys' codes as [N][128 B]; smap: their
// scales as [N]), the codes under the 128-byte swizzle of the slots; what lies past a
// map's bounds lands as zeros. Keys past the rows' largest window end hi are loaded and
// never stored; they and every key outside a row's window score -inf.
// CPS_IDX_WS_MATH and CPS_IDX_WS_STAGES are #defined by the launcher.
#define CPS_IDX_WS_KEYS (CPS_IDX_TILE * CPS_IDX_WS_MATH)
#define CPS_IDX_WS_MATH_THREADS (128 * CPS_IDX_WS_MATH)
#define CPS_IDX_WS_THREADS (CPS_IDX_WS_MATH_THREADS + 128)
// Registers a thread: launched at the cap of __launch_bounds__(THREADS, 1) (5 warps on
// a scheduler: 96), the producer warpgroup gives back what the math warpgroups take.
#define CPS_IDX_WS_LAUNCH_REGS 96
#define CPS_IDX_WS_PRODUCER_REGS CPS_IDX_WS_PREGS
#define CPS_IDX_WS_MATH_REGS CPS_IDX_WS_MREGS
static_assert(128 * CPS_IDX_WS_PRODUCER_REGS + CPS_IDX_WS_MATH_THREADS * CPS_IDX_WS_MATH_REGS
                  <= CPS_IDX_WS_THREADS * CPS_IDX_WS_LAUNCH_REGS,
              "setmaxnreg split exceeds the CTA's register pool");
#define CPS_IDX_WS_ROWS 16                 // tokens a block: 128 // hp with hp >= 8

struct CpsIdxWsMeta {
    int lo[CPS_IDX_WS_ROWS], hi[CPS_IDX_WS_ROWS];   // row windows (empty past nrows)
    int t_lo, t_hi, nst, nrows;                     // visited keys, their stages, rows
};

// Shared memory, from a 1024-aligned base: Q slots [2][128 rows][128 B] (swizzled), key
// ring [S][KEYS][128 B] (swizzled), key scales [S][KEYS], weights [2][128], metadata [2],
// mbarriers QFULL[2], QEMPTY[2], KFULL[S], KEMPTY[S]. (indexer.py's ws_smem_bytes.)
#define CPS_IDX_WS_OFF_K (2 * 128 * CPS_IDX_D)
#define CPS_IDX_WS_OFF_KS (CPS_IDX_WS_OFF_K + CPS_IDX_WS_STAGES * CPS_IDX_WS_KEYS * CPS_IDX_D)
#define CPS_IDX_WS_OFF_W (CPS_IDX_WS_OFF_KS + CPS_IDX_WS_STAGES * CPS_IDX_WS_KEYS * 4)
#define CPS_IDX_WS_OFF_META (CPS_IDX_WS_OFF_W + 2 * 128 * 4)
#define CPS_IDX_WS_OFF_BAR (CPS_IDX_WS_OFF_META + 2 * (int)sizeof(CpsIdxWsMeta))
#define CPS_IDX_WS_SMEM (1024 + CPS_IDX_WS_OFF_BAR + (4 + 2 * CPS_IDX_WS_STAGES) * 8)
static_assert(CPS_IDX_WS_SMEM == CPS_IDX_WS_SMEM_LAUNCH,
              "the launcher's ws_smem_bytes() is not the layout the kernel carves");

// The mbarriers of a warp-specialized CTA (thread 0; everyone syncs after): QFULL[2]
// (``qfull_count`` arrivals), QEMPTY[2] and KEMPTY[S] (every math thread), KFULL[S]
// (``kfull_count``).
template <int S = CPS_IDX_WS_STAGES>
__device__ __forceinline__ void cps_idx_ws_init_barriers(u32 bar, int qfull_count,
                                                         int kfull_count) {
    const u32 kfull = bar + 32, kempty = bar + 32 + 8 * S;
    for (int i = 0; i < 2; ++i) {
        cps_mbar_init(bar + 8 * i, qfull_count);
        cps_mbar_init(bar + 16 + 8 * i, CPS_IDX_WS_MATH_THREADS);
    }
    for (int i = 0; i < S; ++i) {
        cps_mbar_init(kfull + 8 * i, kfull_count);
        cps_mbar_init(kempty + 8 * i, CPS_IDX_WS_MATH_THREADS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// A math thread's place in a warp-specialized CTA: its warpgroup and warp (through a shuffle
// from lane 0 the compiler knows them warp-uniform: the wgmma descriptors built from them
// stay in uniform registers), and its keys key0, key0 + 8 of a 64-key tile (g, t: its row
// and column in the MMA's 8 x 4 lane layout).
struct CpsIdxWsLane {
    int wg, warp, g, t, key0;
};
__device__ __forceinline__ CpsIdxWsLane cps_idx_ws_lane(int tid) {
    CpsIdxWsLane me;
    me.wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
    me.warp = __shfl_sync(0xffffffffu, (tid >> 5) & 3, 0);
    me.g = (tid & 31) >> 2;
    me.t = tid & 3;
    me.key0 = 16 * me.warp + me.g;
    return me;
}

// A math warpgroup's products of a stage: its 64 keys (descriptor da) against NCOLS query
// columns (db), waited for. The cp.async bytes -> the async proxy first. (Without this
// fence the prefill kernel measured 2-4% faster, as the attention kernels run, but the
// PTX model asks for it between generic-proxy writes and wgmma reads.) FENCE false: this
// thread fenced since the bytes arrived (a page's second query row: the fence is not tied
// to addresses, it orders every earlier generic-proxy write the thread observed).
template <int NCOLS, bool FENCE = true>
__device__ __forceinline__ void cps_idx_ws_products(float (&acc)[NCOLS / 2], u64 da, u64 db) {
    if constexpr (FENCE) cps_fence_proxy_async();
    cps_wgmma_fence();
#pragma unroll
    for (int k4 = 0; k4 < 4; ++k4) {
        if constexpr (NCOLS == 128) cps_wgmma_m64n128k32(acc, da + 2 * k4, db + 2 * k4, k4);
        else cps_wgmma_m64n64k32(acc, da + 2 * k4, db + 2 * k4, k4);
    }
    cps_wgmma_commit();
    cps_wgmma_wait<0>();
    cps_fence_regs(acc);
}

// ... with the 64 keys' A fragments in registers (MXFP4 keys: cps_fp4_a_fragments).
// B's bytes must be in the async proxy already: the caller fences (cps_paged_ws_body, once
// an item after the query block's QFULL wait).
template <int NCOLS>
__device__ __forceinline__ void cps_idx_ws_products(float (&acc)[NCOLS / 2], u32 (&a)[16],
                                                    u64 db) {
    cps_fence_regs(a);                                  // written before the fence
    cps_wgmma_fence();
#pragma unroll
    for (int k4 = 0; k4 < 4; ++k4) {
        if constexpr (NCOLS == 128) cps_wgmma_m64n128k32_rs(acc, &a[4 * k4], db + 2 * k4, k4);
        else cps_wgmma_m64n64k32_rs(acc, &a[4 * k4], db + 2 * k4, k4);
    }
    cps_wgmma_commit();
    cps_wgmma_wait<0>();
    cps_fence_regs(acc);
    cps_fence_regs(a);                                  // the next page rewrites them
}

// The thread's head-weight pairs of ROWS query rows of HPC columns each, into registers
// for a query block / item (wq: the slot's weights + 2 t): wv[r][gi] holds columns
// r HPC + 8 gi + 2 t and + 1, the pairs cps_idx_ws_row_logits takes. (Read from shared
// memory every page otherwise: the waits' memory clobbers keep the compiler from
// hoisting the loads.)
template <int ROWS, int HPC>
__device__ __forceinline__ void cps_idx_ws_weights(const float* wq, float2 (&wv)[ROWS][HPC / 8]) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
        for (int gi = 0; gi < HPC / 8; ++gi)
            wv[r][gi] = *reinterpret_cast<const float2*>(wq + r * HPC + 8 * gi);
    }
}

// Query row r's logit of key key0 + 8 (t & 1) from the products: the ReLU-weighted sum over
// this thread's GPR column groups (in DeepGEMM's order, cps_groups_in_dg_order), their
// weight pairs in registers (wv[gi]: the pair of columns 8 (r GPR + gi) + 2 t and + 1 of
// the slot's weights), times the key scales, summed across the 4 lanes of the keys
// (cps_head_sum_finish_lane).
template <int GPR, int N>
__device__ __forceinline__ float cps_idx_ws_row_logits(const float (&acc)[N], int r,
                                                       const float2 (&wv)[GPR], float sk0,
                                                       float sk1, int t) {
    float hs[4] = {0.f, 0.f, 0.f, 0.f};
    cps_groups_in_dg_order<GPR>(
        GPR >= 2 ? 1u : 0u,
        [&](int gi) {
            const int i2 = r * GPR + gi;
            cps_head_sum_add(hs, wv[gi].x, wv[gi].y, acc[4 * i2], acc[4 * i2 + 1],
                             acc[4 * i2 + 2], acc[4 * i2 + 3]);
        },
        [](int) {});
    return cps_head_sum_finish_lane(hs, sk0, sk1, t);
}

// HPC: the padded head count the kernel is built for (the launcher picks it only for that
// hp), 0 for any (hp from the launch). With it the math warpgroups' rows are compile-time
// constants: a straight-line epilogue, the row windows in registers, and a key quarter
// inside every row's window stored without checks.
template <int HPC>
__device__ __forceinline__ void cps_mqa_logits_ws_body(
        const float* __restrict__ w, const int* __restrict__ ks, const int* __restrict__ ke,
        float* __restrict__ out, int M, int N, int H, int hp, int nblocks,
        const CpsTensorMap* qmap, const CpsTensorMap* kmap, const CpsTensorMap* smap) {
    extern __shared__ u8 cps_idx_ws_smem_raw[];
    u8* base = cps_idx_ws_smem_raw + ((1024u - (cps_smem_u32(cps_idx_ws_smem_raw) & 1023u)) & 1023u);
    const u32 sbase = cps_smem_u32(base);
    float* s_ks = reinterpret_cast<float*>(base + CPS_IDX_WS_OFF_KS);
    float* s_w = reinterpret_cast<float*>(base + CPS_IDX_WS_OFF_W);
    CpsIdxWsMeta* meta = reinterpret_cast<CpsIdxWsMeta*>(base + CPS_IDX_WS_OFF_META);
    const u32 bar = sbase + CPS_IDX_WS_OFF_BAR;
    // QFULL[i] = bar + 8 i, QEMPTY[i] = bar + 16 + 8 i, KFULL[i] = bar + 32 + 8 i,
    // KEMPTY[i] = bar + 32 + 8 S + 8 i
    const u32 kfull = bar + 32, kempty = bar + 32 + 8 * CPS_IDX_WS_STAGES;
    const int tid = threadIdx.x, lane = tid & 31;
    const int rpc = 128 / hp;
    // QFULL: 128 cp.async arrivals (the weights), 32 after the metadata stores and the
    // query block's TMA bytes; KFULL: a stage's TMA bytes.
    if (tid == 0) cps_idx_ws_init_barriers(bar, 128 + 32 + 1, 1);
    // Query columns past rpc hp (hp not dividing 128), which no query TMA writes, read as
    // zeros by the wgmma: cleared once, then fenced into the async proxy.
    for (int i = tid; i < 2 * 128 * (CPS_IDX_D / 16); i += CPS_IDX_WS_THREADS) {
        if (i % (128 * (CPS_IDX_D / 16)) >= rpc * hp * (CPS_IDX_D / 16))   // (16-byte chunks)
            *reinterpret_cast<uint4*>(base + 16 * i) = make_uint4(0, 0, 0, 0);
    }
    cps_fence_proxy_async();
    __syncthreads();

    if (tid >= CPS_IDX_WS_MATH_THREADS) {
        // ---- producer warpgroup ----
        // All 4 warps copy a block's column weights (cp.async) and write its -inf; one
        // thread issues its query block and every key stage by TMA.
        cps_setmaxnreg_dec<CPS_IDX_WS_PRODUCER_REGS>();
        const int ptid = tid & 127;                  // (tid - CPS_IDX_WS_MATH_THREADS, known >= 0)
        const int hpc = HPC > 0 ? HPC : hp;           // (a shift where the kernel knows it)
        if (ptid == 0) {
            cps_tma_prefetch(qmap);
            cps_tma_prefetch(kmap);
            cps_tma_prefetch(smap);
        }
        int kv = 0;                                   // stages issued so far (thread 0)
        for (int it = 0;; ++it) {
            // (gridDim.x read anew a block: held across the loop, it spilled _ws's 32)
            int ctas;
            asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(ctas));
            const int i = (int)blockIdx.x + it * ctas;
            if (i >= nblocks) break;
            const long long tok0 = (long long)(nblocks - 1 - i) * rpc;
            const int nrows = (int)min((long long)rpc, (long long)M - tok0);
            const int qs = it & 1;
            cps_mbar_wait(bar + 16 + 8 * qs, ((it >> 1) & 1) ^ 1);
            // Windows clamped to the keys that exist (production mode: no host check);
            // every producer warp works them out, warp 0 writes them.
            int a = 0, b = 0;
            if (lane < nrows) {
                a = max(ks[tok0 + lane], 0);
                b = min(ke[tok0 + lane], N);
            }
            const int lo = __reduce_min_sync(0xffffffffu, b > a ? a : 0x7FFFFFFF);
            const int hi = __reduce_max_sync(0xffffffffu, b > a ? b : -1);
            int t_lo = 0, t_hi = 0, nst = 0;
            if (hi > lo) {
                t_lo = lo & ~(CPS_IDX_TILE - 1);
                t_hi = min(t_lo + (hi - t_lo + CPS_IDX_TILE - 1) / CPS_IDX_TILE * CPS_IDX_TILE, N);
                nst = (t_hi - t_lo + CPS_IDX_WS_KEYS - 1) / CPS_IDX_WS_KEYS;
            }
            if (ptid < 32) {
                CpsIdxWsMeta& m = meta[qs];
                if (lane < CPS_IDX_WS_ROWS) {
                    m.lo[lane] = a;
                    m.hi[lane] = b;
                }
                if (lane == 0) {
                    m.t_lo = t_lo;
                    m.t_hi = t_hi;
                    m.nst = nst;
                    m.nrows = nrows;
                }
            }
            // Query block by TMA (one thread): column n = row * hp + head, the box of
            // qmap at row tok0 (zero past H and past the rows: outside the map).
            if (ptid == 0) {
                cps_mbar_arrive_expect_tx(bar + 8 * qs, 128 * hpc * rpc);
                cps_tma_load_3d(sbase + qs * 128 * CPS_IDX_D, qmap, 0, 0, (int)tok0, bar + 8 * qs);
            }
            // Its column weights by cp.async (a weights map would need H * 4 a multiple of
            // 16 bytes). (The row and head worked out anew a block from an opaque copy of
            // ptid: hoisted out of the block loop, such offsets spilled the producer's 32
            // registers.)
            {
                const int qt = cps_opaque(ptid);
                const int rl = qt / hpc, h = qt - rl * hpc;
                const bool valid = rl < nrows && h < H;
                cps_cp_async4(sbase + CPS_IDX_WS_OFF_W + (qs * 128 + qt) * 4,
                              valid ? w + (tok0 + rl) * H + h : w, valid);
            }
            cps_mbar_arrive_cp_async(bar + 8 * qs);
            if (ptid < 32) cps_mbar_arrive(bar + 8 * qs);   // (after the metadata stores)
            // The key stages: two TMA copies each, one thread (the copies cost the
            // producer a few instructions a stage, where 128 threads' cp.async took 75 in
            // each of its 4 warps; and the math warpgroups need no proxy fence before
            // their wgmma reads the keys).
            if (ptid == 0) {
                for (int j = 0; j < nst; ++j, ++kv) {
                    const int st = kv % CPS_IDX_WS_STAGES;
                    const u32 full = kfull + 8 * st;
                    cps_mbar_wait(kempty + 8 * st, ((kv / CPS_IDX_WS_STAGES) & 1) ^ 1);
                    const int t0 = t_lo + j * CPS_IDX_WS_KEYS;
                    cps_mbar_arrive_expect_tx(full, CPS_IDX_WS_KEYS * (CPS_IDX_D + 4));
                    cps_tma_load_2d(sbase + CPS_IDX_WS_OFF_K + st * (CPS_IDX_WS_KEYS * CPS_IDX_D),
                                    kmap, 0, t0, full);
                    cps_tma_load_1d(sbase + CPS_IDX_WS_OFF_KS + st * (CPS_IDX_WS_KEYS * 4), smap,
                                    t0, full);
                }
            }
            // -inf outside the visited keys (the math warpgroups write [t_lo, t_hi)).
            for (int r = 0; r < nrows; ++r) {
                float* row = out + (tok0 + r) * (long long)N;
                cps_fill_neg_inf<128>(row, 0, t_lo, ptid);
                cps_fill_neg_inf<128>(row, t_hi, N, ptid);
            }
        }
        cps_cp_async_wait_all();
        return;
    }

    // ---- math warpgroups ----
    cps_setmaxnreg_inc<CPS_IDX_WS_MATH_REGS>();
    const CpsIdxWsLane me = cps_idx_ws_lane(tid);
    const int wg = me.wg, t = me.t, key0 = me.key0;
    const CpsRowGroups groups = cps_row_groups(rpc, hp, 16);
    const u32 done_mask = groups.done;
    int kv = 0;
    // HPC 64: both rows' head weights in registers for the block, beside the 64
    // accumulators of the block's 2 rows (WREG; they fit the math warpgroups' 112
    // registers with the row pointers as one uniform base and the key scales read after
    // the products).
    static_assert(HPC == 0 || HPC == 64, "a ws prefill kernel for 64 heads or any");
    constexpr bool WREG = HPC == 64;
    float acc[64];
    const u64 da0 = cps_wgmma_desc(sbase + CPS_IDX_WS_OFF_K + wg * (CPS_IDX_TILE * CPS_IDX_D), 0, 1024);
    const u64 db0 = cps_wgmma_desc(sbase, 0, 1024);
    for (int it = 0;; ++it) {
        const int i = (int)blockIdx.x + it * (int)gridDim.x;
        if (i >= nblocks) break;
        const long long tok0 = (long long)(nblocks - 1 - i) * rpc;
        const int qs = it & 1;
        cps_mbar_wait(bar + 8 * qs, (it >> 1) & 1);
        // (The query block and the keys come by TMA, in the async proxy already: no
        // proxy fence before the wgmma reads them.)
        const CpsIdxWsMeta& m = meta[qs];
        const int t_lo = m.t_lo, t_hi = m.t_hi, nst = m.nst, nrows = m.nrows;
        // Column weights read from smem per column group (HPC 0), in registers for the
        // block (HPC 64: its 2 rows' 16 pairs each); the rows' windows in registers when the
        // row count is known (HPC).
        const float* wq = s_w + qs * 128 + 2 * t;
        float2 wreg[WREG ? 2 : 1][8];
        if constexpr (WREG) cps_idx_ws_weights<2, 64>(wq, wreg);
        int rlo[HPC > 0 ? 128 / HPC : 1], rhi[HPC > 0 ? 128 / HPC : 1];
        int lo_all = -0x7FFFFFFF, hi_all = 0x7FFFFFFF;   // keys inside every row's window
        float* const rows = out + tok0 * (long long)N;   // row r, key c: rows[r N + c]
        if constexpr (HPC > 0) {
#pragma unroll
            for (int r = 0; r < 128 / HPC; ++r) {
                rlo[r] = m.lo[r];
                rhi[r] = m.hi[r];
                if (r < nrows) {
                    lo_all = max(lo_all, rlo[r]);
                    hi_all = min(hi_all, rhi[r]);
                }
            }
            hi_all = min(hi_all, t_hi);
        }
        for (int j = 0; j < nst; ++j, ++kv) {
            const int st = kv % CPS_IDX_WS_STAGES;
            cps_mbar_wait(kfull + 8 * st, (kv / CPS_IDX_WS_STAGES) & 1);
            const int t0 = t_lo + j * CPS_IDX_WS_KEYS + CPS_IDX_TILE * wg;
            const bool live = t0 < t_hi;               // (uniform in the warpgroup)
            if (live) {
                // Descriptors as offsets from the first stage's / slot's (the address
                // field is the low 14 bits of bytes / 16; smem < 256 KB never carries).
                cps_idx_ws_products<128, false>(
                    acc, da0 + (u64)((st * (CPS_IDX_WS_KEYS * CPS_IDX_D)) >> 4),
                    db0 + (u64)((qs * (128 * CPS_IDX_D)) >> 4));
            }
            // The key scales after the products (not live beside the accumulators while
            // the wgmma runs), before the slot is released.
            const float sk0 = 0.5f * s_ks[st * CPS_IDX_WS_KEYS + CPS_IDX_TILE * wg + key0];
            const float sk1 = 0.5f * s_ks[st * CPS_IDX_WS_KEYS + CPS_IDX_TILE * wg + key0 + 8];
            cps_mbar_arrive(kempty + 8 * st);
            if (!live) continue;
            if constexpr (HPC > 0) {
                // A quarter inside every row's window stores without the window checks.
                const bool whole = t0 >= lo_all && t0 + CPS_IDX_TILE <= hi_all;
                // Rows of HPC / 8 column groups, known at compile time: straight-line code.
#pragma unroll
                for (int r = 0; r < 128 / HPC; ++r) {
                    const float v = cps_idx_ws_row_logits(acc, r, wreg[r], sk0, sk1, t);
                    const int col = t0 + key0 + 8 * t;
                    if (whole) {
                        if (r < nrows && t < 2) rows[(long long)r * N + col] = v;
                    } else if (r < nrows && t < 2 && col < t_hi) {
                        const bool in = col >= rlo[r] && col < rhi[r];
                        rows[(long long)r * N + col] = in ? v : CPS_NEG_INF;
                    }
                }
            } else {
                float hs[4] = {0.f, 0.f, 0.f, 0.f};
                int r = 0;
                cps_groups_in_dg_order<16>(
                    groups.hold,
                    [&](int i2) {
                        const float2 wv = *reinterpret_cast<const float2*>(wq + 8 * i2);
                        cps_head_sum_add(hs, wv.x, wv.y, acc[4 * i2], acc[4 * i2 + 1],
                                         acc[4 * i2 + 2], acc[4 * i2 + 3]);
                    },
                    [&](int i2) {
                        if ((done_mask >> i2) & 1u) {
                            const float2 v = cps_head_sum_finish(hs, sk0, sk1);
                            const int col = t0 + key0 + 8 * t;
                            if (r < nrows && t < 2 && col < t_hi) {
                                const bool in = col >= m.lo[r] && col < m.hi[r];
                                out[(tok0 + r) * (long long)N + col] =
                                    in ? (t ? v.y : v.x) : CPS_NEG_INF;
                            }
                            ++r;
                            hs[0] = hs[1] = hs[2] = hs[3] = 0.f;
                        }
                    });
            }
        }
        cps_mbar_arrive(bar + 16 + 8 * qs);
    }
}

// _ws: any padded head count (hp | 128 or not); _ws_h64: hp = 64 (2 query tokens a block).
// Tensor maps (raw_kernels.indexer.prefill_map_encoders), 128-byte swizzle for the codes:
// qmap: the query codes, uint8 [M][H][128] (box 128 x hp x 128 // hp); kmap: the key
// codes, uint8 [N][128] (box 128 x 256 rows); smap: the key scales, float32 [N] (box 256).
#define CPS_MQA_WS_KERNEL(NAME, HPC)                                                          \
    extern "C" __global__ void __launch_bounds__(CPS_IDX_WS_THREADS, 1)                       \
    NAME(const float* __restrict__ w, const int* __restrict__ ks, const int* __restrict__ ke, \
         float* __restrict__ out, int M, int N, int H, int hp, int nblocks,                   \
         const __grid_constant__ CpsTensorMap qmap, const __grid_constant__ CpsTensorMap kmap, \
         const __grid_constant__ CpsTensorMap smap) {                                         \
        CPS_PDL_ENTRY();                                                                      \
        cps_mqa_logits_ws_body<HPC>(w, ks, ke, out, M, N, H, hp, nblocks, &qmap, &kmap, &smap); \
    }
CPS_MQA_WS_KERNEL(cps_mqa_logits_ws, 0)
CPS_MQA_WS_KERNEL(cps_mqa_logits_ws_h64, 64)

// ---- paged decode, warp-specialized (sm_90a): next_n = 1 or 2, 64 padded heads --------
// The prefill kernel's structure (above) over the paged cache: persistent CTAs (grid <=
// SMs) of CPS_IDX_WS_MATH math warpgroups and a producer warpgroup. A stage is 4 pages of
// 64 keys (one a math warpgroup); a request's output row spans U = ceil(width / 256)
// stages. Each CTA takes an equal share of the batch's work (cps_wsd_share, computed by
// every CTA from the context lengths at its start: balanced over mixed lengths, nothing
// to plan on the host, graph-safe), a contiguous run of request-major stage positions
// b U + s, walked in work items = (request b, stages [s0, s1)) of at most piece_stages
// stages, the NN query rows of b (NN * 64 columns; at NN = 2 the query block of a
// prefill block of 2 tokens) against keys [256 s0, 256 s1) of its context.
//   producer: the item's page ids into s_bt (bounded: an id outside [0, num_blocks) or a
//     position past the table row is -1), then the stages: each page's 8 KB of codes
//     (MXFP4: 4 KB) and 256 B of scales by 16- / 4-byte cp.async, and a mask of the
//     stage's missing pages (never read; their keys score -inf), with the rows' windows
//     and the request into the Q slot's metadata and the query block and weights into
//     the slot after the first stage's copies (the guessed first item's first stage and
//     query block go out as soon as the share is known, where the guess hit); then
//     -inf outside the visited keys of the item. An item past every row's context is
//     only that fill (the math warpgroups never see it). clean = 0 (DeepGEMM's
//     clean_logits=False: the caller's top-k reads only the rows' windows): no fill, an
//     item past every row's context is nothing; positions past a row's window end inside
//     the visited keys are still -inf. After the last item a slot
//     whose request is -1 tells the math warpgroups to stop.
//   math warpgroup g: page g of each stage, the products and the _h64 epilogue of the
//     prefill kernel (bit-identical logits to cps_paged_mqa_logits_*); MXFP4 keys: the
//     page's A fragments expanded into registers (cps_fp4_a_fragments; the slot is free
//     before the products), the products one query row at a time; fp8 keys at next_n 2:
//     the products one row at a time too (both rows' weights in registers), the slot
//     released after the second row's.
// mbarriers as the prefill kernel's, but KFULL counting 128 cp.async arrivals and one after the
// missing-page mask is stored.
// A Q slot's work item: its request (-1: no more items), the rows' window ends, the keys
// visited [t_lo, t_hi) and their stages.
struct CpsIdxWsdMeta {
    int req, t_lo, t_hi, nst, hi[2];
};
static_assert(sizeof(CpsIdxWsdMeta) == CPS_IDX_WSD_META_BYTES,
              "the launcher's CPS_IDX_WSD_META_BYTES is not the decode slot record");

// Shared memory, from a 1024-aligned base (indexer.py's ws_decode_smem_bytes): Q slots
// [2][128 rows][128 B] (swizzled), the ring of S stages (KB code bytes a key: fp8 keys
// swizzled, MXFP4 keys packed, key r of a page at 64 r), key scales [S][KEYS], weights
// [2][128], work items [2], mbarriers QFULL[2], QEMPTY[2], KFULL[S], KEMPTY[S], the
// stages' missing-page masks [S], an item's page ids [BT_CAP] (before the first item:
// cps_wsd_share's scratch, 8-byte aligned), the rows' window ends of up to
// CPS_IDX_WSD_ENDS_CAP requests [CAP][2] (cps_wsd_share).
constexpr int CPS_IDX_WSD_ENDS_CAP = CPS_IDX_WS_THREADS;   // (indexer.py: WS_THREADS)
// Threads of the producer warpgroup, which computes the share on named barrier 1.
constexpr int CPS_IDX_WSD_SHARE_THREADS = CPS_IDX_WS_THREADS - CPS_IDX_WS_MATH_THREADS;
// Requests a producer thread loads the lengths of before cps_wsd_share (a batch of up to
// CPS_IDX_WSD_PRE x 128 requests: those loads overlap the guessed first item's page ids).
constexpr int CPS_IDX_WSD_PRE = 2;
static_assert(CPS_IDX_WSD_ENDS_CAP >= CPS_IDX_WSD_PRE * CPS_IDX_WSD_SHARE_THREADS,
              "cps_wsd_share keeps the ends of a batch it preloads (no keep check there)");
static_assert(CPS_IDX_BT_CAP <= 2 * CPS_IDX_WSD_SHARE_THREADS,
              "a guessed item's page ids are two a producer thread (gid0, gid1)");
template <int S, int KB>
struct CpsWsdLayout {
    static constexpr int SLOT = CPS_IDX_WS_KEYS * KB;            // a stage's codes
    static constexpr int OFF_K = 2 * 128 * CPS_IDX_D;
    static constexpr int OFF_KS = OFF_K + S * SLOT;
    static constexpr int OFF_W = OFF_KS + S * CPS_IDX_WS_KEYS * 4;
    static constexpr int OFF_META = OFF_W + 2 * 128 * 4;
    static constexpr int OFF_BAR = OFF_META + 2 * (int)sizeof(CpsIdxWsdMeta);
    static constexpr int OFF_PM = OFF_BAR + (4 + 2 * S) * 8;
    static constexpr int OFF_BT = OFF_PM + S * 4;
    static constexpr int OFF_ENDS = OFF_BT + CPS_IDX_BT_CAP * 4;
    static constexpr int SMEM = 1024 + OFF_ENDS + CPS_IDX_WSD_ENDS_CAP * 2 * 4;
};
static_assert(CpsWsdLayout<CPS_IDX_WS_STAGES, CPS_IDX_D>::SMEM == CPS_IDX_WSD_SMEM_LAUNCH
                  && CpsWsdLayout<CPS_IDX_WSD_FP4_STAGES, CPS_IDX_D / 2>::SMEM
                         == CPS_IDX_WSD_FP4_SMEM_LAUNCH,
              "the launcher's ws_decode_smem_bytes() is not the layout the kernel carves");
static_assert(CPS_IDX_WS_KEYS == 4 * CPS_IDX_TILE && CPS_IDX_TILE == 64,
              "a decode stage is 4 pages of 64 keys");
static_assert(CpsWsdLayout<CPS_IDX_WS_STAGES, CPS_IDX_D>::OFF_BT % 8 == 0
                  && CpsWsdLayout<CPS_IDX_WSD_FP4_STAGES, CPS_IDX_D / 2>::OFF_BT % 8 == 0
                  && 8 * (CPS_IDX_WSD_SHARE_THREADS / 32 + 2) <= 4 * CPS_IDX_BT_CAP,
              "cps_wsd_share's scratch (in the page-id buffer) is 8-byte aligned and fits");
// Its producer keeps a stage's page ids and their addresses: the register split differs
// from the prefill kernel's (CPS_IDX_WSD_PREGS / _MREGS, #defined by the launcher).
static_assert(128 * CPS_IDX_WSD_PREGS + CPS_IDX_WS_MATH_THREADS * CPS_IDX_WSD_MREGS
                  <= CPS_IDX_WS_THREADS * CPS_IDX_WS_LAUNCH_REGS,
              "setmaxnreg split exceeds the CTA's register pool");

// The window end [0, end) of query row r of a request whose length entry for that row is
// len (lens[b NN + r] for 2-D lengths, else lens[b]): its context clamped to the width.
template <int NN>
__device__ __forceinline__ int cps_wsd_end_of(int len, int lens_2d, int r, int width) {
    const int end = lens_2d ? len : max(len - NN + r + 1, 0);
    return min(max(end, 0), width);
}

// The length entry of row r of request b (cps_wsd_end_of).
template <int NN>
__device__ __forceinline__ int cps_wsd_len(const int* __restrict__ lens, int lens_2d, int b, int r) {
    return lens[lens_2d ? b * NN + r : b];
}

// The window end [0, end) of query row r of request b: its context clamped to the width.
template <int NN>
__device__ __forceinline__ int cps_wsd_row_end(const int* __restrict__ lens, int lens_2d, int b,
                                               int r, int width) {
    return cps_wsd_end_of<NN>(cps_wsd_len<NN>(lens, lens_2d, b, r), lens_2d, r, width);
}

// The weight of request b in cps_wsd_share: U stages, those holding keys of any of its
// rows (the first ceil(end / 256), end the longest row's window end) weighing
// CPS_IDX_WSD_KEY_WEIGHT, the rest (only -inf to write) 1. Its key stages: nk.
template <int NN>
__device__ __forceinline__ long long cps_wsd_weight(const int (&ends)[NN], int U, int& nk) {
    int len = 0;
#pragma unroll
    for (int r = 0; r < NN; ++r) len = max(len, ends[r]);
    nk = (len + CPS_IDX_WS_KEYS - 1) / CPS_IDX_WS_KEYS;
    return (long long)U + (long long)(CPS_IDX_WSD_KEY_WEIGHT - 1) * nk;
}

// The window end of row r of request b as cps_wsd_share keeps it: from s_ends when the
// batch fits it, else from the lengths.
template <int NN>
__device__ __forceinline__ int cps_wsd_kept_end(const int* __restrict__ lens, int lens_2d,
                                                const int* s_ends, int batch, int b, int r,
                                                int width) {
    return batch <= CPS_IDX_WSD_ENDS_CAP ? s_ends[b * NN + r]
                                         : cps_wsd_row_end<NN>(lens, lens_2d, b, r, width);
}

// The first stage position of CTA c's share of a full batch, every stage weighing
// CPS_IDX_WSD_KEY_WEIGHT (T = batch U KEY_WEIGHT, with G T inside 32 bits: the caller's
// guess checks it): ceil(floor(c T / G) / KEY_WEIGHT), the cut cps_wsd_share's search would
// find. The page-id guess and a full batch's share both take theirs from here.
__device__ __forceinline__ int cps_wsd_full_cut(unsigned c, unsigned T) {
    return (int)((c * T / gridDim.x + CPS_IDX_WSD_KEY_WEIGHT - 1) / CPS_IDX_WSD_KEY_WEIGHT);
}

// This CTA's share of a decode batch: the stage positions [p_lo, p_hi) (request b's
// stage s at b U + s) whose weights (cps_wsd_weight) start at or after blockIdx.x /
// gridDim.x of the batch's total, up to the next CTA's. The CTAs' shares tile
// [0, batch U) exactly (each the same function of the lengths), a share's weight within
// one stage's of total / gridDim.x. Computed by the producer warpgroup alone (NT = 128
// threads, named barrier 1) while the math warpgroups raise their registers and wait for
// the first slot: producer thread tid sums a contiguous chunk of requests, a scan places the
// chunks, and the thread whose chunk holds a cut finds its position. Up to
// CPS_IDX_WSD_ENDS_CAP requests, their rows' window ends go to s_ends[b NN + r] (the cut
// search and the producer read them there: a second round trip to global memory cost
// ~0.7 us of a B=1 launch's 5). scratch: NT / 32 + 2 u64 of shared memory (free until
// the first item); p_lo / p_hi land in scratch[NT / 32 + 0/1].
// try_full (the same in every thread; the caller's guess, whose 32-bit bounds the cuts of a
// full batch need): first ask, in one barrier, whether every request holds keys in all of
// its U stages (weight KEY_WEIGHT U: a decode step's batch whose contexts end in the last
// stage of the width). Then every stage weighs the same, the cuts are the caller's
// ceil(floor(c T / G) / KEY_WEIGHT) from the launch alone: return true, scratch untouched
// (the scan, its barrier, the cut search and the barrier after it cost a B=1 launch more
// than the rest of its producer's work before its first key copy).
template <int NN, int NT>
__device__ __forceinline__ bool cps_wsd_share(const int* __restrict__ lens, int lens_2d,
                                              int batch, int width, int tid,
                                              unsigned long long* scratch, int* s_ends,
                                              const int (&pre)[CPS_IDX_WSD_PRE][NN],
                                              bool try_full) {
    static_assert(NT == CPS_IDX_WSD_SHARE_THREADS, "named barrier 1 is the producer warpgroup's");
    constexpr int NW = NT / 32;
    const int U = (width + CPS_IDX_WS_KEYS - 1) / CPS_IDX_WS_KEYS;
    const int chunk = (batch + NT - 1) / NT;
    const int b0 = min(tid * chunk, batch), b1 = min(b0 + chunk, batch);
    const int lane = tid & 31, warp = tid >> 5;
    const bool keep = batch <= CPS_IDX_WSD_ENDS_CAP;
    long long sum = 0;
    int nk, ends[NN];
    if (chunk <= CPS_IDX_WSD_PRE) {
        // (batch <= CPS_IDX_WSD_PRE NT: the length entries of requests b0 + k, loaded by
        // the caller before its own work)
#pragma unroll
        for (int k = 0; k < CPS_IDX_WSD_PRE; ++k) {
            if (b0 + k < b1) {
#pragma unroll
                for (int r = 0; r < NN; ++r) {
                    ends[r] = cps_wsd_end_of<NN>(pre[k][r], lens_2d, r, width);
                    s_ends[(b0 + k) * NN + r] = ends[r];
                }
                sum += cps_wsd_weight<NN>(ends, U, nk);
            }
        }
    } else {
#pragma unroll 4
        for (int b = b0; b < b1; ++b) {
#pragma unroll
            for (int r = 0; r < NN; ++r) {
                ends[r] = cps_wsd_row_end<NN>(lens, lens_2d, b, r, width);
                if (keep) s_ends[b * NN + r] = ends[r];
            }
            sum += cps_wsd_weight<NN>(ends, U, nk);
        }
    }
    if (try_full) {
        // (the s_ends stores above are ordered before every thread's later reads by the
        // barrier, as by bar.sync)
        const int full = sum == (long long)(b1 - b0) * CPS_IDX_WSD_KEY_WEIGHT * U;
        int all_full;
        asm volatile("{\n\t.reg .pred p, q;\n\t"
                     "setp.ne.s32 q, %1, 0;\n\t"
                     "bar.red.and.pred p, 1, %2, q;\n\t"
                     "selp.s32 %0, 1, 0, p;\n\t}"
                     : "=r"(all_full) : "r"(full), "n"(NT) : "memory");
        if (all_full) return true;
    }
    // Inclusive scan over the warp; with every request in warp 0 (batch <= 32) only the
    // steps that reach lane batch - 1, which then holds the total (no barrier; the other
    // warps' chunks are empty). (The 64-bit shuffles are on the critical path of every
    // launch: a B = 1 batch takes none.)
    long long incl = sum;
    const int reach = batch <= 32 ? batch : 32;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        if (d >= reach) break;
        const long long v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += v;
    }
    long long before = 0, total;
    if (batch <= 32) {
        total = __shfl_sync(0xffffffffu, incl, batch - 1);
    } else {
        if (lane == 31) scratch[warp] = (unsigned long long)incl;
        asm volatile("bar.sync 1, %0;\n" ::"n"(NT) : "memory");   // (the warps' totals)
        total = 0;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const long long v = (long long)scratch[w];
            before += w < warp ? v : 0;
            total += v;
        }
    }
    const long long start = before + incl - sum;       // the weight before request b0
    const long long c = blockIdx.x, g = gridDim.x;
#pragma unroll
    for (int k = 0; k < 2 && b0 < b1; ++k) {
        // cut k: the first position whose weight before it reaches x (0 -> 0; total ->
        // batch U, found in the last nonempty chunk). (32-bit division where it fits: the
        // 64-bit one is a long subroutine on the critical path of every launch.)
        const long long x = total * g <= 0xffffffffLL
                                ? (long long)((unsigned)((c + k) * total) / (unsigned)g)
                                : (c + k) * total / g;
        if (x == 0) {
            if (tid == 0) scratch[NW + k] = 0;
        } else if (x > start && x <= start + sum) {
            long long before_b = start;
            for (int b = b0; b < b1; ++b) {
                // (one request a thread: its weight and key stages are still in registers)
                long long wb = sum;
                if (chunk > 1) {
#pragma unroll
                    for (int r = 0; r < NN; ++r)
                        ends[r] = cps_wsd_kept_end<NN>(lens, lens_2d, s_ends, batch, b, r, width);
                    wb = cps_wsd_weight<NN>(ends, U, nk);
                }
                if (x <= before_b + wb) {
                    const long long r = x - before_b;            // 1 <= r <= wb
                    const long long kw = (long long)CPS_IDX_WSD_KEY_WEIGHT * nk;
                    const long long s = r <= kw ? (r + CPS_IDX_WSD_KEY_WEIGHT - 1) / CPS_IDX_WSD_KEY_WEIGHT
                                                : nk + (r - kw);
                    scratch[NW + k] = (unsigned long long)((long long)b * U + s);
                    break;
                }
                before_b += wb;
            }
        }
    }
    asm volatile("bar.sync 1, %0;\n" ::"n"(NT) : "memory");
    return false;
}

template <int NN, bool FP4, int S>
__device__ __forceinline__ void cps_paged_ws_body(
        const u8* __restrict__ q, const u8* __restrict__ cache, const float* __restrict__ w,
        const int* __restrict__ lens, int lens_2d, const int* __restrict__ bt, int bt_cols,
        int num_blocks, float* __restrict__ out, int width, int H, int batch,
        int piece_stages, int clean, int l2_stream) {
    constexpr int HPC = 64, NC = NN * HPC;
    // A page: 64 keys' codes (fp8: 128 bytes a key; MXFP4: 64 bytes of packed e2m1), then
    // their 4-byte scales (a float32; MXFP4: 4 ue8m0 bytes, one a group of 32).
    constexpr int KB = FP4 ? CPS_IDX_D / 2 : CPS_IDX_D;
    constexpr long long PAGE_BYTES = (long long)CPS_IDX_TILE * (KB + 4);
    using L = CpsWsdLayout<S, KB>;
    static_assert(NN == 1 || NN == 2, "1 or 2 query rows a request");
    extern __shared__ u8 cps_idx_ws_smem_raw[];
    u8* base = cps_idx_ws_smem_raw + ((1024u - (cps_smem_u32(cps_idx_ws_smem_raw) & 1023u)) & 1023u);
    const u32 sbase = cps_smem_u32(base);
    float* s_ks = reinterpret_cast<float*>(base + L::OFF_KS);
    float* s_w = reinterpret_cast<float*>(base + L::OFF_W);
    CpsIdxWsdMeta* meta = reinterpret_cast<CpsIdxWsdMeta*>(base + L::OFF_META);
    volatile int* s_pm = reinterpret_cast<volatile int*>(base + L::OFF_PM);
    int* s_bt = reinterpret_cast<int*>(base + L::OFF_BT);
    int* s_ends = reinterpret_cast<int*>(base + L::OFF_ENDS);
    const u32 bar = sbase + L::OFF_BAR;
    const u32 kfull = bar + 32, kempty = bar + 32 + 8 * S;
    const int tid = threadIdx.x, lane = tid & 31;
    if (tid == 0) cps_idx_ws_init_barriers<S>(bar, 128 + 32, 128 + 1);   // (+1: the page mask)
    __syncthreads();

    if (tid >= CPS_IDX_WS_MATH_THREADS) {
        // ---- producer warpgroup ----
        cps_setmaxnreg_dec<CPS_IDX_WSD_PREGS>();
        const int ptid = tid - CPS_IDX_WS_MATH_THREADS;
        // The pages' L2 policy (the launcher's l2_stream: the batch's pages exceed half the
        // L2, each read once): evict-first keeps the queries, weights, page table and
        // logits there.
        const u64 page_policy = cps_l2_policy(l2_stream != 0);
        unsigned long long* share = reinterpret_cast<unsigned long long*>(s_bt);
        const int U = (width + CPS_IDX_WS_KEYS - 1) / CPS_IDX_WS_KEYS;
        // A batch of up to 256 requests: thread ptid loads its requests' lengths for
        // cps_wsd_share, and while they travel, the page ids of the first item this CTA
        // would take if every row's window were the whole width (a uniform full batch:
        // share position ceil(floor(c T / G) / 16), T = 16 U batch) are loaded as well. The
        // share then only checks its first item against that guess: the two loads overlap
        // where they were two round trips in a row.
        const bool small = batch <= CPS_IDX_WSD_PRE * CPS_IDX_WSD_SHARE_THREADS;
        const bool guess = small && batch > 0 && U > 0
                           && (unsigned long long)batch * U * CPS_IDX_WSD_KEY_WEIGHT * gridDim.x
                                  <= 0xffffffffull;
        // (cps_wsd_share's chunk of requests a thread)
        const int chunk = (batch + CPS_IDX_WSD_SHARE_THREADS - 1) / CPS_IDX_WSD_SHARE_THREADS;
        const int pb0 = min(ptid * chunk, batch), pb1 = min(pb0 + chunk, batch);
        int pre[CPS_IDX_WSD_PRE][NN];
#pragma unroll
        for (int k = 0; k < CPS_IDX_WSD_PRE; ++k) {
#pragma unroll
            for (int r = 0; r < NN; ++r)
                pre[k][r] = small && pb0 + k < pb1 ? cps_wsd_len<NN>(lens, lens_2d, pb0 + k, r) : 0;
        }
        // (and every thread loads the guessed item's first 4 page ids, its first stage: the
        // same 16 bytes in each thread, one request a warp)
        int gpos = -1, gid0 = -1, gid1 = -1, gb = 0, spg[4] = {-1, -1, -1, -1};
        // A full batch's cuts of this CTA depend on the launch alone: computed here, with
        // the guess, while the lengths travel (after the share they were two dependent
        // divisions, most of the 0.14 us from the share to the early issue at B=1 x 32K).
        int gcut = 0, gend = 0;
        if (guess) {
            const unsigned T = (unsigned)batch * U * CPS_IDX_WSD_KEY_WEIGHT;
            gpos = gcut = cps_wsd_full_cut(blockIdx.x, T);
            gend = cps_wsd_full_cut(blockIdx.x + 1, T);
            gb = (int)((unsigned)gpos / (unsigned)U);
            const int gs0 = gpos - gb * U;
            if (gb < batch) {
                const int* bt_row = bt + (long long)gb * bt_cols;
                const int n4 = 4 * (min(U, gs0 + piece_stages) - gs0), p0 = 4 * gs0;
                if (ptid < n4 && p0 + ptid < bt_cols) gid0 = bt_row[p0 + ptid];
                if (ptid + 128 < n4 && p0 + ptid + 128 < bt_cols) gid1 = bt_row[p0 + ptid + 128];
#pragma unroll
                for (int pq = 0; pq < 4; ++pq)          // (n4 >= 4: gs0 < U)
                    if (p0 + pq < bt_cols) spg[pq] = bt_row[p0 + pq];
            } else {
                gpos = -1;
            }
        }
        // Thread ptid moves bytes [16 ptid, +16) of each 2 KB of a stage's codes (fp8: key
        // row 16 k + rr of a page, chunk ptid % 8). Its source offsets inside a page are
        // fixed: a page's copies are one multiply-add off a per-thread base (a missing
        // page's copies carry page 0's address and size 0: no bytes are read).
        const int rr = ptid >> 3;
        const u32 dst_off = FP4 ? ptid * 16 : rr * CPS_IDX_D + (((ptid & 7) ^ (rr & 7)) << 4);
        const u8* const code_src = cache + (FP4 ? ptid * 16 : rr * CPS_IDX_D + (ptid & 7) * 16);
        const u8* const scale_src = cache + CPS_IDX_TILE * KB + (ptid & 63) * 4;
        // A stage's copies into ring slot st: its pages pg (-1: missing, nothing read).
        auto issue_stage = [&](int st, const int (&pg)[4]) {
            const u32 kdst = sbase + L::OFF_K + st * L::SLOT + dst_off;
            // fp8: 4 copies a page (its key rows 16 k + rr); MXFP4: a page's 4 KB of
            // packed codes, unswizzled (key r at 64 r), page pq at 4 KB pq of the slot.
            constexpr int PER_PAGE = CPS_IDX_TILE * KB / 2048;
#pragma unroll
            for (int pq = 0; pq < 4; ++pq) {
                const bool valid = pg[pq] >= 0;
                const u8* src = code_src + (size_t)(u32)(valid ? pg[pq] : 0) * PAGE_BYTES;
#pragma unroll
                for (int k = 0; k < PER_PAGE; ++k)
                    cps_cp_async16_l2(kdst + (PER_PAGE * pq + k) * 2048, src + k * 2048,
                                      valid, page_policy);
            }
            const u32 sdst = sbase + L::OFF_KS + st * (CPS_IDX_WS_KEYS * 4) + ptid * 4;
#pragma unroll
            for (int r = 0; r < CPS_IDX_WS_KEYS / 128; ++r) {
                const int page = ptid < 64 ? pg[2 * r] : pg[2 * r + 1];  // (not pg[key >> 6]:
                const bool valid = page >= 0;                          // a local-memory array)
                cps_cp_async4(sdst + 512 * r,
                              scale_src + (size_t)(u32)(valid ? page : 0) * PAGE_BYTES, valid);
            }
        };
        // A request's query block (rows row0 .. + NN) and weights into query slot qs.
        auto issue_query = [&](int qs, long long row0) {
            // Query block: column n = row * 64 + head (zero past H). (Not unrolled:
            // its per-thread offsets, hoisted out of the item loop, spilled the
            // producer.)
            const u32 sq = sbase + qs * 128 * CPS_IDX_D;
            if constexpr (!FP4) {
#pragma unroll 1
                for (int jq = 0; jq < NC / 16; ++jq) {
                    const int n = 16 * jq + (ptid >> 3), c = ptid & 7;
                    const int rl = n / HPC, h = n - rl * HPC;
                    const bool valid = h < H;
                    const u8* src =
                        valid ? q + ((row0 + rl) * H + h) * CPS_IDX_D + c * 16 : q;
                    cps_cp_async16(sq + n * CPS_IDX_D + ((c ^ (n & 7)) << 4), src,
                                   valid);
                }
            } else {
                // MXFP4 keys: the head dimension in the MXFP4 order (cps_fp4_unit),
                // 4-byte copies; lane u moves MMA unit u of a column, query unit
                // cps_fp4_unit(u).
                const int u4 = 4 * cps_fp4_unit(lane);
#pragma unroll 1
                for (int jq = 0; jq < NC / 4; ++jq) {
                    const int n = 4 * jq + (ptid >> 5);
                    const int rl = n / HPC, h = n - rl * HPC;
                    const bool valid = h < H;
                    const u8* src =
                        valid ? q + ((row0 + rl) * H + h) * CPS_IDX_D + u4 : q;
                    cps_cp_async4(sq + n * CPS_IDX_D + (((lane >> 2) ^ (n & 7)) << 4)
                                      + 4 * (lane & 3), src, valid);
                }
            }
            if (ptid < NC) {
                const int rl = ptid / HPC, h = ptid - rl * HPC;
                const bool valid = h < H;
                cps_cp_async4(sbase + L::OFF_W + (qs * 128 + ptid) * 4,
                              valid ? w + (row0 + rl) * H + h : w, valid);
            }
        };
        const bool full = cps_wsd_share<NN, CPS_IDX_WSD_SHARE_THREADS>(
            lens, lens_2d, batch, width, ptid, share, s_ends, pre, guess);
        // This CTA's share: a full batch's from the launch (cps_wsd_share returned true,
        // read nothing of its scratch; the first cut is the guess's own), else the share's.
        int pos, p_end;
        if (full) {
            pos = gcut;                         // (full only where guess asked for it)
            p_end = gend;
        } else {
            pos = (int)share[CPS_IDX_WSD_SHARE_THREADS / 32];
            p_end = (int)share[CPS_IDX_WSD_SHARE_THREADS / 32 + 1];
        }
        // The guess hit (the same first item: its request and stage): its page ids go to
        // s_bt once every producer thread has read its share there (a full batch's share
        // was not read there: no barrier); the first item then skips its page-id loads.
        // (Entries past the item's pages are never read.) (The same in every producer
        // thread: gpos and full are functions of the launch and the lengths alone, pos and
        // p_end read from shared memory after the share's last barrier.)
        bool ids_ready = gpos == pos && pos < p_end;
        // Where the guess hit, the first item's first stage and query block go out now,
        // before its bounds, page ids and barrier: at B=1 x 32K the producer issued that
        // stage 0.7 us after the share (the item's bounds, a barrier, the query slot's
        // wait), and the math waited for it. Ring slot 0 and query slot 0 are free at the
        // start; the first item then skips those copies (spec_hit). The whole stage is
        // copied: its pages past the rows' windows too (the item's missing-page mask, made
        // from its windows, keeps them unread). Where that item holds no key (past every
        // row's window: the loop skips it), the copies land before the slots are written
        // again. (Issued before the share was known, a missed guess's copies cost the
        // mixed-length batches 1-1.5%: they were waited for before the first item's.)
        bool spec = ids_ready;
        if (spec) {
            int pg[4];
#pragma unroll
            for (int pq = 0; pq < 4; ++pq) pg[pq] = (u32)spg[pq] < (u32)num_blocks ? spg[pq] : -1;
            // Slot 0 from a register ptxas cannot fold (cps_opaque_zero): with the literal,
            // NVRTC 13.0 compiled these copies, placed before or right after cps_wsd_share,
            // into LDGSTS reading two uniform registers nothing wrote (the shared base, the
            // L2 policy), and every launch trapped on an H100 (illegal instruction; NVRTC
            // 13.5 compiled them right). test_kernel_compile scans the SASS for such reads
            // where nvdisasm is installed.
            const int zero = (int)cps_opaque_zero();
            issue_stage(zero, pg);
            issue_query(zero, (long long)gb * NN);
        }
        if (ids_ready) {
            if (!full) asm volatile("bar.sync 1, 128;\n" ::: "memory");
            s_bt[ptid] = (u32)gid0 < (u32)num_blocks ? gid0 : -1;
            s_bt[ptid + 128] = (u32)gid1 < (u32)num_blocks ? gid1 : -1;
        }
        unsigned kv = 0;
        int it = 0;                                     // items handed to the math warpgroups
        while (pos < p_end) {
            const int b = pos / U, s0 = pos - b * U;
            const int s1 = min(min(U, s0 + piece_stages), p_end - b * U);
            pos += s1 - s0;
            const int own_lo = s0 * CPS_IDX_WS_KEYS;
            const int own_hi = min(s1 * CPS_IDX_WS_KEYS, width);
            const long long row0 = (long long)b * NN;
            // Windows [0, end) of the rows, clamped to the width (kept by cps_wsd_share
            // for up to CPS_IDX_WSD_ENDS_CAP requests).
            int end = 0;
            if (lane < NN) end = cps_wsd_kept_end<NN>(lens, lens_2d, s_ends, batch, b, lane, width);
            const int hi = min(__reduce_max_sync(0xffffffffu, end), own_hi);
            int t_hi = own_lo, nst = 0;
            if (hi > own_lo) {
                t_hi = min(own_lo + (hi - own_lo + CPS_IDX_TILE - 1) / CPS_IDX_TILE * CPS_IDX_TILE,
                           own_hi);
                nst = (t_hi - own_lo + CPS_IDX_WS_KEYS - 1) / CPS_IDX_WS_KEYS;
            }
            if (nst == 0) {                             // past every row's context: -inf
                ids_ready = false;                      // (the next item is another)
                if (clean) {
                    for (int r = 0; r < NN; ++r)
                        cps_fill_neg_inf<128>(out + (row0 + r) * (long long)width, own_lo,
                                              own_hi, ptid);
                }
                continue;
            }
            const int qs = it & 1;
            // The guess's first stage and query block are this item's (it is the first item
            // and the guessed one: kv = 0, qs = 0), or they must land before the slots are
            // written again.
            const bool spec_hit = spec && ids_ready;
            if (spec && !spec_hit) cps_cp_async_wait_all();
            spec = false;
            // The item's page ids (the previous item's are no longer read), unless the
            // guess stored them already.
            if (!ids_ready) {
                asm volatile("bar.sync 1, 128;\n" ::: "memory");
                const int* bt_row = bt + (long long)b * bt_cols;
                const int p0 = own_lo / CPS_IDX_TILE;
                for (int i = ptid; i < nst * 4; i += 128) {
                    const int p = p0 + i;
                    const int pg = p < bt_cols ? bt_row[p] : -1;
                    s_bt[i] = (u32)pg < (u32)num_blocks ? pg : -1;
                }
            }
            ids_ready = false;
            asm volatile("bar.sync 1, 128;\n" ::: "memory");
            for (int j = 0; j < nst; ++j, ++kv) {
                const int st = (int)(kv % S);
                cps_mbar_wait(kempty + 8 * st, ((kv / S) & 1) ^ 1);
                const int t0 = own_lo + j * CPS_IDX_WS_KEYS;
                int pg[4];
#pragma unroll
                for (int pq = 0; pq < 4; ++pq)
                    pg[pq] = t0 + pq * CPS_IDX_TILE < t_hi ? s_bt[4 * j + pq] : -1;
                if (!spec_hit || j > 0) issue_stage(st, pg);
                cps_mbar_arrive_cp_async(kfull + 8 * st);
                if (ptid == 0) {
                    s_pm[st] = (pg[0] < 0) | ((pg[1] < 0) << 1) | ((pg[2] < 0) << 2)
                               | ((pg[3] < 0) << 3);
                    cps_mbar_arrive(kfull + 8 * st);
                }
                if (j == 0) {
                    // The item's query block after its first stage: the stage's pages come
                    // from HBM, the query block (read again by every item of the request)
                    // mostly from L2, so the stage's round trip starts first (a B=1 x 32K
                    // launch issued it 0.2 us after the query copies, which took 0.3 us
                    // to issue and landed first: the math waited for the stage).
                    cps_mbar_wait(bar + 16 + 8 * qs, ((it >> 1) & 1) ^ 1);
                    if (ptid < 32) {
                        CpsIdxWsdMeta& m = meta[qs];
                        if (lane < NN) m.hi[lane] = end;
                        if (lane == 0) {
                            m.req = b;
                            m.t_lo = own_lo;
                            m.t_hi = t_hi;
                            m.nst = nst;
                        }
                    }
                    if (!spec_hit) issue_query(qs, row0);
                    // (This cp.async arrival waits for the stage's copies too: the math
                    // waits for both anyway.)
                    cps_mbar_arrive_cp_async(bar + 8 * qs);
                    if (ptid < 32) cps_mbar_arrive(bar + 8 * qs);   // (after the metadata)
                }
            }
            // -inf outside the visited keys of the item (the math warpgroups write the rest):
            // past every row's window end (t_hi covers the longest row's).
            if (clean) {
                for (int r = 0; r < NN; ++r) {
                    float* row = out + (row0 + r) * (long long)width;
                    cps_fill_neg_inf<128>(row, t_hi, own_hi, ptid);
                }
            }
            ++it;
        }
        // No more items: a slot whose request is -1 (its QFULL arrivals as an item's).
        const int qs = it & 1;
        cps_mbar_wait(bar + 16 + 8 * qs, ((it >> 1) & 1) ^ 1);
        if (ptid == 0) meta[qs].req = -1;
        cps_mbar_arrive_cp_async(bar + 8 * qs);
        if (ptid < 32) cps_mbar_arrive(bar + 8 * qs);
        cps_cp_async_wait_all();
        return;
    }

    // ---- math warpgroups ----
    cps_setmaxnreg_inc<CPS_IDX_WSD_MREGS>();
    const CpsIdxWsLane me = cps_idx_ws_lane(tid);
    const int wg = me.wg, t = me.t, key0 = me.key0;
    const u32 k40 = cps_k40();
    unsigned kv = 0;        // (unsigned: kv % S is a mask)
    // The products one query row (64 columns) at a time where a request has two (and for
    // every MXFP4 page): 32 accumulators, so both rows' head weights stay in registers for
    // the item. (MXFP4: all 128 columns at once, beside the 16 registers of the page's A
    // fragments at 104 registers, had ptxas serialize the wgmma; fp8 next_n 2: both rows'
    // weights beside 64 accumulators spilled.)
    constexpr bool ROWWISE = FP4 || NN == 2;
    float acc[ROWWISE ? 32 : NC / 2];
    const u64 da0 = cps_wgmma_desc(sbase + L::OFF_K + wg * (CPS_IDX_TILE * CPS_IDX_D), 0, 1024);
    const u64 db0 = cps_wgmma_desc(sbase, 0, 1024);
    for (int it = 0;; ++it) {
        const int qs = it & 1;
        cps_mbar_wait(bar + 8 * qs, (it >> 1) & 1);
        const CpsIdxWsdMeta& m = meta[qs];
        const int b = m.req;
        if (b < 0) break;                               // the producer has no more items
        const long long row0 = (long long)b * NN;
        // MXFP4: the query block is the only operand wgmma reads from shared memory, so
        // one fence an item moves its cp.async bytes to the async proxy (fp8: every page,
        // in cps_idx_ws_products).
        if constexpr (FP4) cps_fence_proxy_async();
        const int t_lo = m.t_lo, t_hi = m.t_hi, nst = m.nst;
        const float* wq = s_w + qs * 128 + 2 * t;
        // The thread's 16 head weights a query row in registers for the whole item.
        float2 wreg[NN][HPC / 8];
        cps_idx_ws_weights<NN, HPC>(wq, wreg);
        int rhi[NN];
        int hi_all = t_hi;                              // keys inside every row's window
        float* rowp[NN];
#pragma unroll
        for (int r = 0; r < NN; ++r) {
            rhi[r] = m.hi[r];
            hi_all = min(hi_all, rhi[r]);
            rowp[r] = out + (row0 + r) * (long long)width + key0 + 8 * t;
        }
        for (int j = 0; j < nst; ++j, ++kv) {
            const int st = (int)(kv % S);
            cps_mbar_wait(kfull + 8 * st, (kv / S) & 1);
            const int t0 = t_lo + j * CPS_IDX_WS_KEYS + CPS_IDX_TILE * wg;
            const bool live = t0 < t_hi;               // (uniform in the warpgroup)
            const bool missing = (s_pm[st] >> wg) & 1;
            const u64 db = db0 + (u64)((qs * (128 * CPS_IDX_D)) >> 4);
            const u64 da = da0 + (u64)((st * L::SLOT) >> 4);
            const bool work = live && !missing;
            // fp8 keys read row by row: the ring slot is the A operand of every row's
            // products, released after the last row's (below).
            constexpr bool HOLD_SLOT = ROWWISE && !FP4;
            float sk0, sk1;
            u32 afp4[FP4 ? 16 : 1];
            if constexpr (FP4) {
                // The page's A fragments and key scales into registers: the ring slot is
                // free before the products.
                sk0 = sk1 = 0.f;
                if (work)
                    cps_fp4_a_fragments(
                        base + L::OFF_K + st * L::SLOT + wg * (CPS_IDX_TILE * KB),
                        reinterpret_cast<const u32*>(s_ks) + st * CPS_IDX_WS_KEYS + CPS_IDX_TILE * wg,
                        key0, t, k40, afp4, sk0, sk1);
            } else {
                sk0 = 0.5f * s_ks[st * CPS_IDX_WS_KEYS + CPS_IDX_TILE * wg + key0];
                sk1 = 0.5f * s_ks[st * CPS_IDX_WS_KEYS + CPS_IDX_TILE * wg + key0 + 8];
                if constexpr (!ROWWISE) {
                    if (work) cps_idx_ws_products<NC>(acc, da, db);
                }
            }
            if (!HOLD_SLOT || !work) cps_mbar_arrive(kempty + 8 * st);
            if (!live) continue;
            const int col = t0 + key0 + 8 * t;
            if (missing) {                              // a page never read: -inf
                if (t < 2 && col < t_hi) {
#pragma unroll
                    for (int r = 0; r < NN; ++r) rowp[r][t0] = CPS_NEG_INF;
                }
                continue;
            }
            const bool whole = t0 + CPS_IDX_TILE <= hi_all;
#pragma unroll
            for (int r = 0; r < NN; ++r) {
                float v;
                const u64 db_row = db + (u64)((r * HPC * CPS_IDX_D) >> 4);
                if constexpr (FP4) {
                    cps_idx_ws_products<64>(acc, afp4, db_row);
                } else if constexpr (ROWWISE) {
                    if (r == 0) cps_idx_ws_products<64>(acc, da, db_row);
                    else cps_idx_ws_products<64, false>(acc, da, db_row);
                    if (r == NN - 1) cps_mbar_arrive(kempty + 8 * st);
                }
                // (ROWWISE: acc holds row r alone)
                v = cps_idx_ws_row_logits(acc, ROWWISE ? 0 : r, wreg[r], sk0, sk1, t);
                if (whole) {
                    if (t < 2) rowp[r][t0] = v;
                } else if (t < 2 && col < t_hi) {
                    out[(row0 + r) * (long long)width + col] = col < rhi[r] ? v : CPS_NEG_INF;
                }
            }
        }
        cps_mbar_arrive(bar + 16 + 8 * qs);
    }
}

// _h64n1 / _h64n2: next_n 1 / 2, 64 padded heads (the launcher's uses_ws_decode); fp4_:
// MXFP4 keys, in a ring of CPS_IDX_WSD_FP4_STAGES stages of half the bytes (at 4 the B=128
// x 32K next_n 2 launch took 262-267 us, at 8 229-248; the other shapes did not move).
#define CPS_PAGED_WS_KERNEL(NAME, NN, FP4, S)                                                 \
    extern "C" __global__ void __launch_bounds__(CPS_IDX_WS_THREADS, 1)                       \
    NAME(const u8* __restrict__ q, const u8* __restrict__ cache, const float* __restrict__ w, \
         const int* __restrict__ lens, int lens_2d, const int* __restrict__ bt, int bt_cols,  \
         int num_blocks, float* __restrict__ out, int width, int H, int batch,                \
         int piece_stages, int clean, int l2_stream) {                                        \
        CPS_PDL_ENTRY();                                                                      \
        cps_paged_ws_body<NN, FP4, S>(q, cache, w, lens, lens_2d, bt, bt_cols, num_blocks,    \
                                      out, width, H, batch, piece_stages, clean, l2_stream);  \
    }
CPS_PAGED_WS_KERNEL(cps_paged_mqa_logits_ws_h64n1, 1, false, CPS_IDX_WS_STAGES)
CPS_PAGED_WS_KERNEL(cps_paged_mqa_logits_ws_h64n2, 2, false, CPS_IDX_WS_STAGES)
CPS_PAGED_WS_KERNEL(cps_paged_mqa_logits_fp4_ws_h64n1, 1, true, CPS_IDX_WSD_FP4_STAGES)
CPS_PAGED_WS_KERNEL(cps_paged_mqa_logits_fp4_ws_h64n2, 2, true, CPS_IDX_WSD_FP4_STAGES)
