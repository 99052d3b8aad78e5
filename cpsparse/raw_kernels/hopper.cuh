// Inline-asm helpers of the Hopper tensor-core modules (indexer, attention): shared
// memory addresses, cp.async, ldmatrix, the async-proxy fence and wgmma. Header-free
// like common.cuh; the loader concatenates it after common.cuh in front of each
// module that lists it.
#pragma once

// ---- shared memory, cp.async, ldmatrix (sm_80+; fence.proxy.async sm_90+) --------

__device__ __forceinline__ u32 cps_smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16-byte global -> shared copy; valid == false zero-fills the 16 bytes and reads nothing.
__device__ __forceinline__ void cps_cp_async16(u32 dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(n) : "memory");
}

// An L2 policy for cp.async: evict-first (bytes read once, streamed past L2: they leave it
// before what is read again) or evict-normal (the default's).
__device__ __forceinline__ u64 cps_l2_policy(bool evict_first) {
    u64 first, normal;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(first));
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(normal));
    return evict_first ? first : normal;
}

// cps_cp_async16 under an L2 policy (cps_l2_policy).
__device__ __forceinline__ void cps_cp_async16_l2(u32 dst, const void* src, bool valid,
                                                  u64 policy) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
                 :: "r"(dst), "l"(src), "r"(n), "l"(policy) : "memory");
}

__device__ __forceinline__ void cps_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cps_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// Wait for every cp.async of this thread, the uncommitted ones included.
__device__ __forceinline__ void cps_cp_async_wait_all() {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Generic-proxy shared-memory writes (st.shared, cp.async) -> visible to wgmma (async proxy).
__device__ __forceinline__ void cps_fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Four 8x8 b16 matrices; lane l gives the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void cps_ldmatrix_x4(u32* r, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Keep the compiler from moving or touching the accumulators across an asynchronous
// wgmma (between issue and wait they belong to the tensor cores).
template <int N>
__device__ __forceinline__ void cps_fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
// ... and the A-operand registers of a wgmma that reads A from registers.
template <int N>
__device__ __forceinline__ void cps_fence_regs(u32 (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i]) :: "memory");
}

// wgmma shared-memory descriptor, 128-byte swizzle (addresses and offsets in bytes).
//   K-major (rows of 128 bytes, 8-row atoms): SBO = bytes between 8-row groups (1024
//   for a dense tile); LBO unused while the instruction's K fits one 128-byte row.
//   MN-major: LBO = bytes between 64-element blocks along MN, SBO = bytes between
//   8-row groups along K.
__device__ __forceinline__ u64 cps_wgmma_desc(u32 saddr, u32 lbo, u32 sbo) {
    u64 d = (u64)((saddr & 0x3FFFFu) >> 4);
    d |= (u64)((lbo >> 4) & 0x3FFFu) << 16;
    d |= (u64)((sbo >> 4) & 0x3FFFu) << 32;
    d |= (u64)1 << 62;
    return d;
}

// ---- wgmma (sm_90a only) -----------------------------------------------------------
// CPS_HAS_WGMMA is the one arch guard of every wgmma instruction: these helpers and
// the mma_async shapes of indexer.cu and attention.cu. Only -arch=sm_90a has wgmma
// (the loader compiles the modules that use it for compute capability 9.0 only).
// Elsewhere each of them compiles to CPS_WGMMA_MISSING(): one wgmma.fence, which ptxas
// rejects naming the instruction and the target ("Instruction 'wgmma.fence' not
// supported on .target 'sm_100'", what tests/test_kernel_compile.py's refusal tests
// read), so such a build fails instead of giving kernels without their matrix products.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CPS_HAS_WGMMA 1
#else
#define CPS_HAS_WGMMA 0
#endif
#define CPS_WGMMA_MISSING() asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory")

__device__ __forceinline__ void cps_wgmma_fence() {
#if CPS_HAS_WGMMA
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
    CPS_WGMMA_MISSING();
#endif
}

__device__ __forceinline__ void cps_wgmma_commit() {
#if CPS_HAS_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
    CPS_WGMMA_MISSING();
#endif
}

// Wait until at most N committed wgmma groups are still in flight.
template <int N>
__device__ __forceinline__ void cps_wgmma_wait() {
#if CPS_HAS_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
#else
    CPS_WGMMA_MISSING();
#endif
}

// The calling warpgroup's registers a thread (setmaxnreg, sm_90a): a producer gives
// registers back to the CTA's pool, math warpgroups take them. The pool is what the CTA
// was launched with (the cap of its __launch_bounds__, which ptxas uses); an increase
// the pool cannot cover blocks forever, so a kernel's split must fit it exactly.
template <int N>
__device__ __forceinline__ void cps_setmaxnreg_dec() {
#if CPS_HAS_WGMMA
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
#endif
}

template <int N>
__device__ __forceinline__ void cps_setmaxnreg_inc() {
#if CPS_HAS_WGMMA
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
#endif
}

// ---- mbarriers (sm_90), CTA scope ----------------------------------------------------
// A phase completes when `count` arrivals came; waiters name the phase by its parity, so
// an arriving side may run at most one phase ahead of the slowest waiter.
__device__ __forceinline__ void cps_mbar_init(u32 addr, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(addr), "r"(count) : "memory");
}

// Arrive (release: this thread's earlier shared-memory writes are visible to the waiters).
__device__ __forceinline__ void cps_mbar_arrive(u32 addr) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(addr) : "memory");
}

// Arrive once this thread's earlier cp.async copies have landed (the arrival is counted
// in the barrier's init count: .noinc); the thread itself goes on at once.
__device__ __forceinline__ void cps_mbar_arrive_cp_async(u32 addr) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(addr) : "memory");
}

// Wait (acquire) until the phase of parity `parity` has completed.
__device__ __forceinline__ void cps_mbar_wait(u32 addr, u32 parity) {
    asm volatile("{\n.reg .pred done;\nCPS_MBAR_WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra CPS_MBAR_WAIT_%=;\n}\n" :: "r"(addr), "r"(parity) : "memory");
}

// ---- TMA (sm_90): tensor copies global -> shared, counted on an mbarrier ---------------
// A CUtensorMap (raw_kernels.tensor_map's 128 bytes). A kernel takes it by value as
// `const __grid_constant__ CpsTensorMap`: it stays in the parameter space (a captured
// graph keeps it with the launch) and the copies name it by its generic address.
struct alignas(64) CpsTensorMap {
    u64 opaque[16];
};

// Fetch the map's descriptor into the TMA unit's cache ahead of the first copy.
__device__ __forceinline__ void cps_tma_prefetch(const CpsTensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" :: "l"(map) : "memory");
}

// One arrival on `bar` that also makes its phase wait for `bytes` more bytes of async copies.
__device__ __forceinline__ void cps_mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 :: "r"(bar), "r"(bytes) : "memory");
}

// The box of `map` at element coordinates (c0) / (c0, c1) / (c0, c1, c2), innermost first,
// into shared memory at `dst` (128-byte aligned; 1024 under a 128-byte swizzle),
// completing `bar`'s transaction bytes. Elements past the map's dimensions land as zeros:
// the copy reads nothing outside the tensor, whatever the coordinates.
__device__ __forceinline__ void cps_tma_load_1d(u32 dst, const CpsTensorMap* map, int c0, u32 bar) {
    asm volatile("cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2}], [%3];\n"
                 :: "r"(dst), "l"(map), "r"(c0), "r"(bar) : "memory");
}
__device__ __forceinline__ void cps_tma_load_2d(u32 dst, const CpsTensorMap* map, int c0, int c1,
                                                u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n"
                 :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ void cps_tma_load_3d(u32 dst, const CpsTensorMap* map, int c0, int c1,
                                                int c2, u32 bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];\n"
                 :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
