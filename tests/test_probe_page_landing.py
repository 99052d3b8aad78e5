"""benchmarks.probe_page_landing without a GPU: the tensor map it asks libcuda for stays
inside cuTensorMapEncodeTiled's limits, and its summary reads the stamps right. (Its
kernel's compile: tests/test_kernel_compile.py.)"""

import numpy as np
import pytest

from benchmarks import probe_page_landing as probe


def test_tensor_map_fits_the_encoders_limits_and_spans_one_page():
    dims, strides, box, estr = probe.tensor_map_args(probe.PAGES)
    # byte strides of dims 1.. multiples of 16; box dims within 1..256; the box's inner
    # extent no wider than the 128-byte swizzle span; every element taken
    assert all(s % 16 == 0 for s in strides), strides
    assert all(1 <= b <= 256 for b in box), box
    assert box[0] * 1 <= 128 and box[0] == dims[0], box
    assert estr == (1, 1, 1)
    # a box is one page's codes, pages PAGE_BYTES apart: the scales are not in the map
    assert box[0] * box[1] == probe.KEYS * probe.D
    assert strides == (probe.D, probe.PAGE_BYTES) and dims[2] == probe.PAGES
    assert probe.PAGE_BYTES == probe.KEYS * (probe.D + 4)


def test_summary_takes_medians_over_launches_then_ctas():
    mhz = 1000.0
    # 3 launches x 4 CTAs x (pages 0-3, issued): CTA c's page p at 100 (p + 1) + 10 c
    # cycles, launch 1 an outlier the median over launches drops
    base = np.array([[100 * (p + 1) + 10 * c for p in range(4)] + [50] for c in range(4)],
                    dtype=np.int64)
    stamps = [base, base + 10000, base]
    got = probe.summarize(stamps, mhz)
    assert got["page_us"] == [0.115, 0.215, 0.315, 0.415], got
    assert got["issued_us"] == 0.05
    assert got["page0_to_page3_us"] == 0.3


def test_encode_refuses_loudly_or_gives_128_bytes():
    try:
        import ctypes
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("no libcuda on this machine (no driver)")
    try:
        tmap = probe.encode_tensor_map(1 << 20, probe.PAGES)
    except RuntimeError as e:            # a driver that refuses the fake address says so
        assert "CUresult" in str(e)
    else:
        assert len(tmap) == 128


def test_encode_asks_the_driver_for_the_pages_map(monkeypatch):
    """The probe's map goes through cpsparse's encoder with the probe's page stride (not
    the contiguous one), the 128-byte swizzle and every element (CPU: the driver faked)."""
    from cpsparse import raw_kernels
    calls = []

    def encode(at, dtype, rank, ptr, dims, strides, box, estr, inter, swizzle, l2, oob):
        calls.append((dtype, rank, ptr, tuple(dims[:rank]), tuple(strides[:rank - 1]),
                      tuple(box[:rank]), tuple(estr[:rank]), swizzle))
        return 0
    monkeypatch.setattr(raw_kernels, "_driver_fn", lambda name: encode)
    assert len(probe.encode_tensor_map(1 << 20, probe.PAGES)) == 128
    dims, strides, box, estr = probe.tensor_map_args(probe.PAGES)
    assert calls == [(raw_kernels.TMAP_UINT8, 3, 1 << 20, dims, strides, box, estr,
                      raw_kernels.TMAP_SWIZZLE_128B)]
