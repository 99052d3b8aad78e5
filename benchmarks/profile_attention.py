"""Which part of the fp8 sparse decode kernel costs what (a diagnostic, not a benchmark).

Run on a GPU machine from the repository root::

    PYTHONPATH=$PWD python3 -m benchmarks.profile_attention [VARIANT ...]

It compiles ``attention.cu`` with one part switched off at a time (a text
substitution in the module source, never written to disk) and times the
``mla_decode_*`` shapes of DESIGN section 12 as CUDA-graph replays, so the
difference to ``base`` is what that part adds to the critical path:

- ``nommas``: no QK^T and no PV wgmma (the producer and the softmax remain);
- ``noqk`` / ``nopv``: one of the two products removed (QK^T: math warpgroup 0's;
  P V: both warpgroups' halves);
- ``nodeq``: the e4m3 -> bf16 conversion replaced by a copy of the codes;
- ``localslots``: every row reads one of 64 records (L1/L2 hits, no HBM traffic);
- ``noprod``: the producer loads, dequantizes and stores nothing (it keeps the slots,
  the validity flags and the barriers): the math side alone;
- ``prodonly_nodeq`` / ``prodonly_local``: ``nommas`` with ``nodeq`` / ``localslots``
  (the producer alone without its arithmetic / without HBM latency);
- ``halfprod``: only the first producer warpgroup loads, dequantizes and stores its
  rows (0..31 of each tile; what each CTA of a 2-CTA cluster sharing a tile would do);
  ``halfload``: the second one loads nothing but dequantizes and stores what its
  registers hold (the kernel's arithmetic and shared-memory stores with half its loads);
  ``halfload_nommas``: ``halfload`` without the products.

The outputs of the variants are wrong by construction; only the times mean something.
Results: stdout and ``$OUT/profile_attention.json`` when set.

``prefill`` (``python3 -m benchmarks.profile_attention prefill [VARIANT ...]``): the
ping-pong dense-rows kernel on the ``mla_prefill_*`` shapes: ``nocopies`` (the
producer copies nothing), ``nomath`` (no wgmma), ``nomask`` (masks never applied),
``noq`` (no Q load), ``nowrite`` (no epilogue); ``$OUT/profile_attention_prefill.json``.

``model1`` (``python3 -m benchmarks.profile_attention model1 [VARIANT ...]``) does the
same for the MODEL1 kernel on the ``mla_model1_decode_*`` shapes (B 128, 32K contexts,
top-k 512 / 1024 plus a 128-token window, H 64 / 128): ``nomath`` (both products
removed), ``noscale`` (the scale taken as 1, not from the row's scale word),
``nocodes`` (no code loads), ``noloads`` (neither); ``$OUT/profile_attention_model1.json``.

``trace`` (``python3 -m benchmarks.profile_attention trace``) instead records, in the
first CTAs of one B=128 call, the SM clock (``clock64``) at points of every tile: math
warpgroup 0 (the one that waits for FULL) after its FULL wait and after its P V (the
layout has slots for the producer's loop top, EMPTY wait and FULL arrive, which the
80-register producer cannot stamp without spilling: ``TRACE_STAMPED``). It prints the
median cycles a tile of the math side's work and of its wait for data, the numbers the
ablations only infer. The traced kernel is the base kernel plus those stores (a few
cycles a tile); its output is right.

``timeline`` (``python3 -m benchmarks.profile_attention timeline``) records, for every
CTA of one call at B=128 (s_q 1 and 2), the global timer (ns) when it starts, when its Q
is in shared memory, when its first tile is ready (FULL), when its last P V ends and when
its rows are written, and its SM: a CTA's fixed costs (Q load, epilogue) beside its tiles,
and the gap between one CTA and the next on an SM (:func:`timeline_summary`;
``$OUT/profile_attention_timeline.json``). ``timeline bfloat16`` (or ``float16``) records
the same for a 16-bit ``out`` (the ``_out_bf16`` / ``_out_f16`` kernel; file
``profile_attention_timeline_bfloat16.json``).

A variant must not remove more than it says: a write of the rows under a runtime guard
(``if (d_v == -1)``) let ptxas drop 21 of the fp8 kernel's 60 wgmma (O of one warpgroup
never read), which read as 20% of the kernel; ``halfwrite`` halves the bytes instead
(tests/test_kernel_compile.py compares each variant's wgmma count with the base's).
"""

import json
import os
import sys

from benchmarks import harness

# (variant, [(text in attention.cu, replacement)]); tests/test_profile_attention.py checks
# every text still occurs exactly once, so the tool cannot silently time the base kernel.
# The fp8 decode kernel's products (att_dec_math: warpgroup 0's QK^T, each warpgroup's half
# of P V). Removed outright, not put under a runtime guard: a guarded wgmma makes ptxas
# serialize the others (C7515) and spill in warpgroup 0's loop, which times something
# else. Without QK^T, S is zeros (a defined softmax); without P V, O is left as it was.
_DEC_QK = ("            att_pp_qk<0, D / 64, true>(s, sq, sk);\n",
           "#pragma unroll\n            for (int i = 0; i < 32; ++i) s[i] = 0.f;\n")
_DEC_PV0 = ("            att_pp_pv_regs<128>(st.o, pk, sk, 0);\n",
            "            cps_fence_regs(pk);\n")
_DEC_PV1 = ("            att_pp_pv_smem<128>(st.o, sp, sk, 1);\n", "")
_QK = ("    for (int ks = 0; ks < KSTEPS; ++ks) {", "    for (int ks = 0; ks < 0; ++ks) {")
_PV = ("        att_wgmma_m64n256_kmn(st.o, cps_wgmma_desc(sp + ks * 32, 16, 1024),",
       "        if (0) att_wgmma_m64n256_kmn(st.o, cps_wgmma_desc(sp + ks * 32, 16, 1024),")
_DQ = "__device__ __forceinline__ void att_dequant4(u32 w, float scale, u32& out01, u32& out23) {"
_NODEQ = (_DQ, _DQ + " out01 = w; out23 = w ^ __float_as_uint(scale); return;")
_LOCAL = ("    return j < nk ? __ldg(irow + j) : -1;", "    return j < nk ? (j & 63) : -1;")
# Half the producer's rows (what the two CTAs of a cluster would each load if they shared
# one tile's dequantized keys): the second producer warpgroup (warps 4..7) loads nothing;
# halfload still dequantizes and stores its registers (zeros: the arithmetic and the
# shared-memory traffic stay), halfprod does not.
_HALF_LOAD = ("        att_load_pass(a, kv, next, lane);\n",
              "        if (pw < 4) att_load_pass(a, kv, next, lane);\n")
_HALF_LOAD0 = ("    att_load_pass(a, kv, slot, lane);\n    // The loop pulls tile t + 2",
               "    a = AttPass{};\n    if (pw < 4) att_load_pass(a, kv, slot, lane);\n"
               "    // The loop pulls tile t + 2")
# The epilogue's bytes halved: the rows written as d_v / 2 wide (warpgroup 0's columns,
# rows packed at half the stride): what a 16-bit output would write. Every product stays.
_WRITE = ("    att_write_rows<OUT>(st, w, base + ATT_OFF_L, out, lse, part_out, H, d_v, splits, WG, "
          "r0,\n                        r1, t4, sink);\n}\n\n// The kernels' bodies")
_HALF_STORE = ("        att_store_pass<32, true>(a, sk, row0, lane);\n",
               "        if (pw < 4) att_store_pass<32, true>(a, sk, row0, lane);\n")
VARIANTS = {
    "base": [],
    "nommas": [_DEC_QK, _DEC_PV0, _DEC_PV1],
    "noqk": [_DEC_QK],
    "nopv": [_DEC_PV0, _DEC_PV1],
    "nodeq": [_NODEQ],
    "localslots": [_LOCAL],
    "noprod": [(_HALF_LOAD0[0], "    // The loop pulls tile t + 2"),
               ("    att_prefetch_record(kv, att_slot_checked(raw1, num_slots), lane >> 3);\n", ""),
               ("        att_copy_rope(kv, slot, sk, row0, lane);\n", ""),
               ("        att_store_pass<32, true>(a, sk, row0, lane);\n", ""),
               ("        att_prefetch_record(kv, att_slot_checked(raw2, num_slots), lane >> 3);\n",
                ""),
               ("        att_load_pass(a, kv, next, lane);\n", "")],
    "halfprod": [_HALF_LOAD0, _HALF_LOAD, _HALF_STORE],
    "halfload": [_HALF_LOAD0, _HALF_LOAD],
    "halfload_nommas": [_DEC_QK, _DEC_PV0, _DEC_PV1, _HALF_LOAD0, _HALF_LOAD],
    "prodonly_nodeq": [_DEC_QK, _DEC_PV0, _DEC_PV1, _NODEQ],
    "prodonly_local": [_DEC_QK, _DEC_PV0, _DEC_PV1, _LOCAL],
    "halfwrite": [(_WRITE, _WRITE.replace("H, d_v, splits", "H, d_v / 2, splits"))],
}
# The variants that remove wgmma products on purpose (the others keep the base's count).
VARIANTS_WITHOUT_PRODUCTS = ("nommas", "noqk", "nopv", "halfload_nommas", "prodonly_nodeq",
                             "prodonly_local")
SHAPES = [(128, 1, 128), (64, 2, 64), (8, 1, 128), (1, 1, 128)]   # (B, s_q, H)
CTX, TOPK = 32768, 2048

# ``model1`` (``python3 -m benchmarks.profile_attention model1``): the same kind of
# ablations of the MODEL1 kernel (cps_sparse_mla_model1) on the mla_model1_decode
# workloads (B 128, 32K contexts, top-k slots plus a 128-token window). The scale and
# code substitutions hit its producer only; nomath removes both products of every
# kernel of the module (only the MODEL1 kernel runs here).
_M1_CODES = ("            r.codes[k] = __ldg(reinterpret_cast<const uint4*>(\n"
             "                c.kv + (size_t)pg * (size_t)c.page_stride"
             " + (size_t)of * ATT_M1_ROW) + lane);")
_M1_SCALE = "            r.scales[k] = att_ue8m0(((group < 4 ? lo : hi) >> (8 * (group & 3))) & 0xFFu);"
MODEL1_VARIANTS = {
    "base": [],
    "nomath": [_QK, _PV],
    "noscale": [(_M1_SCALE, "            r.scales[k] = 1.f;")],
    "nocodes": [(_M1_CODES, "            r.codes[k] = make_uint4(of, pg, lane, 0);")],
    "noloads": [(_M1_SCALE, "            r.scales[k] = 1.f;"),
                (_M1_CODES, "            r.codes[k] = make_uint4(of, pg, lane, 0);")],
}
MODEL1_SHAPES = [(64, 512), (64, 1024), (128, 512), (128, 1024)]    # (H, topk), B 128
MODEL1_WINDOW = 128

# ``prefill`` (``python3 -m benchmarks.profile_attention prefill``): the ping-pong
# dense-rows kernel (cps_sparse_mla_bf16) on the mla_prefill workloads (T 4096, top-k
# 2048 of 8192 rows, H 128 / 64): ``nocopies`` (the producer copies nothing: the math
# side alone), ``nomath`` (no wgmma: the producer, the softmax chain and the barriers),
# ``nomask`` (masks never applied: the cost of a tile with masked keys), ``noq`` (no Q
# load) and ``nowrite`` (no epilogue): a CTA's fixed costs; ``qk_blocks``: QK^T in
# FlashMLA's batches (below).
_PP_QK = ("            att_wgmma_m64n64_kk(s, cps_wgmma_desc(sq + off, 16, 1024),",
          "            if (0) att_wgmma_m64n64_kk(s, cps_wgmma_desc(sq + off, 16, 1024),")
_PP_PV_REGS = ("            att_wgmma_m64n256_rmn(o, a,", "            if (0) att_wgmma_m64n256_rmn(o, a,")
_PP_PV_SMEM = ("            att_wgmma_m64n256_kmn(o, pa,", "            if (0) att_wgmma_m64n256_kmn(o, pa,")
PREFILL_VARIANTS = {
    "base": [],
    "nocopies": [("        for (int b = B0; b < B1; ++b) cps_cp_async16(dst + b * ATT_BLK, "
                  "src + b * 128, v);\n", "")],
    "nomath": [_PP_QK, _PP_PV_REGS, _PP_PV_SMEM],
    "nomask": [("    if ((mw.x & mw.y) != 0xffffffffu) {", "    if (false) {")],
    # the fixed costs of a CTA: its Q load (Q left as the smem held it) and its epilogue
    "noq": [("    att_math_start<D>(q, q_fmt, w, H, sq, tid);\n    AttRows st;\n"
             "    att_rows_init(st);\n    st.m0 = ATT_PP_MAX_INIT;",
             "    cps_fence_proxy_async();\n"
             "    att_bar_sync(ATT_BAR_MATH, ATT_MATH_THREADS);\n    AttRows st;\n"
             "    att_rows_init(st);\n    st.m0 = ATT_PP_MAX_INIT;")],
    # (a guard the compiler cannot fold: with O never read, ptxas drops the P V products)
    "nowrite": [("    att_write_rows<OUT>(st, w, base + ATT_OFF_L, out, lse, part_out, H, d_v, splits,"
                 " wg, r0,\n",
                 "    if (d_v == -1) att_write_rows<OUT>(st, w, base + ATT_OFF_L, out, lse,"
                 " part_out, H, d_v, splits, wg, r0,\n")],
}
# FlashMLA's batches: its QK^T opens a new wgmma batch (wgmma.fence, WARPGROUP.ARRIVE in
# the SASS) for each 64-column block, and ptxas closes the one before (gsb0), where
# att_pp_qk issues a half's blocks as one batch (read from both SASS, 2026-12-07).
PREFILL_VARIANTS["qk_blocks"] = [
    ("    cps_wgmma_fence();\n#pragma unroll\n    for (int b = B0; b < B1; ++b) {\n"
     "#pragma unroll\n        for (int kk = 0; kk < 4; ++kk) {\n",
     "#pragma unroll\n    for (int b = B0; b < B1; ++b) {\n        cps_wgmma_fence();\n"
     "#pragma unroll\n        for (int kk = 0; kk < 4; ++kk) {\n"),
    ("                                !(FIRST && b == B0 && kk == 0));\n        }\n    }\n}\n",
     "                                !(FIRST && b == B0 && kk == 0));\n        }\n"
     "        cps_fence_regs(s);\n    }\n}\n"),
]
PREFILL_SHAPES = [(4096, 128), (4096, 64)]          # (T, H); 8192 rows, top-k 2048
PREFILL_ROWS = 8192

# The trace: a buffer of clock64 stamps [cta][event][tile] and the five stores; each
# (anchor, replacement) must hit attention.cu once (tests/test_profile_attention.py).
TRACE_CTAS, TRACE_TILES = 16, 40
TRACE_EVENTS = ("producer_top", "producer_free", "producer_full", "math_full", "math_done")
# The events the traced kernel stamps: math warpgroup 0's. The fp8 producer's warps run at
# 80 registers (two producer warpgroups in the 512 x 128 pool) and any stamp there spilled
# (4-24 bytes), which would time another producer; its events stay 0 (not reached).
TRACE_STAMPED = (3, 4)
_TRACE_DEF = (
    "#define ATT_LN2 0.693147180559945309f\n",
    "#define ATT_LN2 0.693147180559945309f\n"
    f"__device__ long long att_trace[{TRACE_CTAS}][5][{TRACE_TILES}];\n"
    "__device__ __forceinline__ void att_trace_at(int ev, int i) {\n"
    f"    if (blockIdx.x < {TRACE_CTAS} && i < {TRACE_TILES})\n"
    "        att_trace[blockIdx.x][ev][i] = clock64();\n"
    "}\n")
TRACE = [
    _TRACE_DEF,
    # math warpgroup 0 (thread 0): after its FULL wait, after its P V
    ("            att_bar_sync(ATT_BAR_FULL + buf, ATT_DEC_FULL_THREADS);\n",
     "            att_bar_sync(ATT_BAR_FULL + buf, ATT_DEC_FULL_THREADS);\n"
     "            if (tid == 0) att_trace_at(3, it - w.t_first);\n"),
    ("            att_pp_pv_regs<128>(st.o, pk, sk, 0);\n            cps_wgmma_wait<0>();\n",
     "            att_pp_pv_regs<128>(st.o, pk, sk, 0);\n            cps_wgmma_wait<0>();\n"
     "            if (tid == 0) att_trace_at(4, it - w.t_first);\n"),
]


# The timeline: int64 [cta][6] global-timer stamps (ns; 0 = not reached) of thread 0 (math
# warpgroup 0): CTA start, Q stored, first FULL passed, last P V done, rows written; then
# the SM id. Each (anchor, replacement) must hit attention.cu once.
TIMELINE_CTAS = 1024
TIMELINE_EVENTS = ("start", "q_loaded", "first_full", "tiles_done", "rows_written")
_TL_START = ("extern \"C\" __global__ void __launch_bounds__(ATT_DEC_THREADS, 1) "
             "cps_sparse_mla_fp8(ATT_PARAMS) {\n    CPS_PDL_WAIT();\n")
# (the 16-bit-out twins' entries: "\ncps_sparse_mla_fp8_out_bf16(ATT_PARAMS) {...")
_TL_START_16 = ["\ncps_sparse_mla_fp8%s(ATT_PARAMS) {\n    CPS_PDL_WAIT();\n" % suffix
                for suffix in ("_out_bf16", "_out_f16")]
_TL_ENTRY = ("    if (threadIdx.x == 0) {\n        att_timeline_at(0);\n        unsigned sm;\n"
             "        asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(sm));\n"
             f"        if (blockIdx.x < {TIMELINE_CTAS}) att_timeline[blockIdx.x][5] = sm;\n    }}\n")
TIMELINE = [
    ("#define ATT_LN2 0.693147180559945309f\n",
     "#define ATT_LN2 0.693147180559945309f\n"
     f"__device__ long long att_timeline[{TIMELINE_CTAS}][6];\n"
     "__device__ __forceinline__ void att_timeline_at(int ev) {\n"
     "    long long t;\n"
     "    asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t));\n"
     f"    if (blockIdx.x < {TIMELINE_CTAS}) att_timeline[blockIdx.x][ev] = t;\n"
     "}\n"),
    (_TL_START, _TL_START + _TL_ENTRY),
    *[(entry, entry + _TL_ENTRY) for entry in _TL_START_16],
    ("    att_math_start<D>(q, q_fmt, w, H, sq, tid);\n    att_rows_init(st);\n"
     "    st.m0 = st.m1 = ATT_PP_MAX_INIT;\n",
     "    att_math_start<D>(q, q_fmt, w, H, sq, tid);\n    if (tid == 0) att_timeline_at(1);\n"
     "    att_rows_init(st);\n    st.m0 = st.m1 = ATT_PP_MAX_INIT;\n"),
    ("            att_bar_sync(ATT_BAR_FULL + buf, ATT_DEC_FULL_THREADS);\n",
     "            att_bar_sync(ATT_BAR_FULL + buf, ATT_DEC_FULL_THREADS);\n"
     "            if (tid == 0 && it == w.t_first) att_timeline_at(2);\n"),
    (_WRITE, "    if (tid == 0) att_timeline_at(3);\n" + _WRITE.replace(
        "r1, t4, sink);\n}", "r1, t4, sink);\n    if (tid == 0) att_timeline_at(4);\n}")),
]
TIMELINE_SHAPES = [(128, 1, 128), (128, 2, 128)]    # (B, s_q, H): 2 and 4 waves of CTAs


def timeline_summary(stamps):
    """Medians in us of a CTA's phases from stamps int64 [ctas, 6] (events in ns, then
    the SM id; a CTA with an event 0 is left out): Q load, wait for the first tile after
    it, the tiles, the rows' write, the whole CTA; the gap from a CTA's rows written to
    the next CTA's start on the same SM; and the call's span (first start to last write)."""
    import numpy as np
    s = np.asarray(stamps, dtype=np.int64)
    ok = (s[:, :5] > 0).all(axis=1)
    if not ok.any():
        return {"ctas": 0}
    t, sm = s[ok, :5], s[ok, 5]
    us = (t - t[:, :1]) / 1e3

    def med(x):
        return float(np.median(x)) if len(x) else None
    gaps = []
    for unit in np.unique(sm):
        rows = t[sm == unit]
        rows = rows[np.argsort(rows[:, 0])]
        gaps.extend((rows[1:, 0] - rows[:-1, 4]) / 1e3)
    return {"ctas": int(ok.sum()), "q_load_us": med(us[:, 1]),
            "first_tile_wait_us": med(us[:, 2] - us[:, 1]), "tiles_us": med(us[:, 3] - us[:, 2]),
            "rows_write_us": med(us[:, 4] - us[:, 3]), "cta_us": med(us[:, 4]),
            "next_cta_gap_us": med(gaps), "span_us": float((t[:, 4].max() - t[:, 0].min()) / 1e3)}


def timeline(cp, cpsparse, katt, raw_kernels, base, out_dtype="float32"):
    """Record the timeline of one call a TIMELINE_SHAPES shape (``out_dtype``: the out's,
    float32 or a 16-bit one) and summarize it."""
    out = {}
    src = variant_source(base, "timeline")
    for b, sq, h in TIMELINE_SHAPES:
        key = f"B{b}_sq{sq}_H{h}"
        out[key] = timeline_summary(_stamped_call(cp, cpsparse, katt, raw_kernels, src,
                                                  (b, sq, h), "att_timeline",
                                                  (TIMELINE_CTAS, 6), out_dtype))
        print(f"timeline {key}: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in out[key].items()),
            flush=True)
    return out


def variant_source(source, name, variants=None):
    """``source`` with the substitutions of variant ``name`` (or ``"trace"`` /
    ``"timeline"``) applied (``variants``: the table to look ``name`` up in, default
    VARIANTS)."""
    table = VARIANTS if variants is None else variants
    subs = {"trace": TRACE, "timeline": TIMELINE}.get(name) or table[name]
    return harness.substitute(source, subs, f"variant {name} of attention.cu")


def trace_summary(stamps):
    """Median cycles a tile from stamps int64 [ctas, 5, tiles] (0 = not reached):
    each side's work and waits. Tile i's math waits from its previous EMPTY arrive
    (or the first FULL) to FULL i; the producer's free-wait is EMPTY of tile i."""
    import numpy as np
    s = np.asarray(stamps, dtype=np.int64)
    top, free, full, mfull, mdone = (s[:, e] for e in range(5))
    ok = (mfull > 0) & (mdone > 0)                     # the math side's tiles
    prod = ok & (top > 0) & (free > 0) & (full > 0)    # ... with the producer's stamps
    out = {}

    def med(name, x, mask):
        v = x[mask]
        out[name] = float(np.median(v)) if v.size else None

    med("producer_tile", full - top, prod)             # loads, dequant, stores, waits
    med("producer_empty_wait", free - top, prod)
    med("producer_work", full - free, prod)
    med("math_tile", mdone - mfull, ok)                # QK^T, softmax, PV
    prev_done = np.concatenate([mfull[:, :1], mdone[:, :-1]], axis=1)
    nxt = ok & np.concatenate([np.zeros_like(ok[:, :1]), ok[:, :-1]], axis=1)
    med("math_full_wait", mfull - prev_done, nxt)       # math idle, waiting for data
    med("handover", mfull - full, prod)                 # FULL arrive -> math starts
    out["tiles"] = int(ok.sum())
    return out


def attention_source(src):
    """Launches inside compile ``src`` as attention.cu (harness.module_source_override)."""
    from cpsparse.raw_kernels import attention as katt
    return harness.module_source_override("attention", src, katt._PLANS, katt._LAUNCHES)


def _stamped_call(cp, cpsparse, katt, raw_kernels, src, shape, buffer, dims,
                  out_dtype="float32"):
    """The host copy of the stamp buffer ``buffer`` (int64 ``dims``, zeroed first) of
    one sparse decode call of ``shape`` (B, s_q, H) compiled from ``src``, after warm-up
    calls (the compile, then the steady state); ``out_dtype``: the out's dtype name."""
    from benchmarks.bench_peers import mla_decode_inputs
    from cpsparse import _validation
    out_dt = _validation.check_out_dtype(cp, out_dtype)
    b, sq, h = shape
    cache, sets = mla_decode_inputs(cp, cpsparse, b, sq, h, CTX, TOPK)
    with attention_source(src):
        q, slots = sets[0]
        scale = cpsparse.softmax_scale(128, 64)
        for _ in range(3):
            katt.sparse_mla_attention(cp, q, cache.records(), slots, scale, 512, True,
                                      out_dtype=out_dt)
        cp.cuda.Device().synchronize()
        stamps = cp.ndarray(dims, cp.int64,
                            raw_kernels.get_module("attention").get_global(buffer))
        stamps.fill(0)
        katt.sparse_mla_attention(cp, q, cache.records(), slots, scale, 512, True,
                                  out_dtype=out_dt)
        cp.cuda.Device().synchronize()
        got = stamps.get()
    del cache, sets
    cp.get_default_memory_pool().free_all_blocks()
    return got


def trace(cp, cpsparse, katt, raw_kernels, base):
    """Record the stamps of one B=128 call (traced source) and summarize them."""
    b, sq, h = SHAPES[0]
    summary = trace_summary(_stamped_call(cp, cpsparse, katt, raw_kernels,
                                          variant_source(base, "trace"), SHAPES[0],
                                          "att_trace", (TRACE_CTAS, 5, TRACE_TILES)))
    mhz = cp.cuda.Device().attributes["ClockRate"] / 1e3
    print(f"trace B{b}_sq{sq}_H{h} ({summary.pop('tiles')} tiles, SM clock {mhz:.0f} MHz): "
          "median cycles a tile", flush=True)
    for k, v in summary.items():
        print(f"  {k:22s} {v if v is None else round(v)}", flush=True)
    return summary


def model1(cp, cpsparse, katt, timing, base, names):
    """Graph-replay time of each MODEL1 variant on each MODEL1_SHAPES workload."""
    from benchmarks.bench_peers import mla_model1_inputs
    results = {}
    for h, k in MODEL1_SHAPES:
        cache, window, w_slots, sets = mla_model1_inputs(cp, cpsparse, 128, h, k,
                                                         MODEL1_WINDOW, CTX)
        key = f"B128_H{h}_topk{k}_w{MODEL1_WINDOW}"
        for name in names:
            with attention_source(variant_source(base, name, MODEL1_VARIANTS)):
                def call(q, slots):
                    return katt.sparse_mla_attention_model1(
                        cp, q, [(cache.data, cache.block_size, slots, None),
                                (window.data, window.block_size, w_slots, None)],
                        512 ** -0.5, 512)
                g = timing.time_graph(call, sets, reps=4, warmup=2, iters=15)
            results.setdefault(key, {})[name] = g["median_ms"] * 1e3
            print(f"model1 {name:8s} {key:24s} {g['median_ms'] * 1e3:8.1f} us "
                  f"({g['p10_ms'] * 1e3:.1f}-{g['p90_ms'] * 1e3:.1f})", flush=True)
        del cache, window, sets
        cp.get_default_memory_pool().free_all_blocks()
    return results


def prefill(cp, cpsparse, katt, timing, base, names):
    """Graph-replay time of each PREFILL_VARIANTS variant on each PREFILL_SHAPES shape."""
    from benchmarks.bench_peers import mla_prefill_inputs
    results = {}
    scale = cpsparse.softmax_scale(128, 64)
    for t, h in PREFILL_SHAPES:
        kv, sets = mla_prefill_inputs(cp, t, h, PREFILL_ROWS)
        key = f"T{t}_H{h}"
        for name in names:
            with attention_source(variant_source(base, name, PREFILL_VARIANTS)):
                def call(q, idx):
                    return katt.sparse_mla_attention(cp, q, kv, idx, scale, 512, False)
                g = timing.time_graph(call, sets, reps=2, warmup=2, iters=10)
            results.setdefault(key, {})[name] = g["median_ms"]
            print(f"prefill {name:8s} {key:10s} {g['median_ms']:8.3f} ms "
                  f"({g['p10_ms']:.3f}-{g['p90_ms']:.3f})", flush=True)
        del kv, sets
        cp.get_default_memory_pool().free_all_blocks()
    return results


def _save(suffix, unit, results):
    """``results`` to ``$OUT/profile_attention{suffix}.json`` (when OUT is set), with the
    device; returns them."""
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"profile_attention{suffix}.json"), "w") as f:
            json.dump({"device": harness.device_info(), unit: results}, f, indent=2)
    return results


def main(names=None):
    cp = harness.cupy()
    import cpsparse
    from benchmarks.bench_peers import mla_decode_inputs
    from cpsparse import raw_kernels, timing
    from cpsparse.raw_kernels import attention as katt

    names = names or list(VARIANTS)
    base = raw_kernels.module_source("attention")
    if names[0] in ("model1", "prefill"):
        run, variants, unit = ((model1, MODEL1_VARIANTS, "graph_us") if names[0] == "model1"
                               else (prefill, PREFILL_VARIANTS, "graph_ms"))
        return _save(f"_{names[0]}", unit,
                     run(cp, cpsparse, katt, timing, base, names[1:] or list(variants)))
    if names[0] == "timeline" and len(names) <= 2:
        out_dtype = names[1] if len(names) == 2 else "float32"
        return _save("_timeline" + ("" if out_dtype == "float32" else "_" + out_dtype), "us",
                     timeline(cp, cpsparse, katt, raw_kernels, base, out_dtype))
    if names == ["trace"]:
        return _save("_trace", "cycles", trace(cp, cpsparse, katt, raw_kernels, base))
    scale = cpsparse.softmax_scale(128, 64)
    inputs = []
    for b, sq, h in SHAPES:
        cache, sets = mla_decode_inputs(cp, cpsparse, b, sq, h, CTX, TOPK)
        inputs.append((f"B{b}_sq{sq}_H{h}", cache.records(), sets))
    results = {}
    for name in names:
        with attention_source(variant_source(base, name)):
            for key, recs, sets in inputs:
                def call(q, slots, recs=recs):
                    return katt.sparse_mla_attention(cp, q, recs, slots, scale, 512, True)
                g = timing.time_graph(call, sets, reps=4, warmup=2, iters=15)
                results.setdefault(key, {})[name] = g["median_ms"] * 1e3
                print(f"{name:10s} {key:14s} {g['median_ms'] * 1e3:8.1f} us "
                      f"({g['p10_ms'] * 1e3:.1f}-{g['p90_ms'] * 1e3:.1f})", flush=True)
    return _save("", "graph_us", results)


if __name__ == "__main__":
    main(sys.argv[1:])
