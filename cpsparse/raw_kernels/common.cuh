// Shared device helpers of cpsparse kernels. Header-free on purpose: the
// loader concatenates this file in front of each kernel source, so no CUDA
// toolkit header (cuda_fp8.h, cuda_bf16.h) has to match the NVRTC in use.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define CPS_E4M3_MAX 448.0f

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
