"""The performance pages show what the committed results say (no hand-edited figures)."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_peers_page_is_generated_from_peers_json():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import peers_table
    finally:
        sys.path.pop(0)
    page = (ROOT / "docs" / "performance_peers.md").read_text()
    assert page == peers_table.page([ROOT / p for p in peers_table.RESULTS]), \
        "docs/performance_peers.md is stale: run python tools/peers_table.py"
    devices = [json.loads((ROOT / p).read_text())["device"] for p in peers_table.RESULTS]
    assert [ln for ln in page.splitlines() if ln.startswith("# ")] == \
        [f"# Side by side with the peers, {d}, " + json.loads((ROOT / p).read_text())["date"]
         for d, p in zip(devices, peers_table.RESULTS)]


def test_peers_page_targets_count_every_speedup_below_the_minimum():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import peers_table
    finally:
        sys.path.pop(0)

    def row(workload, call, kernel):
        return dict(workload=workload, speedup=call, kernel_speedup=kernel)
    rows = [row("mla_decode_B1", 1.2, 0.9), row("mla_decode_B8", 1.1, 1.0),
            row("mla_prefill_T4096", 1.3, 1.01), row("decode_step_B1", None, 2.0),
            row("indexer_decode_B64_ctx32768_n1_mxfp4", 1.7, 1.59)]
    lines = peers_table.target_lines(rows)
    by_issue = {int(ln.split(" | ")[1]): ln for ln in lines if ln.startswith("| ") and
                ln.split(" | ")[1].isdigit()}
    assert sorted(by_issue) == [14, 15, 20]       # no row of 16 or 18 with a figure: no line
    assert by_issue[14].endswith("| 2 | 0.90 (mla_decode_B1 kernel) | missed (1 of 4 below) |")
    assert by_issue[15].endswith("| 1 | 1.01 (mla_prefill_T4096 kernel) | met |")
    assert "1.6x (call, kernel)" in by_issue[20] and "missed (1 of 2 below)" in by_issue[20]


def test_scenarios_page_is_generated_from_the_committed_runs():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import scenario_tables
    finally:
        sys.path.pop(0)
    page = (ROOT / "docs" / "performance_scenarios.md").read_text()
    assert page == scenario_tables.page([ROOT / p for p in scenario_tables.RUNS]), \
        "docs/performance_scenarios.md is stale: run python tools/scenario_tables.py"


@pytest.mark.parametrize("name", ["peers.json", "peers_h100.json"])
def test_peers_json_has_the_design_schema(name):
    results = json.loads((ROOT / "benchmarks" / "results" / name).read_text())
    assert {"device", "date", "rows"} <= set(results)
    for r in results["rows"]:
        assert {"workload", "peer", "cpsparse_ms", "cpsparse_kernel_ms", "peer_ms", "speedup",
                "max_rel_err_vs_peer"} <= set(r), r["workload"]
        if r["peer_ms"] is not None:
            assert abs(r["speedup"] - r["peer_ms"] / r["cpsparse_ms"]) < 1e-9, r["workload"]
