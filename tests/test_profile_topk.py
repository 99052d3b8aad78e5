"""The top-k profile's stamps still hit the kernel source, and its summary reads
the phases right (CPU only; the traced source compiles where NVRTC is installed)."""

import numpy as np
import pytest

from benchmarks import profile_topk as P
from cpsparse import raw_kernels


def test_every_stamp_lands_once():
    base = raw_kernels.module_source("topk")
    src = P.traced_source(base)
    for event in range(len(P.EVENTS)):
        assert f"{P._STAMP}({event});" in src, P.EVENTS[event]
    # done is stamped on each of the three ways out of the long-row path
    assert src.count(f"{P._STAMP}(6);") == 3
    # the stamps inside select (R0's suffix, its cluster barrier) land in select, after
    # the suffix sums and between the cluster barrier and tk_find_cluster
    body = src[src.index("auto select = [&](int hb"):src.index("auto emit_above")]
    suffix = body.index(f"{P._STAMP}({P.EVENTS.index('r0_suffix')});")
    cluster = body.index(f"{P._STAMP}({P.EVENTS.index('r0_cluster')});")
    assert body.index("tk_round_suffix") < suffix < body.index("tk_cluster_sync<C>();") \
        < cluster < body.index("tk_find_cluster")
    # and the window's after its barrier, before the short-row exit
    window = src.index(f"{P._STAMP}({P.EVENTS.index('window')});")
    assert src.index("s.shift = bs_shift;") < window < src.index("// short row: 0..n-1")


def test_a_stale_anchor_is_an_error(monkeypatch):
    monkeypatch.setattr(P, "TRACE", P.TRACE + [("no such text in topk.cu", "")])
    with pytest.raises(ValueError, match="expected one occurrence"):
        P.traced_source(raw_kernels.module_source("topk"))


def test_summary_reads_each_phase_over_long_rows_only():
    """3 CTAs at 1000 MHz (1 cycle = 1 ns): two long rows (one through the fallback),
    one short row (only its start stamped: left out)."""
    s = np.zeros((5, len(P.EVENTS)), np.int64)
    s[0, :7] = [100, 1100, 5100, 5600, 8600, 0, 9600]        # us: 1, 4, .5, 3, 1
    s[1, :7] = [200, 1200, 7200, 7700, 10700, 10800, 13700]  # 1, 6, .5, 3, 3 (fallback)
    s[2, 0] = 300
    got = P.summarize(s, 1000.0)
    assert got["ctas"] == 2 and got["fallback_ctas"] == 1
    assert got["adapt"]["median_us"] == pytest.approx(1.0)
    assert got["r0_histogram"]["median_us"] == pytest.approx(5.0)
    assert got["r0_select"]["median_us"] == pytest.approx(0.5)
    assert got["filter"]["median_us"] == pytest.approx(3.0)
    assert got["finish"]["median_us"] == pytest.approx(2.0)
    assert got["total"]["median_us"] == pytest.approx(11.5)           # 9.5 and 13.5
    assert got["total"]["p90_us"] == pytest.approx(9.5 + 0.9 * 4)


def test_summary_splits_adapt_and_r0_select():
    """The finer stamps split adapt (window, stats, transform) and r0_select (suffix,
    cluster barrier, tk_find_cluster); the ones stamped inside select are read only on
    CTAs without the fallback stamp, and a phase whose stamp a variant never reaches (the
    cluster barrier with one CTA a row) reads None."""
    ix = {e: i for i, e in enumerate(P.EVENTS)}
    s = np.zeros((3, len(P.EVENTS)), np.int64)
    for r, fallback in ((0, 0), (1, 9000)):
        s[r, :7] = [100, 1100, 5100, 5600, 8600, fallback, 9600]
        s[r, ix["window"]], s[r, ix["stats"]] = 400, 900            # .3, .5, .2
        s[r, ix["r0_suffix"]], s[r, ix["r0_cluster"]] = 5200, 5400  # .1, .2, .2
    s[1, ix["r0_suffix"]] = 9100                  # overwritten by a fallback round
    got = P.summarize(s, 1000.0)
    assert got["window"]["median_us"] == pytest.approx(0.3)
    assert got["stats"]["median_us"] == pytest.approx(0.5)
    assert got["transform"]["median_us"] == pytest.approx(0.2)
    assert got["suffix"]["max_us"] == pytest.approx(0.1)           # row 1 left out
    assert got["cluster_sync"]["median_us"] == pytest.approx(0.2)
    assert got["find_cluster"]["median_us"] == pytest.approx(0.2)
    assert got["decide"]["median_us"] == pytest.approx(0.4)
    s[:, ix["r0_cluster"]] = 0                    # one CTA a row: no cluster barrier
    got = P.summarize(s, 1000.0)
    assert got["cluster_sync"] is None and got["find_cluster"] is None
    assert got["decide"]["median_us"] == pytest.approx(0.4)


def test_traced_source_compiles(monkeypatch):
    """The stamps' registers push the tightest variants over 64 a thread: a few bytes of
    spills are allowed in this diagnostic (the profile's numbers are then a little high)."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs the [nvrtc] extra")
    from tests.test_kernel_compile import compile_module, kernel_reports
    src = P.traced_source(raw_kernels.module_source("topk"))
    original = raw_kernels.module_source
    monkeypatch.setattr(raw_kernels, "module_source",
                        lambda name: src if name == "topk" else original(name))
    ok, log = compile_module("topk")
    assert ok, log
    reports = kernel_reports(log)
    assert reports and all(r[1] + r[2] <= 128 for r in reports.values()), reports


def test_summary_span_from_the_global_timer():
    """The kernel's span runs from the first CTA's start to the last one's end, over
    every CTA that started (short rows too: they end before 'done' is stamped)."""
    e = len(P.EVENTS)
    s = np.zeros((3, e + len(P.GLOBAL_EVENTS)), np.int64)
    s[0, :7] = [100, 1100, 5100, 5600, 8600, 0, 9600]
    s[0, e:] = [50_000, 60_000]                   # ns
    s[1, :7] = [100, 1100, 5100, 5600, 8600, 0, 9600]
    s[1, e:] = [52_000, 90_000]
    s[2, 0], s[2, e] = 300, 51_000                # a short row: started, no 'done'
    got = P.summarize(s, 1000.0)
    assert got["span_us"] == pytest.approx(40.0)
    assert got["last_start_us"] == pytest.approx(2.0)
    assert got["ctas"] == 2


def test_logits_mode_arguments():
    assert P.parse_mode_args([]) == (None, 2)
    assert P.parse_mode_args(["--base=old.cu", "--rounds=3"]) == ("old.cu", 3)
    with pytest.raises(SystemExit, match="unknown argument"):
        P.parse_mode_args(["--bogus"])
    with pytest.raises(SystemExit, match="at least 1"):
        P.parse_mode_args(["--rounds=0"])
    with pytest.raises(SystemExit, match="unknown arguments"):
        P.main(["--rounds=2"])                  # only the logits and widths modes take them


def test_base_source_swaps_only_topk_cu(tmp_path):
    own = raw_kernels.module_source("topk")
    old = tmp_path / "topk.cu"
    old.write_text("// an older topk.cu\n")
    got = P.base_source(old)
    assert "// an older topk.cu\n" in got and got != own
    assert "tk_bucket_rank" in own and "tk_bucket_rank" not in got
    assert got.startswith(own[:200])                 # the headers before it stay


def test_widths_mode_arguments():
    with pytest.raises(SystemExit, match="unknown argument"):
        P.main(["widths", "--bogus"])


def test_ctas_per_sm_arithmetic():
    """228 KB an SM, 1 KB reserved a CTA, at most 5 (r256's registers)."""
    assert P.ctas_per_sm(0, 0) == 5
    assert P.ctas_per_sm(9680 - 1024, 233472 // 4 - 9680) == 4
    assert P.ctas_per_sm(9680 - 1024, 233472 // 4 - 9680 + 1) == 3


def test_widths_straddle_r256_occupancy_steps():
    """The widths mode's rows sit on both sides of the steps that 2,112 bytes less static
    shared memory in r256 moves (its rank counts moved into the row buffer, the change the
    mode measured): r256's static shared memory as ptxas reports it, and that less 2,112.
    Some width must keep its CTAs an SM, and each step must have a width that gains one."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="needs the [nvrtc] extra")
    import re

    from cpsparse.raw_kernels import topk as ktopk
    from tests.test_kernel_compile import _build
    ok, log, _, _ = _build("topk", "sm_90a", None)
    assert ok, log
    got = re.search(r"entry function 'cps_topk_r256'.*?(\d+) bytes smem", log, re.S)
    static = int(got.group(1))
    threads = ktopk.VARIANTS["r256"][1]             # the rank counts: cnt, at, red
    counts = 4 * (2 * threads + 2 * (threads // 32))
    assert counts == 2112
    gains = {}
    for width in P.WIDTHS:
        dyn = ktopk.row_buffer_bytes(width)
        old, new = P.ctas_per_sm(static, dyn), P.ctas_per_sm(static - counts, dyn)
        assert new >= old
        gains[width] = (old, new)
    assert any(o == n for o, n in gains.values()), gains
    assert {(o, n) for o, n in gains.values() if n > o} == {(4, 5), (3, 4)}, gains
