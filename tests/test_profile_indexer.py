"""The ncu report reader of benchmarks/profile_indexer.py (CPU only): an excerpt of the
report of 2026-12-03 (H200), read back into the summary's columns."""

import pytest

from benchmarks import profile_indexer as P

REPORT = """\
==PROF== Profiling "cps_paged_mqa_logits_ws_h64n1": 0%....50%....100% - 18 passes
launched the ws decode kernels (fp8 and MXFP4, next_n 1 and 2)
  cps_paged_mqa_logits_ws_h64n1 (128, 1, 1)x(640, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    Elapsed Cycles                cycle      110,439
    Memory Throughput                 %        72.31
    DRAM Throughput                   %        72.31
    Duration                         us        82.46
    Compute (SM) Throughput           %        52.54
    ----------------------- ----------- ------------

    OPT   Memory is more heavily utilized than Compute: Look at the Memory Workload Analysis
          section to identify the DRAM bottleneck. 72.31
    Section: Memory Workload Analysis
    Memory Throughput                          Tbyte/s         3.48
    Section: Scheduler Statistics
    Issued Warp Per Scheduler                        0.57
    Eligible Warps Per Scheduler        warp         1.26
  cps_paged_mqa_logits_fp4_ws_h64n1 (128, 1, 1)x(640, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    DRAM Throughput                   %        30.40
    Duration                         us       103.33
    Issued Warp Per Scheduler                        0.68
"""


def test_parse_reads_each_kernel_and_unit():
    r = P.parse(REPORT)
    assert list(r) == ["cps_paged_mqa_logits_ws_h64n1", "cps_paged_mqa_logits_fp4_ws_h64n1"]
    fp8 = r["cps_paged_mqa_logits_ws_h64n1"]
    assert fp8[("Elapsed Cycles", "cycle")] == 110439          # thousands separators
    assert fp8[("Memory Throughput", "%")] == 72.31            # same name, two units
    assert fp8[("Memory Throughput", "Tbyte/s")] == 3.48
    assert fp8[("Issued Warp Per Scheduler", "")] == 0.57      # no unit
    assert r["cps_paged_mqa_logits_fp4_ws_h64n1"][("Duration", "us")] == 103.33
    # rule text ending in a number is not a metric of some other name
    assert not any(name.startswith("section to identify") for name, _ in fp8)


def test_summary_has_a_line_a_kernel_and_dashes_for_missing_metrics():
    lines = P.summary(P.parse(REPORT)).splitlines()
    assert lines[0].split()[0] == "kernel" and len(lines) == 3
    fp8 = lines[1].split()
    assert fp8[0] == "cps_paged_mqa_logits_ws_h64n1"
    assert fp8[1:6] == ["82.46", "72.31", "3.48", "52.54", "0.57"]
    fp4 = lines[2].split()
    assert fp4[1:3] == ["103.33", "30.4"] and fp4[3] == "-"


def test_parse_mode_refuses_a_report_without_kernels(tmp_path):
    f = tmp_path / "ncu.txt"
    f.write_text("==ERROR== the profiler could not connect\n")
    with pytest.raises(SystemExit, match="no kernel report"):
        P.main(["--parse", str(f)])
