"""When each page of a decode scoring stage lands, by how it is copied (a diagnostic, not a
benchmark).

Run on a GPU machine from the repository root::

    PYTHONPATH=$PWD python3 -m benchmarks.probe_page_landing [--check]

A bare kernel does the copying half of the warp-specialized decode scoring kernels' first
stage at B=1 x 32K: 128 CTAs each land 4 random pages of a 512-page fp8 key cache (the
launch's 4.3 MB, the IndexerKCache page layout: 64 keys' 128-byte codes, then their
float32 scales) into a 1024-aligned ring slot, swizzled as the fp8 ring is (16-byte chunk
c of key row r at c ^ (r & 7)). Each page has its own mbarrier, and warp 4 + p of the CTA
waits on page p's and stamps clock64; thread 0 stamps when the copies are issued. Three
ways of copying:

- ``cp.async``: 128 threads, 16 bytes each (the kernels' pattern), each thread's cp.async
  arrival on page p's barrier right after its copies of page p;
- ``cp.async, arrivals after all pages``: the same copies, the four arrivals after the
  last page (a stage barrier's timing, as the kernels have it);
- ``TMA``: thread 0 alone, a page's codes by one tensor copy (a 3-D tensor map over the
  cache, 128-byte swizzle) and its scales by one bulk copy, on the page's barrier with
  ``complete_tx``.

It prints, for each, the medians over the CTAs (of the medians over 10 launches after 10
warm-up ones) of each page's landing and of the issue, in us after the CTA's entry at the
SM clock (``--mhz``, default 1980: an H100's and H200's boost clock), and the median gap
from page 0 to page 3 in a CTA. ``--check`` first compares the TMA stage with the
cp.async one byte for byte (codes swizzled, scales) and one swizzled key row with the
host's bytes. Results: stdout and ``$OUT/probe_page_landing.json`` when set.

The tensor map is encoded on the host by libcuda's ``cuTensorMapEncodeTiled``
(:func:`cpsparse.raw_kernels.tensor_map`) and kept in device memory, whose address the
copies take.
"""

import argparse
import json
import os
import sys

PAGES, CTAS = 512, 128
KEYS, D = 64, 128
PAGE_BYTES = KEYS * D + KEYS * 4          # an fp8 page: codes, then scales
SLOT = 4 * KEYS * D                       # a stage's codes
SMEM = 1024 + SLOT + 4 * KEYS * 4 + 4 * 8 # alignment slack, codes, scales, 4 mbarriers
MODES = ("TMA", "cp.async", "cp.async, arrivals after all pages")

# (the project's common.cuh and hopper.cuh go in front: cps_smem_u32, cps_mbar_*)
KERNEL = r"""
// mode 0: TMA from thread 0; 1: cp.async, a page's arrivals after its copies; 2: cp.async,
// every arrival after the last page. stamps[cta][0..3]: page p full (warp 4 + p);
// [4]: thread 0's copies issued; clock64 after the CTA's entry. keep (0 or 1): whether
// the ring slot's codes and scales go to out[cta] (a --check), else nothing is written.
extern "C" __global__ void __launch_bounds__(256, 1)
cps_probe_land_pages(const u64* __restrict__ tmap, const u8* __restrict__ cache,
                     const int* __restrict__ pages, long long* __restrict__ stamps,
                     u8* __restrict__ out, int mode, int keep) {
    const long long t0 = clock64();
    extern __shared__ u8 cps_probe_raw[];
    u8* base = cps_probe_raw + ((1024u - (cps_smem_u32(cps_probe_raw) & 1023u)) & 1023u);
    const u32 sb = cps_smem_u32(base);
    const u32 scales = sb + PROBE_SLOT, bar = scales + 4 * PROBE_KEYS * 4;
    const int tid = threadIdx.x;
    if (tid < 4) cps_mbar_init(bar + 8 * tid, mode == 0 ? 1 : 128);
    if (tid == 0) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncthreads();
    const int* pg = pages + 4 * blockIdx.x;
    if (mode == 0) {
        if (tid == 0) {
            for (int p = 0; p < 4; ++p) {
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                             :: "r"(bar + 8 * p), "r"(PROBE_PAGE_CODES + PROBE_KEYS * 4) : "memory");
                asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                             " [%0], [%1, {%2, %3, %4}], [%5];\n"
                             :: "r"(sb + p * PROBE_PAGE_CODES), "l"(tmap), "r"(0), "r"(0), "r"(pg[p]),
                                "r"(bar + 8 * p) : "memory");
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                             " [%0], [%1], %2, [%3];\n"
                             :: "r"(scales + p * PROBE_KEYS * 4),
                                "l"(cache + (size_t)pg[p] * PROBE_PAGE_BYTES + PROBE_PAGE_CODES),
                                "r"(PROBE_KEYS * 4), "r"(bar + 8 * p) : "memory");
            }
            stamps[blockIdx.x * 5 + 4] = clock64() - t0;
        }
    } else if (tid < 128) {
        // (as cps_paged_ws_body's producer: key row 16 k + rr of a page, chunk tid % 8)
        const int rr = tid >> 3;
        const u32 dst = rr * PROBE_D + (((tid & 7) ^ (rr & 7)) << 4);
        for (int p = 0; p < 4; ++p) {
            const u8* src = cache + (size_t)pg[p] * PROBE_PAGE_BYTES + rr * PROBE_D + (tid & 7) * 16;
            for (int k = 0; k < 4; ++k)
                cps_cp_async16(sb + p * PROBE_PAGE_CODES + k * 2048 + dst, src + k * 2048, true);
            if ((tid >= 64) == (p & 1)) {
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n"
                             :: "r"(scales + 512 * (p >> 1) + tid * 4),
                                "l"(cache + (size_t)pg[p] * PROBE_PAGE_BYTES + PROBE_PAGE_CODES
                                    + (tid & 63) * 4) : "memory");
            }
            if (mode == 1) cps_mbar_arrive_cp_async(bar + 8 * p);
        }
        if (mode == 2) {
            for (int p = 0; p < 4; ++p) cps_mbar_arrive_cp_async(bar + 8 * p);
        }
        if (tid == 0) stamps[blockIdx.x * 5 + 4] = clock64() - t0;
    }
    if (tid >= 128 && (tid & 31) == 0) {
        const int p = (tid - 128) >> 5;
        cps_mbar_wait(bar + 8 * p, 0);
        stamps[blockIdx.x * 5 + p] = clock64() - t0;
    }
    if (keep) {
        __syncthreads();   // (every page waited for by warps 4-7)
        for (int i = tid; i < PROBE_SLOT + 4 * PROBE_KEYS * 4; i += blockDim.x)
            out[(size_t)blockIdx.x * (PROBE_SLOT + 4 * PROBE_KEYS * 4) + i] = base[i];
    }
}
"""


def source():
    """The probe's CUDA source: its #defines, the project's headers, the kernel."""
    from cpsparse.raw_kernels import SOURCE_DIR
    defines = "".join(f"#define PROBE_{k} {v}\n" for k, v in (
        ("KEYS", KEYS), ("D", D), ("PAGE_BYTES", PAGE_BYTES), ("PAGE_CODES", KEYS * D),
        ("SLOT", SLOT)))
    return (defines + (SOURCE_DIR / "common.cuh").read_text() + "\n"
            + (SOURCE_DIR / "hopper.cuh").read_text() + "\n" + KERNEL)


def tensor_map_args(pages):
    """cuTensorMapEncodeTiled's shape arguments for a cache of ``pages`` fp8 pages, as
    (dims, byte strides of dims 1-2, box, element strides): dim 0 a key's 128 code bytes,
    dim 1 the page's 64 keys, dim 2 the pages (PAGE_BYTES apart); a box is one page's
    codes."""
    return (D, KEYS, pages), (D, PAGE_BYTES), (D, KEYS, 1), (1, 1, 1)


def encode_tensor_map(ptr, pages):
    """The 128-byte CUtensorMap of the codes of a cache at device address ``ptr``: uint8,
    128-byte swizzle (the fp8 ring's layout), by cpsparse's own encoder
    (:func:`cpsparse.raw_kernels.tensor_map`). Raises RuntimeError with the CUresult if
    libcuda refuses it."""
    from cpsparse import raw_kernels
    dims, strides, box, _ = tensor_map_args(pages)
    return raw_kernels.tensor_map(ptr, raw_kernels.TMAP_UINT8, dims, box,
                                  raw_kernels.TMAP_SWIZZLE_128B, strides=strides)


def summarize(stamps, mhz):
    """{page_us: [4 medians], issued_us, page0_to_page3_us} of stamps[launch][cta][5]
    (clock64 counts): per CTA the median over the launches, then the median over the
    CTAs, in us at ``mhz``."""
    import numpy as np
    st = np.median(np.asarray(stamps, dtype=np.float64), axis=0) / mhz
    med = np.median(st, axis=0)
    return {"page_us": [round(float(x), 3) for x in med[:4]],
            "issued_us": round(float(med[4]), 3),
            "page0_to_page3_us": round(float(np.median(st[:, 3] - st[:, 0])), 3)}


def run(check=False, mhz=1980.0, launches=20):
    import cupy as cp
    import numpy as np

    from benchmarks import harness
    mod = cp.RawModule(code=source(), options=("-arch=sm_90a", "-std=c++17"))
    kernel = mod.get_function("cps_probe_land_pages")
    kernel.max_dynamic_shared_size_bytes = SMEM
    cache = cp.random.randint(0, 256, PAGES * PAGE_BYTES, dtype=cp.uint8)
    tmap = cp.asarray(np.frombuffer(encode_tensor_map(cache.data.ptr, PAGES), np.uint8))
    pages = cp.random.permutation(PAGES)[:4 * CTAS].astype(cp.int32)
    stamps = cp.zeros((CTAS, 5), cp.int64)
    per_cta = SLOT + 4 * KEYS * 4
    result = {"device": harness.device_info()["device"], "mhz": mhz}

    def launch(mode, out, keep):
        kernel((CTAS,), (256,), (tmap, cache, pages, stamps, out, np.int32(mode),
                                 np.int32(keep)), shared_mem=SMEM)
    if check:
        outs = [cp.full(CTAS * per_cta, fill, cp.uint8) for fill in (7, 9)]
        launch(0, outs[0], 1)
        launch(1, outs[1], 1)
        same = bool((outs[0] == outs[1]).all())
        host = cache.get().reshape(PAGES, PAGE_BYTES)
        row = outs[0][9 * D:10 * D].get().reshape(8, 16)       # CTA 0, page 0, key row 9
        want = host[int(pages[0].get()), 9 * D:10 * D].reshape(8, 16)
        swizzled = all((row[c ^ (9 & 7)] == want[c]).all() for c in range(8))
        result["check"] = {"tma_equals_cp_async": same, "row_swizzled": swizzled}
        print(f"check: TMA stage == cp.async stage {same}; key row 9 chunk c at c ^ 1 "
              f"{swizzled}", flush=True)
    nothing = cp.zeros(1, cp.uint8)
    for rnd in range(2):
        for mode, name in enumerate(MODES):
            rows = []
            for i in range(launches):
                launch(mode, nothing, 0)
                if i >= launches // 2:
                    rows.append(stamps.get())
            s = summarize(rows, mhz)
            result.setdefault(name, []).append(s)
            print(f"{name}: pages 0-3 full " + " ".join(f"{x:.2f}" for x in s["page_us"])
                  + f" us, issued {s['issued_us']:.2f}, page 0 to page 3 "
                  f"{s['page0_to_page3_us']:.2f} (round {rnd + 1})", flush=True)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="compare the TMA stage with the cp.async one first")
    ap.add_argument("--mhz", type=float, default=1980.0, help="SM clock for the us figures")
    args = ap.parse_args(argv)
    result = run(args.check, args.mhz)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_page_landing.json"), "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
