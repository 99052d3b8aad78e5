"""GPU: quantize / indexer cache insert / gather kernels, bit-exact with the reference."""

import numpy as np
import pytest

import cpsparse

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    import cupy
    return cupy


@pytest.mark.parametrize("block_size", [32, 64, 128, 256])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_quantize_kernel_bit_exact(cp, block_size, scale_fmt):
    rng = np.random.default_rng(block_size)
    x = rng.standard_normal((37, 3, 512)).astype(np.float32)
    x *= np.exp(rng.uniform(-12, 12, (37, 3, 1))).astype(np.float32)   # wide range
    x[0, 0, :block_size] = 0.0                                          # eps floor
    x[1, 0, :4] = [np.nan, 1e-45, -3e-40, 7.0]                          # NaN, subnormals
    codes_h, scales_h = cpsparse.quantize_fp8(x, block_size, scale_fmt, eps=1e-10)
    codes_d = cp.full(x.shape, 0xAB, cp.uint8)                          # poison
    codes_d, scales_d = cpsparse.quantize_fp8(cp.asarray(x), block_size, scale_fmt, eps=1e-10)
    assert np.array_equal(scales_d.get().view(np.uint32), scales_h.view(np.uint32))  # NaN-safe
    assert np.array_equal(codes_d.get(), codes_h)


def _ragged_pages(rng, lens, num_blocks, block_size):
    need = [-(-n // block_size) for n in lens]
    perm = rng.permutation(num_blocks)[:sum(need)]
    table = np.zeros((len(lens), max(need)), np.int32)
    off = 0
    for r, k in enumerate(need):
        table[r, :k] = perm[off:off + k]
        off += k
    return table


@pytest.mark.parametrize("lens", [[1, 63, 64, 65], [200, 1, 129], [3000]])
def test_insert_and_gather_kernels(cp, lens):
    rng = np.random.default_rng(len(lens))
    bs, d = 64, 128
    num_blocks = sum(-(-n // bs) for n in lens) + 5
    table = _ragged_pages(rng, lens, num_blocks, bs)
    slots = np.concatenate([table[r, np.arange(n) // bs] * bs + np.arange(n) % bs
                            for r, n in enumerate(lens)]).astype(np.int32)
    slots[::7] = -1                                   # padding tokens are skipped
    k = (rng.standard_normal((slots.size, d)) * 3).astype(np.float32)
    host = cpsparse.IndexerKCache(num_blocks, bs, d)
    host.data[:] = rng.integers(0, 256, host.data.shape, dtype=np.uint8)
    dev = cpsparse.IndexerKCache.wrap(cp.asarray(host.data))
    host.insert(k, slots)
    dev.insert(cp.asarray(k), cp.asarray(slots))
    assert np.array_equal(dev.data.get(), host.data)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    codes_h, scales_h = host.gather(table, cu)
    codes_d, scales_d = dev.gather(cp.asarray(table), cp.asarray(cu))
    assert np.array_equal(codes_d.get(), codes_h)
    assert np.array_equal(scales_d.get().view(np.uint32), scales_h.view(np.uint32))  # NaN-safe


@pytest.mark.parametrize("form", ["float32", "float16", "projection_slices"])
def test_mla_insert_kernel_bit_exact(cp, form):
    """MLAKVCache.insert on CuPy (one kernel, cps_mla_quant_and_cache) writes the
    reference's fp8_ds_mla records byte for byte and leaves every other byte as it was:
    latents over 20 orders of magnitude, an all-zero group (the scale floor), NaN, +-inf,
    subnormal and overflowing values in both parts, slot -1 skipped; float16 inputs (read
    as float32 first) and the kv_c / k_pe slices of one [N, 576] projection output (row
    stride 576, read in place). An infinite value over an infinite scale (inf / inf) is a
    NaN code whose sign is the division's (x86: negative, the GPU: positive): both are
    e4m3fn's NaN, compared as one; so are the bf16 NaNs of float16 RoPE values (a NaN's
    payload through the float32 conversion is the platform's). Then insert_core (no
    checks, the layer's path) with slots past the cache, which are skipped too."""
    rng = np.random.default_rng(len(form))
    n, num_blocks, bs = 300, 8, 64
    x = rng.standard_normal((n, 576)).astype(np.float32)
    x *= np.exp(rng.uniform(-23, 23, (n, 1))).astype(np.float32)
    x[0, :128] = 0.0
    x[1, :6] = [np.nan, np.inf, -np.inf, 1e-45, -3e-40, 1e30]
    x[2, 512:516] = [np.nan, -np.inf, 1e-40, 3.4e38]
    if form == "float16":
        x = x.astype(np.float16)
    slots = rng.permutation(num_blocks * bs)[:n].astype(np.int32)
    slots[::9] = -1
    host = cpsparse.MLAKVCache(num_blocks, bs)
    host.data[:] = rng.integers(0, 256, host.data.shape, dtype=np.uint8)
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
    xd = cp.asarray(x)
    def nan_as_one(data):                  # every NaN code and NaN bf16 of the records
        d = data.reshape(-1, 656).copy()
        codes = d[:, :512]
        codes[(codes & 0x7F) == 0x7F] = 0x7F
        rope = d[:, 528:].view(np.uint16)
        rope[(rope & 0x7FFF) > 0x7F80] = 0x7FC0
        return d

    host.insert(np.ascontiguousarray(x[:, :512]), np.ascontiguousarray(x[:, 512:]), slots)
    if form == "projection_slices":       # the layer's own path (insert takes C-contiguous)
        dev.insert_core(xd[:, :512], xd[:, 512:], cp.asarray(slots))
    else:
        dev.insert(cp.ascontiguousarray(xd[:, :512]), cp.ascontiguousarray(xd[:, 512:]),
                   cp.asarray(slots))
    assert np.array_equal(nan_as_one(dev.data.get()), nan_as_one(host.data))
    if form != "float16":                 # (float16 overflows many values to inf)
        assert (dev.data.get() != host.data).sum() == 2   # x[1, 1:3]: +-inf / inf
    bad = np.array([host.num_slots, 2**31 - 1, -5, 3], np.int32)
    y = (rng.standard_normal((4, 576)) * 5).astype(np.float32)
    host.insert_core(y[:, :512], y[:, 512:], bad)
    dev.insert_core(cp.asarray(y[:, :512]), cp.asarray(y[:, 512:]), cp.asarray(bad))
    assert np.array_equal(nan_as_one(dev.data.get()), nan_as_one(host.data))


def test_bfloat16_inputs_quantize_and_insert_as_float32(cp):
    """CuPy bfloat16 arrays (CuPy >= 14, ml_dtypes' dtype) into quantize_fp8, the indexer
    key insert and the MLA insert give the bytes of the same values in float32 (the
    NumPy reference of the bfloat16 arrays too): converted, never read as float32."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ml_dtypes.bfloat16
    try:
        cp.empty(1, dtype=bf16)
    except Exception as e:                       # noqa: BLE001 - any refusal means "no"
        pytest.skip(f"CuPy {cp.__version__} has no bfloat16 arrays: {e}")
    rng = np.random.default_rng(33)
    x = (rng.standard_normal((9, 512)) * 3).astype(bf16)          # bf16 values
    x32 = x.astype(np.float32)
    want = cpsparse.quantize_fp8(x32, 128)
    for got in (cpsparse.quantize_fp8(cp.asarray(x), 128), cpsparse.quantize_fp8(x, 128)):
        for g, w in zip(got, want):
            g = g.get() if hasattr(g, "get") else g
            assert np.array_equal(g.view(np.uint8), w.view(np.uint8))
    slots = rng.permutation(64)[:9].astype(np.int32)
    slots[4] = -1
    caches = []
    for k in (cp.asarray(x[:, :128].copy()), cp.asarray(x32[:, :128].copy())):
        cache = cpsparse.IndexerKCache.wrap(cp.zeros((2, 64 * 132), cp.uint8))
        cache.insert(k, cp.asarray(slots))
        caches.append(cache.data.get())
    assert np.array_equal(*caches)
    records = []
    for kv in (cp.asarray(x), cp.asarray(x32)):
        cache = cpsparse.MLAKVCache.wrap(cp.zeros((2, 32, 656), cp.uint8))
        cache.insert(kv, cp.ascontiguousarray(kv[:, :64]), cp.asarray(slots))
        records.append(cache.data.get())
    assert np.array_equal(*records)
