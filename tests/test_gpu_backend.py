"""CuPy inputs stay on the device and agree with the NumPy reference.

These run wherever CuPy sees a CUDA device (``-m gpu``) and skip elsewhere.
Outputs are compared with the same op on the host copies of the inputs.
"""

import numpy as np
import pytest

import cpsparse

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    import cupy
    return cupy


def _host(a):
    return a.get() if hasattr(a, "get") else a


def _rel_err(got, want):
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got)), "-inf masks differ"
    num = np.linalg.norm((got - want)[finite])
    return num / max(np.linalg.norm(want[finite]), 1e-30)


def test_quantize_bit_exact(cp):
    x = np.random.default_rng(1).standard_normal((33, 256)).astype(np.float32) * 3
    for fmt in ("ue8m0", None):
        c_d, s_d = cpsparse.quantize_fp8(cp.asarray(x), scale_fmt=fmt)
        c_h, s_h = cpsparse.quantize_fp8(x, scale_fmt=fmt)
        assert isinstance(c_d, cp.ndarray)
        assert np.array_equal(c_d.get(), c_h) and np.array_equal(s_d.get(), s_h)


def test_indexer_logits_and_topk(cp):
    rng = np.random.default_rng(2)
    m, n, h = 40, 300, 32
    q8, qs = cpsparse.quantize_fp8(rng.standard_normal((m, h, 128)).astype(np.float32),
                                   eps=1e-10)
    k8, kscale = cpsparse.quantize_fp8(rng.standard_normal((n, 128)).astype(np.float32))
    w = cpsparse.fold_weights(rng.standard_normal((m, h)).astype(np.float32), qs)
    ks = np.sort(rng.integers(0, n, m)).astype(np.int32)
    ke = np.minimum(ks + rng.integers(0, 200, m), n).astype(np.int32)
    args = (q8, k8, kscale[:, 0].copy(), w, ks, ke)
    want = cpsparse.mqa_logits(*args)
    got = cpsparse.mqa_logits(*[cp.asarray(a) for a in args])
    assert isinstance(got, cp.ndarray) and _rel_err(got.get(), want) <= 1e-3
    top_d = cpsparse.topk_per_row(got, cp.asarray(ks), cp.asarray(ke), 64)
    top_h = cpsparse.topk_per_row(want, ks, ke, 64)
    assert np.array_equal(np.sort(top_d.get(), 1), np.sort(top_h, 1))


def test_paged_logits(cp):
    rng = np.random.default_rng(3)
    lens = np.array([1, 64, 65, 200], np.int32)
    table = rng.permutation(16).astype(np.int32).reshape(4, 4)
    cache = cpsparse.IndexerKCache(16)
    slots = np.concatenate([table[b, np.arange(n) // 64] * 64 + np.arange(n) % 64
                            for b, n in enumerate(lens)]).astype(np.int32)
    cache.insert(rng.standard_normal((slots.size, 128)).astype(np.float32), slots)
    q8, _ = cpsparse.quantize_fp8(rng.standard_normal((4, 2, 8, 128)).astype(np.float32))
    w = rng.standard_normal((8, 8)).astype(np.float32)
    want = cpsparse.paged_mqa_logits(q8, cache, w, lens, table, 256)
    dcache = cpsparse.IndexerKCache.wrap(cp.asarray(cache.data))
    got = cpsparse.paged_mqa_logits(cp.asarray(q8), dcache, cp.asarray(w), cp.asarray(lens),
                                    cp.asarray(table), 256)
    assert _rel_err(got.get(), want) <= 1e-3


def test_sparse_attention(cp):
    rng = np.random.default_rng(4)
    cache = cpsparse.MLAKVCache(4, xp="numpy")
    cache.insert(rng.standard_normal((256, 512)).astype(np.float32),
                 rng.standard_normal((256, 64)).astype(np.float32),
                 np.arange(256, dtype=np.int32))
    q = rng.standard_normal((5, 16, 576)).astype(np.float32)
    idx = rng.integers(-1, 256, (5, 64)).astype(np.int32)
    out_h, lse_h = cpsparse.sparse_mla_attention(q, cache, idx, 0.07)
    out_d, lse_d = cpsparse.sparse_mla_attention(
        cp.asarray(q), cpsparse.MLAKVCache.wrap(cp.asarray(cache.data)), cp.asarray(idx), 0.07)
    assert np.linalg.norm(out_d.get() - out_h) <= 1e-2 * np.linalg.norm(out_h)
    # The kernel multiplies bf16 operands: on arbitrary float32 inputs (not bf16-exact)
    # lse moves by a few 1e-3; the 1e-3 bound on bf16-exact data is tested in
    # tests/test_gpu_attention.py.
    assert np.abs(lse_d.get() - lse_h).max() <= 1e-2
