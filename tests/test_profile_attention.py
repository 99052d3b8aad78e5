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
