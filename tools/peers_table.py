"""Turn benchmarks/results/peers.json and peers_h100.json (``python3 -m
benchmarks.bench_peers``) into docs/performance_peers.md: a section a device, one table
row per workload of the peer protocol.

Usage: python tools/peers_table.py [RESULTS.json ...]   (default: RESULTS)
"""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
GROUPS = [("mla_decode", "Sparse MLA decode (fp8_ds_mla cache, topk 2048, 32K contexts)"),
          ("mla_model1_decode", "Sparse MLA decode over DeepSeek-V4's MODEL1 cache (B 128, "
           "32K contexts, top-k slots and a 128-token window)"),
          ("mla_prefill", "Sparse MLA prefill (topk 2048 of 8192 bf16 rows)"),
          ("indexer_prefill", "Indexer scoring, prefill (H 64, D 128, causal)"),
          ("indexer_decode", "Indexer scoring, paged decode (H 64, D 128)"),
          ("topk", "Top-k, k = 2048 (torch.topk stands in for vLLM's kernels)"),
          ("decode_step", "Decode step of one layer: scoring + top-k + slots + attention")]


# The issues' targets over the peer rows: (what, issue, workloads, minimum speedup, the
# speedups it holds: "call" the public op's, "kernel" the graph-replayed one's). A target
# is met when every listed speedup of every matching row reaches the minimum.
TARGETS = [
    ("sparse MLA decode vs FlashMLA (aim 1.1)", 14,
     lambda w: w.startswith("mla_decode_") and not w.endswith("_bf16io"), 1.0,
     ("call", "kernel")),
    ("the same, FlashMLA's dtypes on both sides (bf16 q in, bf16 out)", 14,
     lambda w: w.startswith("mla_decode_") and w.endswith("_bf16io"), 1.0,
     ("call", "kernel")),
    ("sparse MLA prefill vs FlashMLA", 15,
     lambda w: w.startswith("mla_prefill_") and not w.endswith("_bf16io"), 1.0,
     ("call", "kernel")),
    ("the same, FlashMLA's dtypes on both sides (bf16 q and rows in, bf16 out)", 15,
     lambda w: w.startswith("mla_prefill_") and w.endswith("_bf16io"), 1.0,
     ("call", "kernel")),
    ("indexer prefill vs DeepGEMM (aim 1.15)", 16,
     lambda w: w.startswith("indexer_prefill_"), 1.0, ("call", "kernel")),
    ("indexer paged decode vs DeepGEMM", 16,
     lambda w: w.startswith("indexer_decode_") and not w.endswith("_mxfp4"), 1.0,
     ("call", "kernel")),
    ("MXFP4 decode vs DeepGEMM's FP8, B=64 x 32K and B=4 x 128K", 20,
     lambda w: w in ("indexer_decode_B64_ctx32768_n1_mxfp4",
                     "indexer_decode_B4_ctx131072_n1_mxfp4"), 1.6, ("call", "kernel")),
    ("decode step vs the vLLM stack, graph replay and eager", 18,
     lambda w: w.startswith("decode_step_"), 1.0, ("call",)),
]


def target_lines(rows):
    """The summary table of :data:`TARGETS` over ``rows`` (targets with no row: left out)."""
    lines = ["**Targets of the open issues over these rows**", "",
             "| target | issue | minimum | rows | lowest speedup (workload) | status |",
             "| --- | --- | --- | --- | --- | --- |"]
    for what, issue, match, need, kinds in TARGETS:
        got = [(r[f"{k}_speedup" if k == "kernel" else "speedup"], f"{r['workload']} {k}")
               for r in rows if match(r["workload"]) for k in kinds]
        got = [(v, where) for v, where in got if v is not None]
        if not got:
            continue
        low, where = min(got)
        missed = sum(v < need for v, _ in got)
        status = "met" if not missed else f"missed ({missed} of {len(got)} below)"
        n = len({w.rsplit(" ", 1)[0] for _, w in got})
        lines.append(f"| {what} | {issue} | {need:.1f}x ({', '.join(kinds)}) | {n} | "
                     f"{low:.2f} ({where}) | {status} |")
    return lines + [""]


def _ms(r, key):
    v = r.get(key)
    if v is None:
        return "-"
    lo, hi = r.get(key.replace("_ms", "_p10_ms")), r.get(key.replace("_ms", "_p90_ms"))
    spread = f" ({lo * 1e3:.4g}-{hi * 1e3:.4g})" if lo is not None and hi is not None else ""
    return f"{v * 1e3:.4g}{spread}"


def _x(v):
    return "-" if v is None else f"{v:.2f}"


def markdown(results):
    c = results.get("ceilings", {})
    lines = [f"# Side by side with the peers, {results.get('device', '?')}, "
             f"{results.get('date', '?')}", "",
             "`python3 -m benchmarks.bench_peers`: cpsparse and the peer in one "
             "process on the same input bytes, outputs cross-checked. Times in us, median "
             "(p10-p90). *call*: the public op, eager, host time included; *kernel*: the same "
             "call replayed from a CUDA graph. speedup = peer / cpsparse (> 1: cpsparse is "
             "faster). Ceilings of the run: "
             + ", ".join(f"{k} = {v:.4g}" for k, v in c.items() if isinstance(v, (int, float)))
             + ".", ""]
    rows = results["rows"]
    lines += target_lines(rows)
    for prefix, title in GROUPS:
        group = [r for r in rows if r["workload"].startswith(prefix)]
        if not group:
            continue
        lines += [f"**{title}**", "",
                  "| workload | peer | cpsparse call | peer call | speedup | cpsparse kernel "
                  "| peer kernel | kernel speedup | max rel. err vs peer |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in group:
            err = r.get("max_rel_err_vs_peer")
            lines.append(
                f"| {r['workload']} | {r['peer']} | {_ms(r, 'cpsparse_ms')} | "
                f"{_ms(r, 'peer_ms')} | {_x(r.get('speedup'))} | "
                f"{_ms(r, 'cpsparse_kernel_ms')} | {_ms(r, 'peer_kernel_ms')} | "
                f"{_x(r.get('kernel_speedup'))} | {'-' if err is None else f'{err:.3g}'} |")
        lines.append("")
    return "\n".join(lines)


# The committed side-by-side runs the page shows, a section each: the H200's (the
# device the issues' targets name), then the H100's (the sessions no H200 was lent).
RESULTS = ("benchmarks/results/peers.json", "benchmarks/results/peers_h100.json")


def page(paths):
    """docs/performance_peers.md of the results at ``paths``: a section each."""
    return "\n".join(markdown(json.loads(pathlib.Path(p).read_text())) for p in paths)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out = ROOT / "docs" / "performance_peers.md"
    out.write_text(page(argv or [ROOT / p for p in RESULTS]))
    print(out)


if __name__ == "__main__":
    main()
