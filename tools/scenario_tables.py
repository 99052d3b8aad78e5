"""Turn the JSON of ``python -m cpsparse.bench`` into docs/performance_scenarios.md.

Usage: python tools/scenario_tables.py [RUN.json ...]   (default: RUNS, newest first)

Several files (runs on different GPUs, or of different scenarios) give one section each,
in the order given: figures of different devices are never put in one table.
"""

import json
import pathlib
import sys

from cpsparse.bench import COLUMNS, _fmt

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The committed runs the page shows, newest first.
RUNS = ("benchmarks/results/bench_cupy_h100_1206_mtp.json",
        "benchmarks/results/bench_cupy_h100_1206.json", "benchmarks/results/bench_cupy_h100.json",
        "benchmarks/results/bench_cupy.json")

TITLES = {
    "short_prefill": "Short-prefill skip: indexer latency, gate enabled vs disabled",
    "mtp": "MTP draft round (3 steps): steps 1+ reusing step 0's top-k vs scoring again",
    "decode_step": "Decode step of one layer (V3.2 shapes), split by stage",
}


def markdown(results):
    c = results.get("ceilings", {})
    lines = [f"# Scenarios (`python -m cpsparse.bench`), {results.get('device', '?')}, "
             f"{results['date']}", "",
             "Peers/ceilings measured in the same run: "
             + ", ".join(f"{k} = {v:.4g}" for k, v in c.items()) + ".", ""]
    for name, rows in results["scenarios"].items():
        cols, title = COLUMNS[name], TITLES[name]
        if not all(any(k in r for r in rows) for k in cols):
            # a run of an older cpsparse.bench: its own columns, in its order
            cols = [k for k in rows[0] if k not in ("iters", "graph_note")]
            title += " (the columns of the cpsparse.bench of that date)"
        lines += [f"**{title}**", "", "| " + " | ".join(cols) + " |",
                  "| " + " | ".join("---" for _ in cols) + " |"]
        lines += ["| " + " | ".join(_fmt(r.get(k)) for k in cols) + " |" for r in rows]
        notes = sorted({r["graph_note"] for r in rows if r.get("graph_note")})
        lines += [""] + [f"CUDA graph: {n}" for n in notes] + ([""] if notes else [])
    return "\n".join(lines) + "\n"


def page(paths):
    """docs/performance_scenarios.md of the runs at ``paths``: a section each."""
    return "\n".join(markdown(json.loads(pathlib.Path(p).read_text())) for p in paths)


if __name__ == "__main__":
    out = ROOT / "docs" / "performance_scenarios.md"
    out.write_text(page(sys.argv[1:] or [ROOT / p for p in RUNS]))
    print(out)
