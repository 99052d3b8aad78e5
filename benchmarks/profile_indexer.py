"""Nsight Compute on the warp-specialized decode scoring kernels (a diagnostic, not a benchmark).

Run on a GPU machine from the repository root (``bash tools/gpu_check.sh ncu`` does both)::

    ncu --clock-control none -k regex:_ws_h64n --section SpeedOfLight \\
        --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 -m benchmarks.profile_indexer > ncu.txt
    python3 -m benchmarks.profile_indexer --parse ncu.txt

and, for where the issue slots and stalls go instruction by instruction (``tools/gpu_check.sh
ncu`` runs this too)::

    ncu --clock-control none -k regex:_ws_h64n --section SourceCounters \\
        --section WarpStateStats -o src python3 -m benchmarks.profile_indexer
    ncu --import src.ncu-rep --page source --csv --print-source sass > src.csv
    python3 -m benchmarks.profile_indexer --source src.csv

The first command launches each of ``cps_paged_mqa_logits_[fp4_]ws_h64n1`` / ``_h64n2`` once
on DESIGN section 12's B=64 x 32K decode shape (the same keys as fp8 and as MXFP4 pages,
random page order), the second reads ncu's text report back into one line a kernel: whether
it is bound by memory (DRAM throughput) or by instruction issue (issued warps a scheduler a
cycle). On the H200 of 2026-12-03 the fp8 next_n 1 kernel read DRAM 77% / issue 0.50, the
MXFP4 one DRAM 39% / issue 0.67 (performance.md, "Warp-specialized MXFP4 decode scoring").
``--clock-control none`` keeps the device's own clocks, as the graph-replay timings run;
without it ncu locks the SMs near 1.3 GHz.

``python3 -m benchmarks.profile_indexer ab VARIANT... [--rounds=N]`` times the ws decode
kernels as they are against source variants of them (VARIANTS) in one process, on
AB_SHAPES, outputs compared bit for bit (``ab``). It prints each round as it completes;
on an H100, one variant for two rounds did not finish in 160 s (each source compiles in
about 20 s there, and the inputs of the B=64 shapes take a while to make): give it at
least 300 s.

``python3 -m benchmarks.profile_indexer fusion [--rounds=N]`` measures what fusing the fp8
decode scoring with the top-k (k = 2048) could gain, on FUSION_SHAPES: the scoring kernel,
the top-k kernel on its logits, the two in one graph, and the scoring as variant
``no_logits_store`` (every logit computed, none written: the most a fused kernel's scoring
could save), CUDA-graph replays (``fusion``).

``python3 -m benchmarks.profile_indexer trace [B CTX NEXT_N] [--variant=NAME]`` (default
1 32768 1, the kernel as it is; ``bash
tools/gpu_check.sh profile`` runs it) instead launches the fp8 ws decode kernel with
clock64 stamps (TRACE) and prints, as medians over the CTAs, when each CTA's producer had
its share, started and finished issuing the guessed first item's first stage and query
block (``guess_start``, ``guess_issued``, where the guess hit), stored the guessed page
ids, arrived on the first stage's and the query slot's barriers (``first_copies``,
``q_issued``: the copies' issue itself where the guess missed), when math warpgroup 0
saw the query slot and the first stage full, finished its first item and left, and when
the producer left, all in us after the CTA's entry; and the spread of the CTAs' entries
(globaltimer): where a B=1 launch (4.2-4.3 us on an H100, DeepGEMM's 3.9-4.1) spends its
time. ``--variant=NAME`` traces source variant NAME of VARIANTS instead (the early
variants skip ``first_copies``, and ``kfull_early`` ``q_issued`` too, for a first item
whose arrivals they made at the early issue; the per-page variants' ``math_k_full`` is
warpgroup 0's page).
"""

import contextlib
import csv
import io
import re
import sys

# (name, unit) of the report lines the summary keeps, and their column titles
METRICS = ((("Duration", "us"), "us"), (("DRAM Throughput", "%"), "dram_%"),
           (("Memory Throughput", "Tbyte/s"), "TB/s"),
           (("Compute (SM) Throughput", "%"), "sm_%"),
           (("Issued Warp Per Scheduler", ""), "issue"),
           (("Eligible Warps Per Scheduler", "warp"), "eligible"),
           (("Active Warps Per Scheduler", "warp"), "active"),
           (("Warp Cycles Per Issued Instruction", "cycle"), "cycles/instr"))

_KERNEL = re.compile(r"^\s*(\w+) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
_METRIC = re.compile(r"^\s+(\S.*?\S)\s{2,}(?:(\S+)\s+)?(-?[\d,]*\.?\d+)\s*$")


def parse(text):
    """{kernel: {(metric, unit): value}} of an ncu text report (``--print-details`` off,
    the default section tables). A kernel profiled twice keeps its last report."""
    out = {}
    cur = None
    for line in text.splitlines():
        m = _KERNEL.match(line)
        if m:
            cur = out.setdefault(m.group(1), {})
            continue
        m = _METRIC.match(line)
        if m and cur is not None:
            cur[(m.group(1), m.group(2) or "")] = float(m.group(3).replace(",", ""))
    return out


def summary(report):
    """One line a kernel: the METRICS columns ('-' where the report lacks one)."""
    cols = [title for _, title in METRICS]
    lines = ["kernel " + " ".join(cols)]
    for kernel, vals in report.items():
        cells = [f"{vals[key]:g}" if key in vals else "-" for key, _ in METRICS]
        lines.append(f"{kernel} " + " ".join(cells))
    return "\n".join(lines)


def read_source(text):
    """{kernel: (header, rows)} of ncu's source page (``--page source --csv --print-source
    sass``): per kernel a "Kernel Name" line, a header line, then one row an instruction.
    The export lists each kernel twice; the last listing is kept."""
    out: dict = {}
    rows = None
    header = None
    for rec in csv.reader(io.StringIO(text)):
        if not rec:
            continue
        if rec[0] == "Kernel Name":
            rows = None
            header = rec[1]
            continue
        if header is not None and rows is None:
            rows = []
            out[header] = (rec, rows)
            continue
        if rows is not None:
            rows.append(rec)
    return out


def _opcode(source):
    """SASS opcode of an instruction without predicate and modifiers: ``@!P0 BRA x`` -> BRA."""
    words = source.split()
    if not words:
        return "?"
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def source_summary(report, top=8):
    """Per kernel: warp instructions executed, the opcodes' shares of them, the stall
    reasons' shares of the warp samples, and the ``top`` instructions by samples (address
    tail, samples, instruction, its three largest stall reasons)."""
    lines = []
    for kernel, (header, rows) in report.items():
        col = {h: i for i, h in enumerate(header)}
        samples_col = col["Warp Stall Sampling (All Samples)"]
        executed_col = col["Instructions Executed"]
        stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]

        def num(row, i):
            try:
                return int(row[i])
            except (IndexError, ValueError):
                return 0

        samples = sum(num(r, samples_col) for r in rows) or 1
        executed = sum(num(r, executed_col) for r in rows) or 1
        by_op: dict = {}
        for r in rows:
            op = _opcode(r[col["Source"]])
            by_op[op] = by_op.get(op, 0) + num(r, executed_col)
        ops = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
        reasons = {h: sum(num(r, col[h]) for r in rows) for h in stalls}
        reasons = sorted(((h[6:], v) for h, v in reasons.items() if v), key=lambda kv: -kv[1])
        lines.append(f"{kernel}: {executed} warp instructions, {samples} samples")
        lines.append("  executed: " + ", ".join(f"{o} {100 * v / executed:.1f}%" for o, v in ops))
        lines.append("  stalls: " + ", ".join(f"{h} {100 * v / samples:.1f}%" for h, v in reasons))
        for r in sorted(rows, key=lambda r: -num(r, samples_col))[:top]:
            why = sorted(((h[6:], num(r, col[h])) for h in stalls), key=lambda kv: -kv[1])[:3]
            lines.append(f"  {r[0][-5:]} {num(r, samples_col):6d}  {r[col['Source']].strip()[:56]:56s}"
                         + "  " + " ".join(f"{h}={v}" for h, v in why if v))
    return "\n".join(lines)


BLOCK, DIM, HEADS = 64, 128, 64


def _decode_case(cp, batch, ctx, mxfp4=False):
    """The keys of ``batch`` full contexts of ``ctx`` as fp8 pages (and the same keys as
    MXFP4 pages, or None) in a random page order, and ``queries(next_n)`` -> (lens, q8,
    w, out): bench_peers' random inputs."""
    import cpsparse as cps
    from benchmarks import bench_peers as bp

    pages = batch * (ctx // BLOCK)
    fp8 = cps.IndexerKCache(pages, BLOCK, DIM, xp=cp)
    fp4 = cps.IndexerKCache(pages, BLOCK, DIM, xp=cp, dtype="mxfp4") if mxfp4 else None
    if mxfp4:
        bp._fill_indexer_mxfp4(cp, fp4.data, fp8.data)
    else:
        bp._fill_indexer(cp, fp8.data)
    table = cp.random.permutation(pages).astype(cp.int32).reshape(batch, -1)

    def queries(next_n):
        return (bp._decode_lens(cp, batch, ctx, next_n),
                bp._codes(cp, (batch, next_n, HEADS, DIM)),
                cp.random.standard_normal((batch * next_n, HEADS), dtype=cp.float32),
                cp.empty((batch * next_n, ctx), cp.float32))
    return fp8, fp4, table, queries


def launch():
    """Each ws decode kernel once on B=64 x 32K (fp8 and MXFP4 pages of the same keys)."""
    import cupy as cp

    from cpsparse.raw_kernels import indexer as ki

    batch, ctx = 64, 32768
    fp8, fp4, table, queries = _decode_case(cp, batch, ctx, mxfp4=True)
    for next_n in (1, 2):
        lens, q8, w, out = queries(next_n)
        for cache in (fp8, fp4):
            plan = ki.paged_plan(batch, next_n, HEADS, DIM, ctx, BLOCK,
                                 fp4=cache.dtype == "mxfp4")
            if plan[2].name != ki.ws_kernel_name(next_n, cache.dtype == "mxfp4"):
                raise RuntimeError(f"the plan picked {plan[2].name}, not a ws kernel")
            ki.paged_mqa_logits(cp, q8, cache, w, lens, table, ctx, out=out, plan=plan)
    cp.cuda.runtime.deviceSynchronize()
    print("launched the ws decode kernels (fp8 and MXFP4, next_n 1 and 2)")


# The ws decode kernel's barrier set-up, where the traces add their own.
_WSD_INIT = ("    if (tid == 0) cps_idx_ws_init_barriers<S>(bar, 128 + 32, 128 + 1);"
             "   // (+1: the page mask)\n")

# ---- trace: clock64 stamps of the ws decode kernel's first item, CTA by CTA --------------
# Each (anchor, replacement) must hit indexer.cu once (harness.substitute; the CPU test
# compiles the traced source without spills). Stamps: thread 0 of the producer warpgroup
# (ptid 0) and of math warpgroup 0 (tid 0); the launch's globaltimer at each CTA's entry.
TRACE_CTAS = 132
TRACE_EVENTS = ("entry", "share_done", "first_copies", "math_q_full", "math_k_full",
                "math_first_item", "math_exit", "producer_exit", "ids_stored", "q_issued",
                "guess_issued", "guess_start")
TRACE = [
    ("constexpr int CPS_IDX_WSD_ENDS_CAP = CPS_IDX_WS_THREADS;",
     f"__device__ long long cps_wsd_trace[{TRACE_CTAS}][{len(TRACE_EVENTS)}];\n"
     f"__device__ unsigned long long cps_wsd_gtimer[{TRACE_CTAS}];\n"
     "__device__ __forceinline__ void cps_wsd_trace_at(int ev) {\n"
     f"    if (blockIdx.x < {TRACE_CTAS}) cps_wsd_trace[blockIdx.x][ev] = clock64();\n"
     "}\n"
     "constexpr int CPS_IDX_WSD_ENDS_CAP = CPS_IDX_WS_THREADS;"),
    (_WSD_INIT,
     "    if (tid == 0) {\n"
     "        cps_wsd_trace_at(0);\n"
     "        unsigned long long g;\n"
     "        asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(g));\n"
     f"        if (blockIdx.x < {TRACE_CTAS}) cps_wsd_gtimer[blockIdx.x] = g;\n"
     "    }\n" +
     _WSD_INIT),
    ("            lens, lens_2d, batch, width, ptid, share, s_ends, pre, guess);\n",
     "            lens, lens_2d, batch, width, ptid, share, s_ends, pre, guess);\n"
     "        if (ptid == 0) cps_wsd_trace_at(1);\n"),
    # (first_copies and math_k_full anchor on lines VARIANTS keep: traces of them too)
    ("                    s_pm[st] = (pg[0] < 0) | ((pg[1] < 0) << 1) | ((pg[2] < 0) << 2)\n",
     "                    if (kv == 0) cps_wsd_trace_at(2);\n"
     "                    s_pm[st] = (pg[0] < 0) | ((pg[1] < 0) << 1) | ((pg[2] < 0) << 2)\n"),
    ("        const CpsIdxWsdMeta& m = meta[qs];\n        const int b = m.req;\n"
     "        if (b < 0) break;",
     "        if (tid == 0 && it == 0) cps_wsd_trace_at(3);\n"
     "        const CpsIdxWsdMeta& m = meta[qs];\n        const int b = m.req;\n"
     "        if (b < 0 && tid == 0) cps_wsd_trace_at(6);\n"
     "        if (b < 0) break;"),
    ("            const int t0 = t_lo + j * CPS_IDX_WS_KEYS + CPS_IDX_TILE * wg;\n"
     "            const bool live = t0 < t_hi;               // (uniform in the warpgroup)\n"
     "            const bool missing = (s_pm[st] >> wg) & 1;\n",
     "            if (tid == 0 && kv == 0) cps_wsd_trace_at(4);\n"
     "            const int t0 = t_lo + j * CPS_IDX_WS_KEYS + CPS_IDX_TILE * wg;\n"
     "            const bool live = t0 < t_hi;               // (uniform in the warpgroup)\n"
     "            const bool missing = (s_pm[st] >> wg) & 1;\n"),
    ("        cps_mbar_arrive(bar + 16 + 8 * qs);\n    }\n}\n\n// _h64n1 / _h64n2",
     "        if (tid == 0 && it == 0) cps_wsd_trace_at(5);\n"
     "        cps_mbar_arrive(bar + 16 + 8 * qs);\n    }\n}\n\n// _h64n1 / _h64n2"),
    ("            s_bt[ptid + 128] = (u32)gid1 < (u32)num_blocks ? gid1 : -1;\n        }\n",
     "            s_bt[ptid + 128] = (u32)gid1 < (u32)num_blocks ? gid1 : -1;\n"
     "            if (ptid == 0) cps_wsd_trace_at(8);\n        }\n"),
    ("                    if (ptid < 32) cps_mbar_arrive(bar + 8 * qs);   // (after the metadata)\n",
     "                    if (ptid == 0 && it == 0) cps_wsd_trace_at(9);\n"
     "                    if (ptid < 32) cps_mbar_arrive(bar + 8 * qs);   // (after the metadata)\n"),
    ("            issue_query(zero, (long long)gb * NN);\n",
     "            issue_query(zero, (long long)gb * NN);\n"
     "            if (ptid == 0) cps_wsd_trace_at(10);\n"),
    ("        bool spec = ids_ready;\n",
     "        bool spec = ids_ready;\n"
     "        if (ptid == 0) cps_wsd_trace_at(11);\n"),
    ("        if (ptid == 0) meta[qs].req = -1;\n",
     "        if (ptid == 0) meta[qs].req = -1;\n"
     "        if (ptid == 0) cps_wsd_trace_at(7);\n"),
]


def trace_source(source):
    """indexer.cu with the trace's stamps (TRACE)."""
    from benchmarks import harness
    return harness.substitute(source, TRACE, "the ws decode trace of indexer.cu")


def trace_summary(stamps, gtimer, mhz):
    """Medians over the CTAs that ran an item (us, SM clock ``mhz``) of each event after
    the CTA's entry, and the spread of the CTAs' entries (globaltimer, us): where a small
    batch's launch spends its time before and after its only key stage."""
    import numpy as np
    s = np.asarray(stamps, dtype=np.int64)
    g = np.asarray(gtimer, dtype=np.int64)
    ran = (s[:, 0] > 0) & (s[:, 5] > 0)
    out = {"ctas": int((s[:, 0] > 0).sum()), "ctas_with_items": int(ran.sum())}
    for e, name in enumerate(TRACE_EVENTS[1:], start=1):
        d = (s[ran, e] - s[ran, 0]) / mhz
        ok = s[ran, e] > 0
        out[name + "_us"] = float(np.median(d[ok])) if ok.any() else None
    started = g[g > 0]
    out["entry_spread_us"] = float((started.max() - started.min()) / 1e3) if started.size else None
    return out


def trace(batch=1, ctx=32768, next_n=1, variant="base"):
    """One traced launch of the fp8 ws decode kernel (after warm-up launches; as source
    variant ``variant`` of VARIANTS, or as it is), printed as trace_summary; returns it."""
    import cupy as cp

    from cpsparse import raw_kernels
    from cpsparse.raw_kernels import indexer as ki

    cache, _, table, queries = _decode_case(cp, batch, ctx)
    lens, q8, w, out = queries(next_n)
    with variant_in_force(variant, trace_source):
        plan = ki.paged_plan(batch, next_n, HEADS, DIM, ctx, BLOCK)
        if plan[2].name != ki.ws_kernel_name(next_n, False):
            raise RuntimeError(f"the plan picked {plan[2].name}, not a ws kernel")
        for _ in range(5):
            ki.paged_mqa_logits(cp, q8, cache, w, lens, table, ctx, out=out, plan=plan)
        cp.cuda.runtime.deviceSynchronize()
        mod = raw_kernels.get_module("indexer")
        stamps = cp.ndarray((TRACE_CTAS, len(TRACE_EVENTS)), cp.int64,
                            mod.get_global("cps_wsd_trace"))
        gtimer = cp.ndarray((TRACE_CTAS,), cp.uint64, mod.get_global("cps_wsd_gtimer"))
        stamps.fill(0)
        gtimer.fill(0)
        ki.paged_mqa_logits(cp, q8, cache, w, lens, table, ctx, out=out, plan=plan)
        cp.cuda.runtime.deviceSynchronize()
        mhz = cp.cuda.Device().attributes["ClockRate"] / 1e3
        summary = trace_summary(stamps.get(), gtimer.get().astype("int64"), mhz)
    print(f"trace {variant} B={batch} ctx={ctx} next_n={next_n} (SM clock {mhz:.0f} MHz): "
          + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                      for k, v in summary.items()), flush=True)
    return summary


# ---- variants of the ws decode kernels, and their in-process A/B ------------------------
# The guessed first item's bounds at the early issue, as the item loop computes them
# (own_lo, own_hi, t_hi, nst from the kept window ends), and its stage's pages past them
# dropped (-1, never read: the loop's pg). A change to the loop's formulas not made here
# would miscount the barriers (a hang, not an error): folded into the kernel, they must be
# one helper with the loop's.
_EARLY_BOUNDS = (
     "            int g_end[NN], g_max = 0;\n"
     "#pragma unroll\n"
     "            for (int r = 0; r < NN; ++r) {\n"
     "                g_end[r] = cps_wsd_kept_end<NN>(lens, lens_2d, s_ends, batch, gb, r, width);\n"
     "                g_max = max(g_max, g_end[r]);\n"
     "            }\n"
     "            const int g_s1 = min(min(U, gs0 + piece_stages), p_end - gb * U);\n"
     "            const int g_lo = gs0 * CPS_IDX_WS_KEYS;\n"
     "            const int g_own_hi = min(g_s1 * CPS_IDX_WS_KEYS, width);\n"
     "            const int g_hi = min(g_max, g_own_hi);\n"
     "            const int g_thi = min(g_lo + (g_hi - g_lo + CPS_IDX_TILE - 1) / CPS_IDX_TILE\n"
     "                                  * CPS_IDX_TILE, g_own_hi);\n"
     "#pragma unroll\n"
     "            for (int pq = 0; pq < 4; ++pq)\n"
     "                if (g_lo + pq * CPS_IDX_TILE >= g_thi) pg[pq] = -1;\n")
# The guessed item's metadata written and the query slot's metadata arrivals (warp 0),
# and its missing-page mask (thread 0), at the early issue; KFULL_ARRIVE: the mask's
# arrival(s) on the stage's KFULL barrier(s).
def _early_meta(kfull_arrive):
    return ("            if (ptid < 32) {\n"
            "                if (lane == 0) {\n"
            "                    CpsIdxWsdMeta& m = meta[zero];\n"
            "#pragma unroll\n"
            "                    for (int r = 0; r < NN; ++r) m.hi[r] = g_end[r];\n"
            "                    m.req = gb;\n"
            "                    m.t_lo = g_lo;\n"
            "                    m.t_hi = g_thi;\n"
            "                    m.nst = (g_thi - g_lo + CPS_IDX_WS_KEYS - 1) / CPS_IDX_WS_KEYS;\n"
            "                }\n"
            "                cps_mbar_arrive(bar + 8 * zero);\n"
            "            }\n"
            "            if (ptid == 0) {\n"
            "                s_pm[zero] = (pg[0] < 0) | ((pg[1] < 0) << 1) | ((pg[2] < 0) << 2)\n"
            "                             | ((pg[3] < 0) << 3);\n"
            + kfull_arrive +
            "            }\n")


# The early stage only for a first item that holds keys (its early arrivals count on it)
_EARLY_ONLY_WITH_KEYS = ("        bool spec = ids_ready;\n        if (spec) {\n",
     "        bool spec = ids_ready;\n"
     "        if (spec && !full) {\n"
     "            int end = 0;\n"
     "#pragma unroll\n"
     "            for (int r = 0; r < NN; ++r)\n"
     "                end = max(end, cps_wsd_kept_end<NN>(lens, lens_2d, s_ends, batch, gb, r, width));\n"
     "            spec = end > gs0 * CPS_IDX_WS_KEYS;\n"
     "        }\n"
     "        if (spec) {\n")
# The first item is the guessed one where the early stage went out (it holds keys)
_SPEC_HIT_IS_SPEC = ("            const bool spec_hit = spec && ids_ready;\n"
     "            if (spec && !spec_hit) cps_cp_async_wait_all();\n",
     "            const bool spec_hit = spec;             // (spec: the first item holds keys)\n")


# Each (anchor, replacement) must hit indexer.cu once, in order (harness.substitute; the
# CPU test compiles each variant without spills). A variant that adds mbarriers a stage
# (its CpsWsdLayout's OFF_PM line: 4 + N S of them, the kernel's N = 2) grows the layout's
# shared memory by 8 bytes each, in the launch and in the #defines its static_assert checks.
_KFULL_PAGE = [
    # three more KFULL barriers a stage, page-major after the stages' own (page 0's):
    # page p >= 1 of stage st at kfull_p + 8 (S (p - 1) + st)
    ("    static constexpr int OFF_PM = OFF_BAR + (4 + 2 * S) * 8;",
     "    static constexpr int OFF_PM = OFF_BAR + (4 + 5 * S) * 8;"),
    (_WSD_INIT,
     _WSD_INIT +
     "    const u32 kfull_p = bar + 32 + 16 * S;\n"
     "    if (tid == 0) {\n"
     "        for (int i = 0; i < 3 * S; ++i) cps_mbar_init(kfull_p + 8 * i, 128 + 1);\n"
     "        asm volatile(\"fence.mbarrier_init.release.cluster;\\n\" ::: \"memory\");\n"
     "    }\n"
     "    auto kfull_page = [&](int st, int pq) -> u32 {\n"
     "        return pq == 0 ? kfull + 8 * st : kfull_p + 8 * (S * (pq - 1) + st);\n"
     "    };\n"),
    ("            const int gs0 = gpos - gb * U;\n", "            gs0 = gpos - gb * U;\n"),
    ("        int gpos = -1, gid0 = -1, gid1 = -1, gb = 0, spg[4] = {-1, -1, -1, -1};\n",
     "        int gpos = -1, gid0 = -1, gid1 = -1, gb = 0, gs0 = 0, spg[4] = {-1, -1, -1, -1};\n"),
    # a page's codes, its scales (threads 0-63: pages 0 and 2, 64-127: 1 and 3), then the
    # thread's cp.async arrival on the page's barrier
    ("        auto issue_stage = [&](int st, const int (&pg)[4]) {\n"
     "            const u32 kdst = sbase + L::OFF_K + st * L::SLOT + dst_off;\n"
     "            // fp8: 4 copies a page (its key rows 16 k + rr); MXFP4: a page's 4 KB of\n"
     "            // packed codes, unswizzled (key r at 64 r), page pq at 4 KB pq of the slot.\n"
     "            constexpr int PER_PAGE = CPS_IDX_TILE * KB / 2048;\n"
     "#pragma unroll\n"
     "            for (int pq = 0; pq < 4; ++pq) {\n"
     "                const bool valid = pg[pq] >= 0;\n"
     "                const u8* src = code_src + (size_t)(u32)(valid ? pg[pq] : 0) * PAGE_BYTES;\n"
     "#pragma unroll\n"
     "                for (int k = 0; k < PER_PAGE; ++k)\n"
     "                    cps_cp_async16_l2(kdst + (PER_PAGE * pq + k) * 2048, src + k * 2048,\n"
     "                                      valid, page_policy);\n"
     "            }\n"
     "            const u32 sdst = sbase + L::OFF_KS + st * (CPS_IDX_WS_KEYS * 4) + ptid * 4;\n"
     "#pragma unroll\n"
     "            for (int r = 0; r < CPS_IDX_WS_KEYS / 128; ++r) {\n"
     "                const int page = ptid < 64 ? pg[2 * r] : pg[2 * r + 1];  // (not pg[key >> 6]:\n"
     "                const bool valid = page >= 0;                          // a local-memory array)\n"
     "                cps_cp_async4(sdst + 512 * r,\n"
     "                              scale_src + (size_t)(u32)(valid ? page : 0) * PAGE_BYTES, valid);\n"
     "            }\n"
     "        };\n",
     "        auto issue_page = [&](int st, int pq, int pg) {\n"
     "            constexpr int PER_PAGE = CPS_IDX_TILE * KB / 2048;\n"
     "            const u32 kdst = sbase + L::OFF_K + st * L::SLOT + dst_off;\n"
     "            const bool valid = pg >= 0;\n"
     "            const u8* src = code_src + (size_t)(u32)(valid ? pg : 0) * PAGE_BYTES;\n"
     "#pragma unroll\n"
     "            for (int k = 0; k < PER_PAGE; ++k)\n"
     "                cps_cp_async16_l2(kdst + (PER_PAGE * pq + k) * 2048, src + k * 2048, valid,\n"
     "                                  page_policy);\n"
     "            if ((ptid >= 64) == (pq & 1)) {\n"
     "                cps_cp_async4(sbase + L::OFF_KS + st * (CPS_IDX_WS_KEYS * 4) + ptid * 4\n"
     "                                  + 512 * (pq >> 1),\n"
     "                              scale_src + (size_t)(u32)(valid ? pg : 0) * PAGE_BYTES, valid);\n"
     "            }\n"
     "            cps_mbar_arrive_cp_async(kfull_page(st, pq));\n"
     "        };\n"
     "        auto issue_stage = [&](int st, const int (&pg)[4]) {\n"
     "#pragma unroll\n"
     "            for (int pq = 0; pq < 4; ++pq) issue_page(st, pq, pg[pq]);\n"
     "        };\n"),
    # the early stage only for a first item that holds keys (its arrivals go out with it);
    # page 0, the query block and its QFULL cp.async arrival, then pages 1-3
    _EARLY_ONLY_WITH_KEYS,
    ("            issue_stage(zero, pg);\n            issue_query(zero, (long long)gb * NN);\n",
     "            issue_page(zero, 0, pg[0]);\n"
     "            issue_query(zero, (long long)gb * NN);\n"
     "            cps_mbar_arrive_cp_async(bar + 8 * zero);\n"
     "#pragma unroll\n"
     "            for (int pq = 1; pq < 4; ++pq) issue_page(zero, pq, pg[pq]);\n"),
    _SPEC_HIT_IS_SPEC,
    ("                cps_mbar_arrive_cp_async(kfull + 8 * st);\n"
     "                if (ptid == 0) {\n"
     "                    s_pm[st] = (pg[0] < 0) | ((pg[1] < 0) << 1) | ((pg[2] < 0) << 2)\n"
     "                               | ((pg[3] < 0) << 3);\n"
     "                    cps_mbar_arrive(kfull + 8 * st);\n"
     "                }\n",
     "                if (ptid == 0) {\n"
     "                    s_pm[st] = (pg[0] < 0) | ((pg[1] < 0) << 1) | ((pg[2] < 0) << 2)\n"
     "                               | ((pg[3] < 0) << 3);\n"
     "#pragma unroll\n"
     "                    for (int pq = 0; pq < 4; ++pq) cps_mbar_arrive(kfull_page(st, pq));\n"
     "                }\n"),
    ("                    if (!spec_hit) issue_query(qs, row0);\n"
     "                    // (This cp.async arrival waits for the stage's copies too: the math\n"
     "                    // waits for both anyway.)\n"
     "                    cps_mbar_arrive_cp_async(bar + 8 * qs);\n",
     "                    if (!spec_hit) {\n"
     "                        issue_query(qs, row0);\n"
     "                        cps_mbar_arrive_cp_async(bar + 8 * qs);\n"
     "                    }\n"),
    # math warpgroup wg waits for its own page
    ("            cps_mbar_wait(kfull + 8 * st, (kv / S) & 1);\n",
     "            cps_mbar_wait(wg == 0 ? kfull + 8 * st : kfull_p + 8 * (S * (wg - 1) + st),\n"
     "                          (kv / S) & 1);\n"),
]
# ... and the guessed first item's bounds, metadata and missing-page mask made at the early
# issue, with their arrivals: neither page 0's barrier nor the query slot then waits for
# the item loop (the first loop pass skips those stores and arrivals). The early bounds
# repeat the loop's formulas (own_lo, own_hi, t_hi, nst, the kept ends): a change to one
# not made to the other would miscount the barriers (a hang, not an error). Folded into
# the kernel, they must be one helper.
_KFULL_PAGE_EARLY = _KFULL_PAGE + [
    ("            issue_page(zero, 0, pg[0]);\n"
     "            issue_query(zero, (long long)gb * NN);\n"
     "            cps_mbar_arrive_cp_async(bar + 8 * zero);\n",
     _EARLY_BOUNDS
     + "            issue_page(zero, 0, pg[0]);\n"
       "            issue_query(zero, (long long)gb * NN);\n"
       "            cps_mbar_arrive_cp_async(bar + 8 * zero);\n"
     + _early_meta("#pragma unroll\n"
                   "                for (int pq = 0; pq < 4; ++pq) cps_mbar_arrive(kfull_page(zero, pq));\n")),
    ("                if (ptid == 0) {\n"
     "                    s_pm[st] = ",
     "                if (ptid == 0 && (!spec_hit || j > 0)) {\n"
     "                    s_pm[st] = "),
    ("                if (j == 0) {\n", "                if (j == 0 && !spec_hit) {\n"),
]
# ... and the early slot warp-uniform to ptxas (a shuffle from lane 0: the early arrivals'
# barrier addresses then sit in uniform registers, where the opaque zero alone had ptxas
# wrap each arrival in a loop over the warp's distinct addresses, R2UR ... BRA.U.ANY)
_KFULL_PAGE_EARLY_UNIFORM = _KFULL_PAGE_EARLY + [
    ("            const int zero = (int)cps_opaque_zero();\n",
     "            const int zero = __shfl_sync(0xffffffffu, (int)cps_opaque_zero(), 0);\n"),
]
# The kernel's one KFULL barrier a stage, with only the early half of the above: the
# guessed first item (issued early only where it holds keys) gets its bounds, metadata,
# missing-page mask and every arrival of its stage and query slot at the early issue, and
# the first loop pass makes none of them. (Does the stage wait for the loop's arrivals,
# without the per-page barriers' issue cost? Folded into the kernel and measured on an H100
# in the thirty-eighth session: no; 0.97-1.003 of the kernel, docs/performance.md.)
_KFULL_EARLY = [
    ("            const int gs0 = gpos - gb * U;\n", "            gs0 = gpos - gb * U;\n"),
    ("        int gpos = -1, gid0 = -1, gid1 = -1, gb = 0, spg[4] = {-1, -1, -1, -1};\n",
     "        int gpos = -1, gid0 = -1, gid1 = -1, gb = 0, gs0 = 0, spg[4] = {-1, -1, -1, -1};\n"),
    _EARLY_ONLY_WITH_KEYS,
    ("            issue_stage(zero, pg);\n            issue_query(zero, (long long)gb * NN);\n",
     _EARLY_BOUNDS
     + "            issue_stage(zero, pg);\n"
       "            issue_query(zero, (long long)gb * NN);\n"
       "            cps_mbar_arrive_cp_async(kfull + 8 * zero);\n"
       "            cps_mbar_arrive_cp_async(bar + 8 * zero);\n"
     + _early_meta("                cps_mbar_arrive(kfull + 8 * zero);\n")),
    _SPEC_HIT_IS_SPEC,
    ("                cps_mbar_arrive_cp_async(kfull + 8 * st);\n"
     "                if (ptid == 0) {\n",
     "                if (!spec_hit || j > 0) cps_mbar_arrive_cp_async(kfull + 8 * st);\n"
     "                if (ptid == 0 && (!spec_hit || j > 0)) {\n"),
    ("                if (j == 0) {\n", "                if (j == 0 && !spec_hit) {\n"),
]
# The math warpgroups parked on named barrier 2 (in hardware: no instruction issued) until
# the producer has issued the guessed first item (or found it missed): in the B=1 trace
# the producer took 0.14 us from its share to the early issue (a few divisions) and 0.49
# us to issue 23 copies a thread, where the bare probe issued its stage in about 0.15 us;
# meanwhile 16 math warps, four beside each producer warp on its scheduler, poll the
# query slot's mbarrier. Does their polling take the producer's issue slots? (No: traced
# on an H100 on 2026-12-07, parked, the first item ended 0.1 us later than on main.)
_MATH_PARKED = [
    ("        if (ids_ready) {\n            if (!full) asm volatile(\"bar.sync 1, 128;\\n\" ::: \"memory\");\n",
     "        asm volatile(\"bar.arrive 2, %0;\\n\" ::\"n\"(CPS_IDX_WS_THREADS) : \"memory\");\n"
     "        if (ids_ready) {\n            if (!full) asm volatile(\"bar.sync 1, 128;\\n\" ::: \"memory\");\n"),
    ("    cps_setmaxnreg_inc<CPS_IDX_WSD_MREGS>();\n",
     "    cps_setmaxnreg_inc<CPS_IDX_WSD_MREGS>();\n"
     "    asm volatile(\"bar.sync 2, %0;\\n\" ::\"n\"(CPS_IDX_WS_THREADS) : \"memory\");\n"),
]
# The guessed item's first 4 page ids, one a lane (lane & 3), shuffled to every lane only
# where the early issue needs them. In main's SASS the 4 loads are warp-uniform, so ptxas
# moves each into a uniform register (R2UR) right after its LDG: before cps_wsd_share, whose
# scan then starts only when the ids are in, though they were loaded some 110 instructions
# (the cut divisions) after the lengths it needs. One load a lane instead of four; the
# shuffles wait for it after the share.
_IDS_SHUFFLED = [
    ("                for (int pq = 0; pq < 4; ++pq)          // (n4 >= 4: gs0 < U)\n"
     "                    if (p0 + pq < bt_cols) spg[pq] = bt_row[p0 + pq];\n",
     "                if (p0 + (lane & 3) < bt_cols) spg[0] = bt_row[p0 + (lane & 3)];\n"),
    ("            for (int pq = 0; pq < 4; ++pq) pg[pq] = (u32)spg[pq] < (u32)num_blocks ? spg[pq] : -1;\n",
     "            for (int pq = 0; pq < 4; ++pq) {\n"
     "                const int id = __shfl_sync(0xffffffffu, spg[0], pq);\n"
     "                pg[pq] = (u32)id < (u32)num_blocks ? id : -1;\n"
     "            }\n"),
]
# Every logit computed as the kernels compute it, none stored (fusion's bound): each store
# behind a test no logit of these inputs passes (one NaN payload), so the epilogue stays.
_NO_LOGITS_STORE = [
    ("                    if (t < 2) rowp[r][t0] = v;\n",
     "                    if (t < 2 && __float_as_uint(v) == 0x7fc0beefu) rowp[r][t0] = v;\n"),
    ("                } else if (t < 2 && col < t_hi) {\n"
     "                    out[(row0 + r) * (long long)width + col] = col < rhi[r] ? v : CPS_NEG_INF;\n",
     "                } else if (t < 2 && col < t_hi && __float_as_uint(v) == 0x7fc0beefu) {\n"
     "                    out[(row0 + r) * (long long)width + col] = col < rhi[r] ? v : CPS_NEG_INF;\n"),
]

VARIANTS = {"kfull_per_page": _KFULL_PAGE, "kfull_per_page_early": _KFULL_PAGE_EARLY,
            "kfull_per_page_early_uniform": _KFULL_PAGE_EARLY_UNIFORM, "kfull_early": _KFULL_EARLY,
            "math_parked": _MATH_PARKED, "ids_shuffled": _IDS_SHUFFLED,
            "no_logits_store": _NO_LOGITS_STORE}
# CpsWsdLayout's mbarrier count: 4 + N S (QFULL, QEMPTY; N a stage)
_LAYOUT_BARRIERS = re.compile(r"OFF_PM = OFF_BAR \+ \(4 \+ (\d+) \* S\) \* 8;")


def variant_source(source, name):
    """The indexer module source ``source`` (raw_kernels.module_source("indexer"), its
    #defines included) as variant ``name`` (VARIANTS): its substitutions, and the launch
    shared memory the kernel's static_assert checks grown by its added mbarriers."""
    from benchmarks import harness
    from cpsparse.raw_kernels import indexer as ki
    src = harness.substitute(source, VARIANTS[name], f"variant {name} of indexer.cu")
    for define, fp4 in (("CPS_IDX_WSD_SMEM_LAUNCH", False), ("CPS_IDX_WSD_FP4_SMEM_LAUNCH", True)):
        old = f"#define {define} {ki.WSD_SMEM[fp4]}\n"
        src = harness.substitute(src, [(old, f"#define {define} "
                                        f"{ki.WSD_SMEM[fp4] + variant_smem_extra(name, fp4)}\n")],
                                 f"variant {name}'s launch shared memory")
    return src


def variant_smem_extra(name, fp4):
    """Bytes of shared memory variant ``name`` ("base": none) adds to the ws decode CTA
    (fp4: MXFP4 keys, a ring of WSD_FP4_STAGES stages; else WS_STAGES): 8 a stage for
    each mbarrier a stage its layout has beyond the kernel's, read from both sources."""
    from benchmarks import harness
    from cpsparse import raw_kernels
    from cpsparse.raw_kernels import indexer as ki
    if name == "base":
        return 0
    source = raw_kernels.module_source("indexer")
    per_stage = [int(_LAYOUT_BARRIERS.search(src).group(1)) for src in (
        source, harness.substitute(source, VARIANTS[name], f"variant {name} of indexer.cu"))]
    return 8 * (per_stage[1] - per_stage[0]) * (ki.WSD_FP4_STAGES if fp4 else ki.WS_STAGES)


@contextlib.contextmanager
def variant_in_force(name, transform=None):
    """Launches inside run the ws decode kernels as variant ``name`` ("base": as they are),
    with its launch shared memory; ``transform`` (source -> source, e.g. trace_source)
    applied after the variant's substitutions."""
    from benchmarks import harness
    from cpsparse import raw_kernels
    from cpsparse.raw_kernels import indexer as ki
    if name == "base" and transform is None:
        yield
        return
    src = raw_kernels.module_source("indexer")
    src = src if name == "base" else variant_source(src, name)
    src = src if transform is None else transform(src)
    saved = dict(ki.WSD_SMEM)
    try:
        for fp4 in (False, True):
            ki.WSD_SMEM[fp4] += variant_smem_extra(name, fp4)
        with harness.module_source_override("indexer", src, ki._PLANS, ki._PREFILL_LAUNCHES):
            yield
    finally:
        ki.WSD_SMEM.update(saved)


# (batch, context, next_n, MXFP4 keys) of the A/B: the decode rows of DESIGN section 12
AB_SHAPES = ((1, 32768, 1, False), (1, 32768, 1, True), (8, 32768, 1, False),
             (4, 131072, 1, False), (64, 32768, 1, False), (64, 32768, 2, False),
             (64, 32768, 1, True), (256, 4096, 1, False))


def _shape_name(shape):
    """An AB_SHAPES entry as the A/B prints it."""
    b, ctx, next_n, fp4 = shape
    return f"B={b} x {ctx} next_n {next_n} {'MXFP4' if fp4 else 'fp8'}"


def ab(names, rounds=3, shapes=AB_SHAPES):
    """The in-process A/B of the ws decode kernels as they are ("base") and as variants
    ``names``: each compiled once, ``rounds`` rounds alternating the order, each shape a
    CUDA-graph replay of 10 calls over 3 fresh input sets (timing.time_graph,
    clean_logits=False); every variant's first output (poisoned with NaN) compared with the
    base's bit for bit. Prints each (round, name)'s times as they come, then a line a
    shape; returns {shape: {name: [us a round]}} and {shape: {name: bit-identical}}."""
    import statistics

    import cupy as cp
    import numpy as np

    from cpsparse import timing
    from cpsparse.raw_kernels import indexer as ki
    tags = ["base", *names]
    cases = {}
    for b, ctx, _, fp4 in shapes:
        if (b, ctx, fp4) not in cases:
            cases[b, ctx, fp4] = _decode_case(cp, b, ctx, mxfp4=fp4)
    times = {s: {t: [] for t in tags} for s in shapes}
    outs = {s: {} for s in shapes}
    for rnd in range(rounds):
        for tag in (tags if rnd % 2 == 0 else tags[::-1]):
            with variant_in_force(tag):
                for k, s in enumerate(shapes):
                    b, ctx, next_n, fp4 = s
                    fp8_cache, fp4_cache, table, queries = cases[b, ctx, fp4]
                    cache = fp4_cache if fp4 else fp8_cache
                    sets = []
                    for i in range(3):                  # (the same inputs for every tag)
                        cp.random.seed(1000 * k + i)
                        sets.append(queries(next_n))

                    def call(lens, q8, w, out):
                        return ki.paged_mqa_logits(cp, q8, cache, w, lens, table, ctx, out=out,
                                                   clean_logits=False)
                    if rnd == 0:
                        sets[0][3].fill(np.nan)
                        call(*sets[0])
                        outs[s][tag] = sets[0][3].get()
                    t = timing.time_graph(call, sets, reps=10, warmup=3, iters=40)
                    times[s][tag].append(t["median_ms"] * 1e3)
            # (a round's times as they come: a run cut off by its caller's time limit
            # still leaves what it measured)
            print(f"round {rnd + 1} {tag}: " + ", ".join(
                f"{_shape_name(s)} {times[s][tag][-1]:.3f}" for s in shapes), flush=True)
    same = {s: {t: bool(np.array_equal(outs[s]["base"], outs[s][t], equal_nan=True))
                for t in names} for s in shapes}
    for s in shapes:
        mb = statistics.median(times[s]["base"])
        line = f"{_shape_name(s)}: base {mb:.3f} us"
        for t in names:
            m = statistics.median(times[s][t])
            line += f" | {t} {m:.3f} ({m / mb:.3f}{'' if same[s][t] else ', OUTPUT DIFFERS'})"
        print(line, flush=True)
    return times, same


# (batch, context, next_n) of the fusion bound: the fp8 decode rows of DESIGN section 12
FUSION_SHAPES = ((1, 32768, 1), (4, 131072, 1), (64, 32768, 1), (64, 32768, 2), (256, 4096, 1))


def fusion(rounds=3, k=2048, shapes=FUSION_SHAPES):
    """What fusing the decode scoring with the top-k (the logits never written) could gain,
    measured: for each fp8 decode shape, CUDA-graph replays (10 calls over 3 fresh input
    sets) of the scoring kernel as it is (clean_logits=False, as the layer calls it), the
    top-k kernel on its logits (k, the decode rows' windows), the two in one graph, and
    the scoring as variant no_logits_store (every logit computed, none stored): a fused
    kernel's scoring can be no faster than that, and its selection and the merge of a
    row's CTAs come on top. Rounds alternate the order. Prints a line a shape (medians,
    us) with ``two / no_store``, the most fusion could gain; returns {shape: {what: [us
    a round]}}."""
    import statistics

    import cupy as cp

    from cpsparse import timing
    from cpsparse.raw_kernels import indexer as ki
    from cpsparse.raw_kernels import topk as kt
    whats = ("scoring", "topk", "two", "no_store")
    times = {s: {w: [] for w in whats} for s in shapes}
    for s in shapes:
        b, ctx, next_n = s
        cache, _, table, queries = _decode_case(cp, b, ctx)
        sets = []
        for i in range(3):
            cp.random.seed(100 + i)
            lens, q8, w, out = queries(next_n)
            sets.append((lens, q8, w, out, cp.empty((b * next_n, k), cp.int32)))

        def scoring(lens, q8, w, out, idx):
            return ki.paged_mqa_logits(cp, q8, cache, w, lens, table, ctx, out=out,
                                       clean_logits=False)

        def topk(lens, q8, w, out, idx):
            return kt.topk_per_row_decode(cp, out, lens, next_n, k, idx)

        def two(*args):
            scoring(*args)
            return topk(*args)
        for a in sets:                              # (logits for the top-k's own graph)
            scoring(*a)
        fns = {"scoring": scoring, "topk": topk, "two": two}
        for rnd in range(rounds):
            for what in (whats if rnd % 2 == 0 else whats[::-1]):
                if what == "no_store":
                    with variant_in_force("no_logits_store"):
                        t = timing.time_graph(scoring, sets, reps=10, warmup=3, iters=40)
                else:
                    t = timing.time_graph(fns[what], sets, reps=10, warmup=3, iters=40)
                times[s][what].append(t["median_ms"] * 1e3)
        med = {w: statistics.median(times[s][w]) for w in whats}
        print(f"B={b} x {ctx} next_n {next_n}: " + ", ".join(f"{w} {med[w]:.2f}" for w in whats)
              + f" | two / no_store {med['two'] / med['no_store']:.3f}", flush=True)
    return times


# mode -> (its file argument, reader, printer, what an empty read means)
READERS = {"--parse": ("NCU_REPORT", parse, summary, "did ncu run?"),
           "--source": ("SOURCE_CSV", read_source, source_summary,
                        "did ncu --page source run?")}


def _rounds(args):
    """([N] of the last ``--rounds=N`` among ``args``, or [] for the mode's default; the
    other arguments)."""
    rounds = [int(a.split("=", 1)[1]) for a in args if a.startswith("--rounds=")]
    return rounds[-1:], [a for a in args if not a.startswith("--rounds=")]


def main(argv):
    if argv[:1] and argv[0] in READERS:
        what, read, show, hint = READERS[argv[0]]
        if len(argv) != 2:
            raise SystemExit(f"usage: python3 -m benchmarks.profile_indexer {argv[0]} {what}")
        with open(argv[1]) as f:
            report = read(f.read())
        if not report:
            raise SystemExit(f"no kernel report in {argv[1]} ({hint})")
        print(show(report))
        return 0
    if argv[:1] == ["trace"]:
        sizes = [int(a) for a in argv[1:] if not a.startswith("--variant=")]
        variants = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--variant=")]
        for v in variants:
            if v not in VARIANTS:
                raise SystemExit(f"unknown variant {v} (variants: {', '.join(VARIANTS)})")
        trace(*sizes[:3], *variants[-1:])
        return 0
    if argv[:1] == ["fusion"]:
        rounds, rest = _rounds(argv[1:])
        if rest:
            raise SystemExit("usage: python3 -m benchmarks.profile_indexer fusion [--rounds=N]")
        fusion(*rounds)
        return 0
    if argv[:1] == ["ab"]:
        rounds, names = _rounds(argv[1:])
        unknown = sorted(set(names) - set(VARIANTS))
        if not names or unknown:
            raise SystemExit("usage: python3 -m benchmarks.profile_indexer ab VARIANT... "
                             f"[--rounds=N] (variants: {', '.join(VARIANTS)}; unknown: "
                             f"{', '.join(unknown) or 'none'})")
        ab(names, *rounds)
        return 0
    launch()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
