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
