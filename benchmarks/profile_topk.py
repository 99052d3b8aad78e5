"""Where the top-k kernel's time goes, phase by phase (a diagnostic, not a benchmark).

Run on a GPU machine from the repository root::

    PYTHONPATH=$PWD python3 -m benchmarks.profile_topk

It compiles ``topk.cu`` with clock64 stamps (a text substitution in the module source,
never written to disk; the traced kernel's output is right) taken by thread 0 of every
CTA at the phase boundaries of ``tk_body``: start, the coarse histogram pass (R0)
begins, R0 ends, R0's threshold is chosen, the filter pass ends, the fallback radix
rounds begin (only where they run), the row is done; and the global timer at start and
done (the kernel's span over all CTAs, and how late the last one starts). Finer stamps
split the time before R0 (the row's window known, the warps' statistics stored, the
transform chosen) and R0's threshold (its suffix sums, the cluster barrier,
``tk_find_cluster``). ``r256`` (rows in shared memory, ``tk_srow_body``) carries no stamps:
its shape prints the graph time only. For the ``topk_*`` shapes of DESIGN section 12
(normal and low-contrast inputs) and B=1 x 32K (8-CTA clusters) it prints, over
the CTAs that took the long-row path, the median, p90 and maximum of each phase in
microseconds at the SM clock, with the untraced kernel's graph-replay time beside them.
A maximum far above the p90 is one slow CTA (a cluster's fallback that rescans its
slice), which sets the kernel's time. No ablations: with a part of the filter pass
removed, the compiler drops what fed it too (an early try timed a pass that no longer
computed anything). Results: stdout and ``$OUT/profile_topk.json`` when set.

``python3 -m benchmarks.profile_topk logits [--base=PATH] [--rounds=N]`` times the decode
top-k (the default plan, CUDA-graph replays) on the paged scoring kernel's own logits
(``profile_indexer``'s random keys and queries, clean_logits=False as the layer calls it)
and on standard normal and student-t(3) rows of the same shapes, each selection checked
(the k largest values, distinct positions). Those logits are heavy tailed and their
threshold bin can hold several hundred candidates where a normal row's holds about 130.
With ``--base`` (an older ``topk.cu``, e.g. ``git show REV:cpsparse/raw_kernels/topk.cu``)
the same rows run on that source too, rounds alternating (base, this tree, then this
tree, base), and each row prints base / this tree. Results: stdout and
``$OUT/profile_topk_logits.json`` when set.

``python3 -m benchmarks.profile_topk widths [--base=PATH] [--rounds=N]`` times ``r256``
(one CTA a row, the row in shared memory) on 4096 standard normal rows at the widths of
WIDTHS, on both sides of the steps where one more or one fewer CTA fits an SM, with the
driver's count of CTAs an SM and the shared-memory arithmetic beside each side (the
static shared memory of the kernel and the row buffer). ``--base`` and the rounds as in
the logits mode. Results: stdout and ``$OUT/profile_topk_widths.json`` when set.
"""

import json
import os
import pathlib
import sys

from benchmarks import harness

TRACE_CTAS = 16384
# The stamps' order in tk_trace's rows. The last four split adapt and r0_select: the row's
# window known (after its barrier), the warps' statistics stored (after theirs), R0's
# suffix sums done and, in a cluster, the cluster barrier passed before tk_find_cluster.
EVENTS = ("start", "r0_begin", "r0_end", "r0_select", "filter_end", "fallback", "done",
          "window", "stats", "r0_suffix", "r0_cluster")
# and the global timer (ns, comparable across SMs) at start and done: the kernel's span
GLOBAL_EVENTS = ("gstart", "gdone")
PHASES = (("adapt", "start", "r0_begin"), ("r0_histogram", "r0_begin", "r0_end"),
          ("r0_select", "r0_end", "r0_select"), ("filter", "r0_select", "filter_end"),
          ("finish", "filter_end", "done"), ("total", "start", "done"),
          # adapt, split: the window's load and barrier; the statistics, R0's first
          # tile's loads issued and its histogram cleared, to a barrier; the transform
          # (tk_adapt_warps in warp 0, then a barrier; the first tile's wait falls in
          # r0_histogram)
          ("window", "start", "window"), ("stats", "window", "stats"),
          ("transform", "stats", "r0_begin"),
          # r0_select, split: the suffix sums (from thread 0's end of R0, so waiting for
          # the other warps' atomics, over two barriers), the cluster barrier (with the
          # suffix stores, and the wait for the cluster's slowest CTA), tk_find_cluster
          # and the closing barrier (C == 1: the suffix, then tk_decide_local)
          ("suffix", "r0_end", "r0_suffix"), ("cluster_sync", "r0_suffix", "r0_cluster"),
          ("find_cluster", "r0_cluster", "r0_select"), ("decide", "r0_suffix", "r0_select"))
# Phases stamped inside select, which every round calls: read only on CTAs without the
# fallback stamp, those whose row went to the rank from R0 (a fallback round's stamps
# would overwrite R0's; the stamp also marks rows R0 finished alone, left out too).
R0_ONLY = ("r0_suffix", "r0_cluster")
SHAPES = [("prefill", 8192, 8192, ""), ("decode", 64, 32768, ""), ("decode", 64, 131072, ""),
          ("decode", 64, 131072, "_low10bits"), ("decode", 4, 131072, ""),
          ("decode", 1, 131072, ""), ("decode", 1, 32768, "")]

_STAMP = "tk_trace_at"
_DONE = EVENTS.index("done")
# (anchor, replacement): each anchor must occur once in topk.cu (tests/test_profile_topk.py).
TRACE = [
    ("#define TK_MAX_CLUSTER 16\n",
     "#define TK_MAX_CLUSTER 16\n"
     f"__device__ long long tk_trace[{TRACE_CTAS}][{len(EVENTS) + len(GLOBAL_EVENTS)}];\n"
     f"__device__ __forceinline__ void {_STAMP}(int ev) {{\n"
     f"    if (threadIdx.x == 0 && blockIdx.x < {TRACE_CTAS}) {{\n"
     "        tk_trace[blockIdx.x][ev] = clock64();\n"
     f"        if (ev == 0 || ev == {_DONE}) {{\n"
     "            long long g;\n"
     '            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));\n'
     f"            tk_trace[blockIdx.x][{len(EVENTS)} + (ev == {_DONE})] = g;\n"
     "        }\n"
     "    }\n"
     "}\n"),
    ("    const int rank = C > 1 ? (int)tk_cluster_rank() : 0;\n",
     "    const int rank = C > 1 ? (int)tk_cluster_rank() : 0;\n"
     f"    {_STAMP}(0);\n"),
    ("    // ---- R0: every value of the slice",
     f"    {_STAMP}(1);\n"
     "    // ---- R0: every value of the slice"),
    ("    select(0, (u32)k, TK_ROUND);\n",
     f"    {_STAMP}(2);\n"
     "    select(0, (u32)k, TK_ROUND);\n"
     f"    {_STAMP}(3);\n"),
    ("    if (to_rank) {\n        rank_select(0);\n",
     f"    {_STAMP}(4);\n"
     "    if (to_rank) {\n        rank_select(0);\n"
     f"        {_STAMP}({_DONE});\n"),
    ("    // ---- Fallback: radix rounds",
     f"    {_STAMP}(5);\n"
     "    // ---- Fallback: radix rounds"),
    ("            rank_select(nb);\n",
     "            rank_select(nb);\n"
     f"            {_STAMP}({_DONE});\n"),
    ("    if (C > 1) tk_cluster_sync<C>();            // no CTA leaves",
     f"    {_STAMP}({_DONE});\n"
     "    if (C > 1) tk_cluster_sync<C>();            // no CTA leaves"),
    ("        s.shift = bs_shift;\n    }\n    __syncthreads();\n",
     "        s.shift = bs_shift;\n    }\n    __syncthreads();\n"
     f"    {_STAMP}({EVENTS.index('window')});\n"),
    ("    __syncthreads();\n    // Warp 0 chooses the transform",
     "    __syncthreads();\n"
     f"    {_STAMP}({EVENTS.index('stats')});\n"
     "    // Warp 0 chooses the transform"),
    ("        const u32 excl = tk_round_suffix<THREADS>(s, h, loc, tid, lane, warp);\n",
     "        const u32 excl = tk_round_suffix<THREADS>(s, h, loc, tid, lane, warp);\n"
     f"        if (hb == 0 && need == (u32)k) {_STAMP}({EVENTS.index('r0_suffix')});\n"),
    ("            tk_cluster_sync<C>();\n            if (warp == 0) tk_find_cluster",
     "            tk_cluster_sync<C>();\n"
     f"            if (hb == 0 && need == (u32)k) {_STAMP}({EVENTS.index('r0_cluster')});\n"
     "            if (warp == 0) tk_find_cluster"),
]


def traced_source(source):
    """``source`` (topk.cu's module source) with the stamps of TRACE inserted."""
    return harness.substitute(source, TRACE, "trace of topk.cu")


def summarize(stamps, mhz):
    """Per-phase median and p90 (us at ``mhz``) over the CTAs whose row took the long
    path (stamps int64 [ctas, events], 0 = not reached), and how many ran the fallback."""
    import numpy as np
    s = np.asarray(stamps, dtype=np.int64)
    ix = {e: i for i, e in enumerate(EVENTS)}
    long_path = (s[:, ix["r0_begin"]] > 0) & (s[:, ix["done"]] > 0)
    out = {"ctas": int(long_path.sum()),
           "fallback_ctas": int((long_path & (s[:, ix["fallback"]] > 0)).sum())}
    if s.shape[1] > len(EVENTS):               # global timer: first start to last done
        g0, g1 = s[:, len(EVENTS)], s[:, len(EVENTS) + 1]
        ran = g0 > 0
        out["span_us"] = float((g1[ran].max() - g0[ran].min()) / 1e3) if ran.any() else None
        out["last_start_us"] = float((g0[ran].max() - g0[ran].min()) / 1e3) if ran.any() \
            else None
    no_fallback = long_path & (s[:, ix["fallback"]] == 0)
    for name, a, b in PHASES:
        rows = (no_fallback if a in R0_ONLY or b in R0_ONLY else long_path) \
            & (s[:, ix[a]] > 0) & (s[:, ix[b]] > 0)
        d = (s[rows, ix[b]] - s[rows, ix[a]]) / mhz
        out[name] = ({"median_us": float(np.median(d)), "p90_us": float(np.percentile(d, 90)),
                      "max_us": float(d.max())} if d.size else None)
    return out


# ---- logits: the decode top-k on the scoring kernel's logits --------------------------
LOGIT_SHAPES = ((64, 32768), (1, 32768), (4, 131072), (256, 4096), (64, 131072))
LOGIT_KINDS = ("scoring", "normal", "student_t3")


def base_source(path):
    """The top-k module's source with ``topk.cu`` replaced by the file at ``path``."""
    from cpsparse import raw_kernels
    own = raw_kernels.module_source("topk")
    cu = (pathlib.Path(raw_kernels.__file__).parent / "topk.cu").read_text()
    if cu not in own:
        raise ValueError("topk.cu is not verbatim in the top-k module's source")
    return own.replace(cu, pathlib.Path(path).read_text())


USAGE = ("python3 -m benchmarks.profile_topk [logits|widths] [--base=PATH] [--rounds=N]")


def parse_mode_args(args):
    """(base path or None, rounds) of the logits and widths modes' arguments."""
    from benchmarks.profile_indexer import _rounds
    given, rest = _rounds(args)
    rounds = given[0] if given else 2
    base = None
    for a in rest:
        if not a.startswith("--base="):
            raise SystemExit(f"unknown argument {a!r}: {USAGE}")
        base = a.split("=", 1)[1]
    if rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {rounds}")
    return base, rounds


def _logit_sets(cp, kind, scoring, rng):
    """Three input sets (context lengths, logits) of one kind, shaped as ``scoring``'s."""
    if kind == "scoring":
        return scoring
    if kind == "normal":
        return [(lens, cp.random.standard_normal(x.shape, dtype=cp.float32))
                for lens, x in scoring]
    return [(lens, cp.asarray(rng.standard_t(3, x.shape).astype("float32")))
            for lens, x in scoring]


def _sources(base_path):
    """{side: the top-k module's source}: "base" (``base_path``'s topk.cu) first when
    given, then "new" (this tree)."""
    from cpsparse import raw_kernels
    sources = {}
    if base_path:
        sources["base"] = base_source(base_path)
    sources["new"] = raw_kernels.module_source("topk")
    return sources


def _time_sides(cp, sources, sets, k, rounds, on_side=None):
    """One row: the decode top-k (the default plan, graph replays) over ``sets``
    ((context lengths, logits) pairs), on each side's source; even rounds run the first
    side first, odd ones last. In round 0 every selection is checked against the k
    largest values (bench_peers' check) and ``on_side(side, row)`` runs, if given,
    with that side's kernels in force."""
    from benchmarks.bench_peers import _topk_check
    from cpsparse import timing
    from cpsparse.raw_kernels import topk as ktopk

    idx = cp.empty((sets[0][1].shape[0], k), cp.int32)
    row = {"exact": True}
    for r in range(rounds):
        order = list(sources) if r % 2 == 0 else list(sources)[::-1]
        for side in order:
            with harness.module_source_override("topk", sources[side], ktopk._LAUNCHES):
                def call(lens, x):
                    return ktopk.topk_per_row_decode(cp, x, lens, 1, k, idx)
                t = timing.time_graph(call, sets, reps=10, warmup=3, iters=25)
                row.setdefault(side + "_us", []).append(t["median_ms"] * 1e3)
                if r == 0:
                    for lens, x in sets:
                        call(lens, x)
                        row["exact"] &= _topk_check(cp, x, lens.reshape(-1), idx,
                                                    cp.sort(x, axis=1)[:, -k:])[1]["ok"]
                    if on_side is not None:
                        on_side(side, row)
    return row


def _finish(rows, name, row, extra=""):
    """Print ``row`` (best round of each side, base / this tree) and keep it."""
    rows[name] = row
    line = f"{name}: {min(row['new_us']):.2f} us"
    if "base_us" in row:
        row["base_over_new"] = min(row["base_us"]) / min(row["new_us"])
        line += (f" (base {min(row['base_us']):.2f} us, base / this tree "
                 f"{row['base_over_new']:.3f})")
    print(line + extra + ("" if row["exact"] else "  WRONG SELECTION"), flush=True)


def _save(rows, base_path, filename):
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, filename), "w") as f:
            json.dump({"device": harness.device_info(), "base": base_path, "rows": rows}, f,
                      indent=2)
    if not all(r["exact"] for r in rows.values()):
        raise SystemExit("a selection was wrong (see the rows marked WRONG SELECTION)")
    return rows


def logits(args):
    """The logits mode (see the module docstring): {row name: times} over LOGIT_SHAPES."""
    import numpy as np

    from benchmarks import profile_indexer
    from cpsparse.raw_kernels import indexer as kindexer

    base_path, rounds = parse_mode_args(args)
    cp = harness.cupy()
    sources = _sources(base_path)
    k, rng, rows = 2048, np.random.default_rng(7), {}
    for batch, ctx in LOGIT_SHAPES:
        cache, _, table, queries = profile_indexer._decode_case(cp, batch, ctx)
        scoring = []
        for _ in range(3):
            lens, q8, w, out = queries(1)
            kindexer.paged_mqa_logits(cp, q8, cache, w, lens, table, ctx, out=out,
                                      clean_logits=False)
            scoring.append((lens, out))
        del cache
        for kind in LOGIT_KINDS:
            row = _time_sides(cp, sources, _logit_sets(cp, kind, scoring, rng), k, rounds)
            _finish(rows, f"topk_decode_{batch}x{ctx}_{kind}", row)
    return _save(rows, base_path, "profile_topk_logits.json")


# ---- widths: r256's CTAs an SM at widths around its occupancy steps ---------------------
# r256 runs one CTA a row with the row in shared memory, at most five CTAs an SM (its
# registers); the row buffer and its static shared memory set how many fit below that.
# These widths sit on both sides of the steps that 2,112 bytes less static shared memory
# moves (the rank finish's counts moved into the row buffer, tried in the forty-fifth
# session, docs/performance.md): 8192 and 11600 keep their CTAs an SM either way.
WIDTHS = (8192, 8800, 9100, 11600, 12100)
WIDTH_ROWS = 4096


def ctas_per_sm(static_bytes, dynamic_bytes, smem_per_sm=233472, reserved=1024, most=5,
                granule=128):
    """CTAs an SM by shared memory (an H100's 228 KB an SM, allocated in 128-byte units,
    1 KB reserved a CTA), at most ``most`` (r256's register bound): the arithmetic the
    widths mode checks against the driver's count."""
    used = -(-(static_bytes + dynamic_bytes) // granule) * granule
    return min(most, smem_per_sm // (used + reserved))


def widths(args):
    """The widths mode (see the module docstring): {row name: times and CTAs an SM}."""
    from cpsparse.raw_kernels import topk as ktopk

    base_path, rounds = parse_mode_args(args)
    cp = harness.cupy()
    sources = _sources(base_path)
    k, rows = 2048, {}

    def occupancy(side, row):        # the driver's count, with this side's kernel
        from cupy.cuda import driver
        fn, _, threads, smem = ktopk._plan(WIDTH_ROWS, width, None, None)
        static = int(fn.raw.attributes["shared_size_bytes"])
        try:
            row[side + "_ctas_per_sm"] = driver.occupancyMaxActiveBlocksPerMultiprocessor(
                fn.raw.kernel.ptr, threads, smem)
        except Exception:  # noqa: BLE001 - a diagnostic: the arithmetic stands beside it
            row[side + "_ctas_per_sm"] = None
        row[side + "_ctas_by_arithmetic"] = ctas_per_sm(static, smem)
        row[side + "_static_smem"] = static
        row["variant"] = fn.name

    for width in WIDTHS:
        lens = cp.full(WIDTH_ROWS, width, cp.int32)
        sets = [(lens, cp.random.standard_normal((WIDTH_ROWS, width), dtype=cp.float32))
                for _ in range(3)]
        row = _time_sides(cp, sources, sets, k, rounds, occupancy)
        row["width"] = width
        ctas = "  CTAs an SM (driver / arithmetic): " + ", ".join(
            f"{side} {row[side + '_ctas_per_sm']} / {row[side + '_ctas_by_arithmetic']}"
            for side in sources)
        _finish(rows, f"topk_r256_{WIDTH_ROWS}x{width}", row, ctas)
        del sets
    return _save(rows, base_path, "profile_topk_widths.json")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["logits"]:
        return logits(argv[1:])
    if argv[:1] == ["widths"]:
        return widths(argv[1:])
    if argv:
        raise SystemExit(f"unknown arguments {argv}: {USAGE}")
    cp = harness.cupy()
    import cpsparse
    from benchmarks.bench_peers import K, _topk_logits
    from cpsparse import raw_kernels, timing
    from cpsparse.raw_kernels import topk as ktopk

    cpsparse.set_device_value_checks(False)
    mhz = cp.cuda.Device().attributes["ClockRate"] / 1e3
    base = raw_kernels.module_source("topk")
    results = {}
    for mode, m, width, variant in SHAPES:
        name = (f"topk_prefill_{m}x{width}_causal" if mode == "prefill"
                else f"topk_decode_{m}x{width}") + variant
        sets = [(_topk_logits(cp, mode, m, width, variant),) for _ in range(2)]
        out = cp.empty((m, K), cp.int32)
        if mode == "prefill":
            starts, lens = cp.zeros(m, cp.int32), cp.arange(1, m + 1, dtype=cp.int32)

            def call(x):
                return cpsparse.topk_per_row(x, starts, lens, K, out=out)
        else:
            lens = cp.full(m, width, cp.int32)

            def call(x):
                return cpsparse.topk_per_row_decode(x, lens, 1, K, out=out)
        g = timing.time_graph(call, sets, reps=4, warmup=2, iters=15)
        with harness.module_source_override("topk", traced_source(base), ktopk._LAUNCHES):
            for _ in range(3):                          # compile, then steady state
                call(sets[0][0])
            cp.cuda.Device().synchronize()
            buf = raw_kernels.get_module("topk").get_global("tk_trace")
            stamps = cp.ndarray((TRACE_CTAS, len(EVENTS) + len(GLOBAL_EVENTS)), cp.int64, buf)
            stamps.fill(0)
            call(sets[1][0])
            cp.cuda.Device().synchronize()
            summary = summarize(stamps.get(), mhz)
        summary["graph_us"] = g["median_ms"] * 1e3
        results[name] = summary
        if summary["ctas"] == 0:      # r256 (rows in shared memory) carries no stamps
            print(f"{name}: graph {summary['graph_us']:.1f} us, no CTA stamped the "
                  "long-row path (r256 has no stamps; or every row was short)", flush=True)
            continue
        phases = "  ".join(f"{p} {summary[p]['median_us']:.1f}/{summary[p]['p90_us']:.1f}"
                           f"/{summary[p]['max_us']:.1f}"
                           for p, _, _ in PHASES if summary[p] is not None)
        print(f"{name}: graph {summary['graph_us']:.1f} us, span {summary['span_us']:.1f} us "
              f"(last CTA starts at {summary['last_start_us']:.1f}), {summary['ctas']} CTAs "
              f"({summary['fallback_ctas']} fallback); median/p90/max us: {phases}",
              flush=True)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "profile_topk.json"), "w") as f:
            json.dump({"device": harness.device_info(), "sm_mhz": mhz, "shapes": results},
                      f, indent=2)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
