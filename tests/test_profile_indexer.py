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


@pytest.mark.parametrize("mode", ["--parse", "--source"])
def test_read_modes_refuse_a_report_without_kernels(tmp_path, mode):
    f = tmp_path / "ncu.txt"
    f.write_text("==ERROR== the profiler could not connect\n")
    with pytest.raises(SystemExit, match="no kernel report"):
        P.main([mode, str(f)])


def test_source_mode_prints_the_summary(tmp_path, capsys):
    f = tmp_path / "src.csv"
    f.write_text(SOURCE)
    assert P.main(["--source", str(f)]) == 0
    assert capsys.readouterr().out.startswith("cps_paged_mqa_logits_ws_h64n2: 425984 warp")


# ncu's source page (``--page source --csv --print-source sass``) of 2026-12-03, a few
# instructions of the two next_n 2 kernels and the columns the reader uses (the real
# export has ~70; it lists each kernel twice, which the reader takes once).
SOURCE = '''\
"Kernel Name","cps_paged_mqa_logits_ws_h64n2",""
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_barrier","stall_long_sb","stall_short_sb","stall_wait","stall_barrier (Not Issued)"
"0x7f08977f0050","      QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR12], RZ, !UPT","211","86","131072","0","0","0","21","0"
"0x7f08977f00d0","      WARPGROUP.DEPBAR.LE gsb0, 0x0","1046","337","131072","1023","0","0","12","333"
"0x7f08977f0a60","      FFMA.FTZ R99, R4, R101, R99","183","79","131072","0","0","171","4","0"
"0x7f08977f35a0","@!P0  BRA 0x7f08977f59e0","541","215","32768","0","538","0","0","0"
"Kernel Name","cps_paged_mqa_logits_fp4_ws_h64n2",""
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_barrier","stall_long_sb","stall_short_sb","stall_wait","stall_barrier (Not Issued)"
"0x7f0856e9c200","      PRMT R9, R8, 0x4442, RZ","142","32","131072","0","0","123","1","0"
"0x7f0856e9ce60","      WARPGROUP.DEPBAR.LE gsb0, 0x0","597","139","131072","585","0","0","4","137"
"0x7f0856ea0070","@!P0  BRA 0x7f0856ea1e80","1125","165","32768","0","1125","0","0","0"
"Kernel Name","cps_paged_mqa_logits_fp4_ws_h64n2",""
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_barrier","stall_long_sb","stall_short_sb","stall_wait","stall_barrier (Not Issued)"
"0x7f0856e9c200","      PRMT R9, R8, 0x4442, RZ","142","32","131072","0","0","123","1","0"
'''


def test_read_source_keeps_each_kernel_once_with_its_rows():
    r = P.read_source(SOURCE)
    assert list(r) == ["cps_paged_mqa_logits_ws_h64n2", "cps_paged_mqa_logits_fp4_ws_h64n2"]
    header, rows = r["cps_paged_mqa_logits_ws_h64n2"]
    assert header[:2] == ["Address", "Source"] and len(rows) == 4
    assert len(r["cps_paged_mqa_logits_fp4_ws_h64n2"][1]) == 1      # the last listing


def test_opcode_drops_predicate_and_modifiers():
    assert P._opcode("@!P0  BRA 0x7f08977f59e0") == "BRA"
    assert P._opcode("      WARPGROUP.DEPBAR.LE gsb0, 0x0") == "WARPGROUP"
    assert P._opcode("FFMA.FTZ R99, R4, R101, R99") == "FFMA"


def test_source_summary_shares_and_top_instructions():
    text = P.source_summary(P.read_source(SOURCE), top=2).splitlines()
    assert text[0] == "cps_paged_mqa_logits_ws_h64n2: 425984 warp instructions, 1981 samples"
    # executed shares: QGMMA, WARPGROUP, FFMA 131072 each (30.8%), BRA 32768 (7.7%)
    assert "BRA 7.7%" in text[1] and text[1].count("30.8%") == 3
    # stall reasons over all samples (not-issued columns left out): 1023 barrier of 1981
    assert text[2].startswith("  stalls: barrier 51.6%, long_sb 27.2%, short_sb 8.6%, wait 1.9%")
    assert "(Not Issued)" not in text[2]
    # the two most-sampled instructions, largest first, with their main reasons
    assert text[3].split()[:2] == ["f00d0", "1046"] and "barrier=1023" in text[3]
    assert text[4].split()[:2] == ["f35a0", "541"] and text[4].endswith("long_sb=538")
    assert text[5].startswith("cps_paged_mqa_logits_fp4_ws_h64n2: 131072 warp instructions")


def test_trace_stamps_hit_the_kernel_once_and_summarize_per_cta(monkeypatch):
    """The trace's substitutions each hit indexer.cu once (a stale anchor raises), and
    trace_summary reads stamps [cta][event] as medians after each CTA's entry over the
    CTAs that ran an item, with the entries' spread from the globaltimer."""
    import numpy as np

    from cpsparse import raw_kernels
    src = P.trace_source(raw_kernels.module_source("indexer"))
    assert src.count("cps_wsd_trace_at(") == len(P.TRACE_EVENTS) + 1     # + its definition
    for name in P.VARIANTS:                           # (trace --variant=NAME)
        src = P.trace_source(P.variant_source(raw_kernels.module_source("indexer"), name))
        assert src.count("cps_wsd_trace_at(") == len(P.TRACE_EVENTS) + 1, name
    monkeypatch.setattr(P, "TRACE", P.TRACE + [("no such text in indexer.cu", "")])
    with pytest.raises(ValueError, match="expected one occurrence"):
        P.trace_source(raw_kernels.module_source("indexer"))
    stamps = np.zeros((4, len(P.TRACE_EVENTS)), np.int64)
    stamps[0] = [1000, 1500, 2000, 2500, 3000, 5000, 5200, 5100, 1700, 1900, 1600, 1550]
    stamps[1] = [2000, 2600, 3000, 3600, 4000, 6000, 6400, 6100, 2700, 2900, 0, 0]  # guess missed
    stamps[2, [0, 1, 7]] = [10, 20, 30]               # an empty share: no item
    summary = P.trace_summary(stamps, np.array([7000, 9000, 8000, 0]), mhz=1000.0)
    assert summary["ctas"] == 3 and summary["ctas_with_items"] == 2
    assert summary["share_done_us"] == 0.55 and summary["math_first_item_us"] == 4.0
    assert summary["ids_stored_us"] == 0.7 and summary["q_issued_us"] == 0.9
    assert summary["guess_issued_us"] == 0.6          # over the CTAs that stamped it
    assert summary["guess_start_us"] == 0.55
    assert summary["entry_spread_us"] == 2.0


def test_variants_grow_the_launch_shared_memory_by_their_barriers_and_restore_it():
    from cpsparse import raw_kernels
    from cpsparse.raw_kernels import indexer as ki
    base = raw_kernels.module_source("indexer")
    before = dict(ki.WSD_SMEM)
    for name in P.VARIANTS:
        per_page = name.startswith("kfull_per_page")   # (3 more KFULL barriers a stage)
        extra = {fp4: 8 * 3 * per_page * (ki.WSD_FP4_STAGES if fp4 else ki.WS_STAGES)
                 for fp4 in (False, True)}
        assert {fp4: P.variant_smem_extra(name, fp4) for fp4 in (False, True)} == extra
        src = P.variant_source(base, name)
        assert f"#define CPS_IDX_WSD_SMEM_LAUNCH {before[False] + extra[False]}\n" in src
        assert f"#define CPS_IDX_WSD_FP4_SMEM_LAUNCH {before[True] + extra[True]}\n" in src
        assert ("OFF_PM = OFF_BAR + (4 + 5 * S) * 8" in src and "kfull_page" in src) == per_page
        with P.variant_in_force(name):
            assert raw_kernels.module_source("indexer") == src
            assert ki.WSD_SMEM == {fp4: before[fp4] + extra[fp4] for fp4 in (False, True)}
        assert ki.WSD_SMEM == before and raw_kernels.module_source("indexer") == base
    with P.variant_in_force("base"):
        assert raw_kernels.module_source("indexer") == base and ki.WSD_SMEM == before
    with P.variant_in_force("base", P.trace_source):      # (trace: the stamps alone)
        assert raw_kernels.module_source("indexer") == P.trace_source(base)
        assert ki.WSD_SMEM == before
    traced = P.trace_source(P.variant_source(base, "kfull_per_page"))
    with P.variant_in_force("kfull_per_page", P.trace_source):
        assert raw_kernels.module_source("indexer") == traced
    assert ki.WSD_SMEM == before and raw_kernels.module_source("indexer") == base
    # the early variant is the per-page one and more
    early = P.variant_source(base, "kfull_per_page_early")
    assert "m.t_hi = g_thi;" in early and "m.t_hi = g_thi;" not in P.variant_source(
        base, "kfull_per_page")


def test_ab_names_its_shapes_in_its_progress_and_summary_lines():
    assert P._shape_name((1, 32768, 1, True)) == "B=1 x 32768 next_n 1 MXFP4"
    assert P._shape_name((64, 32768, 2, False)) == "B=64 x 32768 next_n 2 fp8"
    assert len({P._shape_name(s) for s in P.AB_SHAPES}) == len(P.AB_SHAPES)


def test_math_parked_variant_pairs_its_named_barrier():
    # 512 math threads sync and 128 producer threads arrive once: the count of both is
    # the CTA's, and no other code of the module uses barrier 2.
    from cpsparse import raw_kernels
    base = raw_kernels.module_source("indexer")
    assert "bar.sync 2" not in base and "bar.arrive 2" not in base
    src = P.variant_source(base, "math_parked")
    assert src.count("bar.sync 2, %0") == 1 and src.count("bar.arrive 2, %0") == 1
    assert src.count('::"n"(CPS_IDX_WS_THREADS) : "memory");') == 2


def test_ab_refuses_unknown_or_missing_variants():
    with pytest.raises(SystemExit, match="unknown: nope"):
        P.main(["ab", "kfull_per_page", "nope"])
    with pytest.raises(SystemExit, match="usage"):
        P.main(["ab"])
    with pytest.raises(SystemExit, match="unknown variant nope"):
        P.main(["trace", "1", "32768", "1", "--variant=nope"])
    with pytest.raises(SystemExit, match="fusion \\[--rounds=N\\]"):
        P.main(["fusion", "--round=2"])


def test_no_logits_store_variant_guards_every_logit_store_of_the_ws_decode_math():
    # fusion's bound: both stores of the ws decode epilogue stay in the source (the logits
    # are still computed) behind the one NaN-payload test, and nothing else changes.
    from cpsparse import raw_kernels
    base = raw_kernels.module_source("indexer")
    src = P.variant_source(base, "no_logits_store")
    assert src.count("__float_as_uint(v) == 0x7fc0beefu") == 2
    assert "0x7fc0beef" not in base
    assert src.count("rowp[r][t0] = v;") == base.count("rowp[r][t0] = v;")
    assert src.replace(" && __float_as_uint(v) == 0x7fc0beefu", "") == base
    # (its shapes: fp8 decode rows the A/B times too)
    assert set(P.FUSION_SHAPES) <= {(b, c, n) for b, c, n, fp4 in P.AB_SHAPES if not fp4}
