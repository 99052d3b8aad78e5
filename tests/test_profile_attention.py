"""The attention profile's substitutions still hit the kernel source (CPU only)."""

import pytest

from benchmarks import profile_attention as P
from cpsparse import raw_kernels


TABLES = {"decode": P.VARIANTS, "model1": P.MODEL1_VARIANTS, "prefill": P.PREFILL_VARIANTS}


@pytest.mark.parametrize("table,name", [(t, n) for t in TABLES for n in sorted(TABLES[t])])
def test_variant_changes_the_source_where_it_says(table, name):
    base = raw_kernels.module_source("attention")
    src = P.variant_source(base, name, TABLES[table])
    assert (src == base) == (name == "base")
    for old, new in TABLES[table][name]:
        assert new in src


def test_a_stale_substitution_is_an_error(monkeypatch):
    monkeypatch.setitem(P.VARIANTS, "stale", [("no such text in attention.cu", "")])
    with pytest.raises(ValueError, match="expected one occurrence"):
        P.variant_source(raw_kernels.module_source("attention"), "stale")


def test_trace_substitutions_apply_once_each():
    base = raw_kernels.module_source("attention")
    src = P.variant_source(base, "trace")
    assert src.count("att_trace_at(") == 1 + len(P.TRACE_STAMPED)    # definition + stamps
    for event in P.TRACE_STAMPED:
        assert f"att_trace_at({event}," in src


def test_trace_summary_reads_each_side_and_wait():
    """Synthetic stamps of 2 CTAs x 3 tiles: producer 100 cycles of work after a
    10-cycle EMPTY wait, math 50 cycles a tile starting 5 cycles after FULL."""
    import numpy as np
    stamps = np.zeros((2, 5, 4), np.int64)             # tile 3 never reached: ignored
    for c in range(2):
        for i in range(3):
            top = 1000 + 200 * i + c
            stamps[c, :, i] = [top, top + 10, top + 110, top + 115, top + 165]
    got = P.trace_summary(stamps)
    assert got["tiles"] == 6
    assert got["producer_empty_wait"] == 10 and got["producer_work"] == 100
    assert got["producer_tile"] == 110 and got["math_tile"] == 50
    assert got["handover"] == 5
    assert got["math_full_wait"] == 200 - 50               # from tile i-1's end to FULL i
    stamps[:, :3] = 0                                      # the math side's stamps alone
    got = P.trace_summary(stamps)
    assert got["tiles"] == 6 and got["math_tile"] == 50 and got["math_full_wait"] == 150
    assert got["producer_tile"] is None and got["handover"] is None


def test_timeline_substitutions_apply_once_each():
    base = raw_kernels.module_source("attention")
    src = P.variant_source(base, "timeline")
    # the definition, the stamps of the body, and the start stamp of the fp8 kernel and
    # of its two 16-bit-out twins (timeline bfloat16 / float16)
    assert src.count("att_timeline_at(") == 1 + len(P.TIMELINE_EVENTS) + 2
    for event in range(len(P.TIMELINE_EVENTS)):
        assert f"att_timeline_at({event})" in src
    assert src.count("att_timeline[blockIdx.x][5] = sm;") == 3
    for name in ("cps_sparse_mla_fp8", "cps_sparse_mla_fp8_out_bf16",
                 "cps_sparse_mla_fp8_out_f16"):
        entry = src[src.index(name + "(ATT_PARAMS) {"):]
        assert entry.index("att_timeline_at(0)") < entry.index("att_fp8_kernel<"), name


def test_timeline_summary_phases_and_gaps():
    """Synthetic stamps (ns) of 4 CTAs on 2 SMs, two a SM one after the other: Q 8 us,
    first tile 0.5 us after it, 80 us of tiles, 4 us of rows; the next CTA on the SM
    starts 0.3 us after the rows; a CTA with an event missing is left out."""
    import numpy as np
    stamps = np.zeros((5, 6), np.int64)
    for c in range(4):
        t0 = 1_000_000 + (c // 2) * 92_800 + (c % 2) * 1_000
        stamps[c, :5] = [t0, t0 + 8_000, t0 + 8_500, t0 + 88_500, t0 + 92_500]
        stamps[c, 5] = c % 2
    stamps[4, :3] = [5, 6, 7]                             # never finished: ignored
    got = P.timeline_summary(stamps)
    assert got["ctas"] == 4
    assert got["q_load_us"] == 8.0 and got["first_tile_wait_us"] == 0.5
    assert got["tiles_us"] == 80.0 and got["rows_write_us"] == 4.0 and got["cta_us"] == 92.5
    assert abs(got["next_cta_gap_us"] - 0.3) < 1e-9
    assert got["span_us"] == (1_000_000 + 92_800 + 1_000 + 92_500 - 1_000_000) / 1e3
    assert P.timeline_summary(np.zeros((2, 6), np.int64)) == {"ctas": 0}
