"""Every CUDA kernel once on small shapes, checked against the reference.

Small on purpose: tools/sanitize.sh runs this file under compute-sanitizer
(memcheck, racecheck, initcheck, synccheck)."""

import numpy as np
import pytest

import cpsparse

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    import cupy
    return cupy


def test_every_kernel_once(cp):
    rng = np.random.default_rng(0)
    d = lambda a: cp.asarray(a)  # noqa: E731
    # quantize + indexer cache insert/gather
    x = rng.standard_normal((5, 256)).astype(np.float32)
    c, s = cpsparse.quantize_fp8(d(x))
    wc, ws = cpsparse.quantize_fp8(x)
    assert np.array_equal(c.get(), wc) and np.array_equal(s.get(), ws)
    lens = np.array([65, 3], np.int32)
    table = np.array([[2, 0], [1, 3]], np.int32)
    slots = np.concatenate([table[r, np.arange(n) // 64] * 64 + np.arange(n) % 64
                            for r, n in enumerate(lens)]).astype(np.int32)
    keys = rng.standard_normal((slots.size, 128)).astype(np.float32)
    hcache = cpsparse.IndexerKCache(4)
    hcache.insert(keys, slots)
    dcache = cpsparse.IndexerKCache(4, xp=cp)
    dcache.insert(d(keys), d(slots))
    cu = np.array([0, 65, 68], np.int32)
    kc, ksc = dcache.gather(d(table), d(cu))
    hk, hs = hcache.gather(table, cu)
    assert np.array_equal(kc.get(), hk) and np.array_equal(ksc.get(), hs)
    # prefill scoring + top-k
    q8, qs = cpsparse.quantize_fp8(rng.standard_normal((6, 8, 128)).astype(np.float32),
                                   eps=1e-10)
    w = cpsparse.fold_weights(rng.standard_normal((6, 8)).astype(np.float32), qs)
    ks = np.array([0, 0, 0, 65, 65, 65], np.int32)
    ke = np.array([63, 64, 65, 66, 67, 68], np.int32)
    got = cpsparse.mqa_logits(d(q8), kc, ksc, d(w), d(ks), d(ke)).get()
    want = cpsparse.mqa_logits(q8, hk, hs, w, ks, ke)
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got))
    assert np.linalg.norm(got[fin] - want[fin]) <= 1e-3 * np.linalg.norm(want[fin])
    top = cpsparse.topk_per_row(d(want), d(ks), d(ke), 16).get()
    assert (np.sort(top, 1) == np.sort(cpsparse.topk_per_row(want, ks, ke, 16), 1)).all()
    # decode scoring + decode top-k
    qd, _ = cpsparse.quantize_fp8(rng.standard_normal((2, 2, 8, 128)).astype(np.float32))
    wd = rng.standard_normal((4, 8)).astype(np.float32)
    got = cpsparse.paged_mqa_logits(d(qd), dcache, d(wd), d(lens), d(table), 70).get()
    want = cpsparse.paged_mqa_logits(qd, hcache, wd, lens, table, 70)
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got))
    assert np.linalg.norm(got[fin] - want[fin]) <= 1e-3 * np.linalg.norm(want[fin])
    topd = cpsparse.topk_per_row_decode(d(want), d(lens), 2, 32).get()
    wantd = cpsparse.topk_per_row_decode(want, lens, 2, 32)
    assert (np.sort(topd, 1) == np.sort(wantd, 1)).all()
    # sparse MLA over the fp8 cache and over a dense workspace, dense causal MLA
    mcache = cpsparse.MLAKVCache(4)
    mcache.insert(rng.standard_normal((256, 512)).astype(np.float32),
                  rng.standard_normal((256, 64)).astype(np.float32),
                  np.arange(256, dtype=np.int32))
    q = (rng.standard_normal((3, 16, 576)) * 0.1).astype(np.float32)
    idx = rng.integers(-1, 256, (3, 64)).astype(np.int32)
    idx[2] = -1
    for kv in (mcache, mcache.gather(np.arange(256, dtype=np.int32))):
        dkv = cpsparse.MLAKVCache.wrap(d(kv.data)) if isinstance(kv, cpsparse.MLAKVCache) \
            else d(kv)
        out, lse = cpsparse.sparse_mla_attention(d(q), dkv, d(idx), 0.07)
        wo, wl = cpsparse.sparse_mla_attention(q, kv, idx, 0.07)
        assert np.linalg.norm(out.get() - wo) <= 1e-2 * np.linalg.norm(wo)
        assert np.isneginf(lse.get()[2]).all() and (out.get()[2] == 0).all()
    kv = rng.standard_normal((9, 576)).astype(np.float32)
    qq = (rng.standard_normal((5, 4, 576)) * 0.1).astype(np.float32)
    cuq, cuk = np.array([0, 2, 5], np.int32), np.array([0, 4, 9], np.int32)
    out, _ = cpsparse.dense_mla_attention(d(qq), d(kv), 0.1, cu_seqlens_q=d(cuq),
                                          cu_seqlens_k=d(cuk))
    wo, _ = cpsparse.dense_mla_attention(qq, kv, 0.1, cu_seqlens_q=cuq, cu_seqlens_k=cuk)
    assert np.linalg.norm(out.get() - wo) <= 1e-2 * np.linalg.norm(wo)
    loc = np.where(idx >= 0, idx % 128, -1).astype(np.int32)
    req = np.array([0, 1, 0], np.int32)
    g = cpsparse.local_to_global_slots(d(loc), d(req), d(table), 64)
    assert np.array_equal(g.get(), cpsparse.local_to_global_slots(loc, req, table, 64))
