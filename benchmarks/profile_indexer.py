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
"""

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


def launch():
    """Each ws decode kernel once on B=64 x 32K (fp8 and MXFP4 pages of the same keys)."""
    import cupy as cp

    import cpsparse as cps
    from benchmarks import bench_peers as bp
    from cpsparse.raw_kernels import indexer as ki

    block, dim, heads, batch, ctx = 64, 128, 64, 64, 32768
    pages = batch * (ctx // block)
    fp8 = cps.IndexerKCache(pages, block, dim, xp=cp)
    fp4 = cps.IndexerKCache(pages, block, dim, xp=cp, dtype="mxfp4")
    bp._fill_indexer_mxfp4(cp, fp4.data, fp8.data)
    table = cp.random.permutation(pages).astype(cp.int32).reshape(batch, -1)
    for next_n in (1, 2):
        lens = bp._decode_lens(cp, batch, ctx, next_n)
        q8 = bp._codes(cp, (batch, next_n, heads, dim))
        w = cp.random.standard_normal((batch * next_n, heads), dtype=cp.float32)
        out = cp.empty((batch * next_n, ctx), cp.float32)
        for cache in (fp8, fp4):
            plan = ki.paged_plan(batch, next_n, heads, dim, ctx, block,
                                 fp4=cache.dtype == "mxfp4")
            if plan[2].name != ki.ws_kernel_name(next_n, cache.dtype == "mxfp4"):
                raise RuntimeError(f"the plan picked {plan[2].name}, not a ws kernel")
            ki.paged_mqa_logits(cp, q8, cache, w, lens, table, ctx, out=out, plan=plan)
    cp.cuda.runtime.deviceSynchronize()
    print("launched the ws decode kernels (fp8 and MXFP4, next_n 1 and 2)")


# mode -> (its file argument, reader, printer, what an empty read means)
READERS = {"--parse": ("NCU_REPORT", parse, summary, "did ncu run?"),
           "--source": ("SOURCE_CSV", read_source, source_summary,
                        "did ncu --page source run?")}


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
    launch()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
