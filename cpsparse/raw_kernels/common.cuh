// Shared device helpers of cpsparse kernels. Header-free on purpose: the
// loader concatenates this file in front of each kernel source, so no CUDA
// toolkit header (cuda_fp8.h, cuda_bf16.h) has to match the NVRTC in use.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define CPS_E4M3_MAX 448.0f

// x, which the compiler cannot see through (an empty volatile asm): what it computes from
// the result inside a loop stays in the loop instead of being hoisted into registers held
// across it (where a warpgroup with few registers after setmaxnreg would spill them).
__device__ __forceinline__ int cps_opaque(int x) {
    asm volatile("" : "+r"(x));
    return x;
}

// Programmatic dependent launch (PDL). The launcher starts the kernels of a module
// registered with pdl=True (raw_kernels.register_module) with CUDA's programmatic stream
// serialization: a kernel's CTAs may be scheduled while the kernel before it on the
// stream still runs, which hides the launch and the CTAs' start behind that kernel's
// tail. cps_pdl_wait() blocks the thread until that kernel has completed and its writes
// are visible: every kernel of such a module calls it first, before any global read or
// write (a CPU test checks the order). cps_pdl_launch_dependents() lets the next kernel
// be scheduled as soon as every CTA of this one has issued it; its CTAs then wait in
// their own cps_pdl_wait(). Without the launch attribute, or below sm_90, both are no-ops.
__device__ __forceinline__ void cps_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void cps_pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The first statement of every kernel of a PDL module is one of these two:
//   CPS_PDL_ENTRY(): wait, then let the dependents launch at once. Their CTAs take the
//     SMs this grid leaves free, or the ones its CTAs leave, and wait there;
//   CPS_PDL_WAIT(): wait only; the dependents launch as this grid's CTAs exit. Every
//     attention and top-k kernel: a split-KV attention grid leaves SMs idle, and a
//     combine (or an attention kernel after the top-k) scheduled early on them made the
//     B=8 decode 2-4% slower, launched at the exit 1-3% faster (CUDA-graph replays,
//     H200; docs/performance.md). The indexer's kernels use CPS_PDL_ENTRY.
#define CPS_PDL_ENTRY() do { cps_pdl_wait(); cps_pdl_launch_dependents(); } while (0)
#define CPS_PDL_WAIT() cps_pdl_wait()

// float32 -> e4m3fn code: round to nearest even, saturate to +-448, NaN -> 0x7F.
// Bit for bit the reference's algorithm (cpsparse/reference/fp8.py).
__device__ __forceinline__ u8 cps_e4m3_encode(float x) {
    u32 u = __float_as_uint(x);
    u32 sign = (u >> 24) & 0x80u;
    u32 a = u & 0x7FFFFFFFu;
    u32 code;
    if (a > 0x7F800000u) {
        code = 0x7Fu;                                      // NaN
    } else if (a >= 0x3C800000u) {                         // |x| >= 2^-6: normal
        u32 r = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;   // RNE to 3 mantissa bits
        int c = (int)r - ((127 - 7) << 3);
        code = (u32)min(c, 0x7E);                          // saturate at 448
    } else {                                               // subnormal: k * 2^-9
        code = (u32)__float2int_rn(fabsf(x) * 512.0f);     // exact scaling, RNE
    }
    return (u8)(code | sign);
}

// e4m3fn code -> float32 (NaN codes give NaN).
__device__ __forceinline__ float cps_e4m3_decode(u32 c) {
    u32 sign = (c & 0x80u) << 24;
    u32 e = (c >> 3) & 0xFu, m = c & 7u;
    float mag;
    if (e == 0) {
        mag = (float)m * 0.001953125f;                    // m * 2^-9
    } else if (e == 15 && m == 7) {
        return __uint_as_float(0x7FC00000u | sign);
    } else {
        mag = __uint_as_float(((e + 120u) << 23) | (m << 20));
    }
    return __uint_as_float(__float_as_uint(mag) | sign);
}

// Group scale: fl32(max(amax, eps) / 448), ue8m0 rounds it up to a power of two.
__device__ __forceinline__ float cps_group_scale(float amax, float eps, bool ue8m0) {
    float s = __fdiv_rn(fmaxf(amax, eps), CPS_E4M3_MAX);
    if (ue8m0) {
        u32 b = __float_as_uint(s);
        if (b & 0x7FFFFFu) b = (b & 0x7F800000u) + 0x00800000u;  // next power of two
        s = __uint_as_float(b);
    }
    return s;
}

__device__ __forceinline__ float cps_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
