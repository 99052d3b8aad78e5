"""The performance pages show what the committed results say (no hand-edited figures)."""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_peers_page_is_generated_from_peers_json():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import peers_table
    finally:
        sys.path.pop(0)
    results = json.loads((ROOT / "benchmarks" / "results" / "peers.json").read_text())
    page = (ROOT / "docs" / "performance_peers.md").read_text()
    assert page == peers_table.markdown(results), \
        "docs/performance_peers.md is stale: run python tools/peers_table.py"


def test_peers_json_has_the_design_schema():
    results = json.loads((ROOT / "benchmarks" / "results" / "peers.json").read_text())
    assert {"device", "date", "rows"} <= set(results)
    for r in results["rows"]:
        assert {"workload", "peer", "cpsparse_ms", "cpsparse_kernel_ms", "peer_ms", "speedup",
                "max_rel_err_vs_peer"} <= set(r), r["workload"]
        if r["peer_ms"] is not None:
            assert abs(r["speedup"] - r["peer_ms"] / r["cpsparse_ms"]) < 1e-9, r["workload"]
