"""Production safety and interop on the CPU (issue: no index ever faults the GPU).

* The reference (what a GPU kernel is checked against, and what CuPy runs with
  kernels disabled) bounds every index the way the kernels do: out of range
  reads as masked, writes nothing, never raises or wraps.
* A masked entry is never read: NaN in unreferenced slots (slot 0 included)
  never reaches the output; NaN that takes part propagates as NaN.
* int64 index arrays give the same results as int32; the peers' views
  (DeepGEMM's and FlashMLA's caches, FlashMLA's [T, 1, topk] indices,
  quantize_fp8's [N, 1] key scales, ml_dtypes fp8 codes) are accepted as they are.
"""

import ml_dtypes
import numpy as np
import pytest
import scipy.special

import cpsparse
from cpsparse import reference as R
from cpsparse.attention import softmax_scale

BLOCK = 64
SCALE = softmax_scale(128, 64)


def oracle_attention(q, rows, idx, scale, d_v):
    """Per (token, head) softmax over the valid entries only (scipy logsumexp)."""
    t_n, h_n, _ = q.shape
    out = np.zeros((t_n, h_n, d_v))
    lse = np.full((t_n, h_n), -np.inf)
    for t in range(t_n):
        sel = [int(i) for i in idx[t] if 0 <= i < rows.shape[0]]
        if not sel:
            continue
        keys = rows[sel].astype(np.float64)
        s = q[t].astype(np.float64) @ keys.T * scale
        lse[t] = scipy.special.logsumexp(s, axis=1)
        out[t] = np.exp(s - lse[t][:, None]) @ keys[:, :d_v]
    return out, lse


# ---- the reference bounds every index -------------------------------------------

BAD = (-2 ** 31, -123456, -2, 2 ** 31 - 1)


@pytest.mark.parametrize("bad", BAD + ("num",))
def test_reference_sparse_attention_masks_out_of_range_and_never_reads_them(bad):
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((50, 576)).astype(np.float32)
    used = rng.choice(np.arange(1, 50), 20, replace=False)
    kv[np.setdiff1d(np.arange(50), used)] = np.nan          # slot 0 among them
    idx = rng.choice(used, (4, 32)).astype(np.int64)
    idx[:, ::3] = 50 if bad == "num" else bad
    idx[3] = -1
    q = rng.standard_normal((4, 8, 576)).astype(np.float32)
    out, lse = R.attention.sparse_mla_attention(q, kv, idx, SCALE, 512)
    want_out, want_lse = oracle_attention(q, kv, idx, SCALE, 512)
    assert np.isfinite(out[:3]).all() and np.isfinite(lse[:3]).all()
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    assert (out[3] == 0).all() and np.isneginf(lse[3]).all()


def test_reference_fp8_cache_nan_in_unreferenced_records_never_reaches_output():
    """FlashMLA's own test: every record no index names is NaN, record 0 included."""
    rng = np.random.default_rng(1)
    cache = cpsparse.MLAKVCache(2, BLOCK)
    slots = np.arange(10, 60, dtype=np.int32)
    cache.insert(rng.standard_normal((50, 512)).astype(np.float32),
                 rng.standard_normal((50, 64)).astype(np.float32), slots)
    rec = cache.records()
    rec[:10] = 0xFF
    rec[60:] = 0xFF
    idx = np.where(rng.random((5, 40)) < 0.3, -1, rng.choice(slots, (5, 40))).astype(np.int32)
    q = rng.standard_normal((5, 4, 576)).astype(np.float32)
    out, lse = cpsparse.sparse_mla_attention(q, cache, idx, SCALE)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    want_out, want_lse = oracle_attention(q, cache.gather(np.arange(128, dtype=np.int32)
                                                          .clip(10, 59)), idx, SCALE, 512)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


def test_nan_in_query_or_valid_key_propagates_as_nan_not_the_empty_marker():
    rng = np.random.default_rng(2)
    kv = rng.standard_normal((20, 576)).astype(np.float32)
    q = rng.standard_normal((3, 4, 576)).astype(np.float32)
    idx = np.array([[0, 1, 2], [3, 4, -1], [5, 6, 7]], np.int32)
    q[0, 1, 5] = np.nan                     # token 0, head 1
    kv[4, 100] = np.nan                     # a valid key of token 1
    for out, lse in (cpsparse.sparse_mla_attention(q, kv, idx, SCALE, d_v=512),
                     cpsparse.dense_mla_attention(q[:1], kv[:1], SCALE, d_v=512)):
        assert np.isnan(lse[0, 1]) and np.isnan(out[0, 1]).all()
        assert np.isfinite(lse[0, [0, 2, 3]]).all()
    out, lse = cpsparse.sparse_mla_attention(q, kv, idx, SCALE, d_v=512)
    assert np.isnan(lse[1]).all() and np.isnan(out[1]).all()
    assert np.isfinite(lse[2]).all() and np.isfinite(out[2]).all()


def test_reference_slot_mapping_refuses_wrap_and_out_of_range_to_minus_one():
    table = np.array([[7, 2 ** 26, -3], [1, 2, 3]], np.int64)
    idx = np.array([[0, 64 + 5, 128, 3 * 64, -1, -5],
                    [0, 1, 2, 3, 4, 5]], np.int64)
    got = R.attention.local_to_global_slots(idx, np.array([0, 5]), table, 64)
    # page 2**26 * 64 wraps int32 onto page 0; page -3 is negative; column 3 is
    # past the table; request 5 does not exist.
    assert got.tolist() == [[7 * 64, -1, -1, -1, -1, -1], [-1] * 6]
    ok = R.attention.local_to_global_slots(idx[:1, :1], np.array([1]), table, 64)
    assert ok.tolist() == [[64]]


def test_reference_inserts_skip_out_of_range_slots():
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, (2, BLOCK * 132), dtype=np.uint8)
    before = data.copy()
    codes = rng.integers(0, 256, (4, 128), dtype=np.uint8)
    R.cache.indexer_insert(data, BLOCK, 128, codes, np.ones(4, np.float32),
                           np.array([2 * BLOCK, 2 ** 31 - 1, -2, 5], np.int64))
    want = before.copy()
    R.cache.indexer_insert(want, BLOCK, 128, codes[3:], np.ones(1, np.float32),
                           np.array([5], np.int64))
    assert np.array_equal(data, want) and not np.array_equal(data, before)
    mla = rng.integers(0, 256, (1, BLOCK, 656), dtype=np.uint8)
    mla_before = mla.copy()
    R.cache.mla_insert(mla, rng.integers(0, 256, (2, 656), dtype=np.uint8),
                       np.array([BLOCK, -7], np.int64))
    assert np.array_equal(mla, mla_before)


def test_reference_paged_logits_mask_bad_pages_and_positions_past_the_table():
    rng = np.random.default_rng(4)
    cache = cpsparse.IndexerKCache(4, BLOCK)
    cache.insert(rng.standard_normal((4 * BLOCK, 128)).astype(np.float32),
                 np.arange(4 * BLOCK, dtype=np.int32))
    q8, _ = cpsparse.quantize_fp8(rng.standard_normal((2, 1, 8, 128)).astype(np.float32),
                                  eps=1e-10)
    w = rng.standard_normal((2, 8)).astype(np.float32)
    good = R.indexer.paged_mqa_logits(q8, cache.data, BLOCK, w, np.array([150, 150]),
                                      np.array([[0, 1, 2], [3, 2, 1]]), 200)
    bad = R.indexer.paged_mqa_logits(q8, cache.data, BLOCK, w, np.array([150, 150]),
                                     np.array([[0, 4, 2], [3, -9, 1]]),
                                     200)
    assert np.array_equal(bad[0, :64], good[0, :64]) and np.isneginf(bad[0, 64:128]).all()
    assert np.array_equal(bad[0, 128:150], good[0, 128:150])
    assert np.array_equal(bad[1, :64], good[1, :64]) and np.isneginf(bad[1, 64:128]).all()
    short_table = R.indexer.paged_mqa_logits(q8, cache.data, BLOCK, w, np.array([150, 150]),
                                             np.array([[0, 1], [3, 2]]), 200)
    assert np.array_equal(short_table[:, :128], good[:, :128])
    assert np.isneginf(short_table[:, 128:]).all()


def test_reference_windows_are_clamped_like_the_kernels():
    rng = np.random.default_rng(5)
    q8, _ = cpsparse.quantize_fp8(rng.standard_normal((3, 8, 128)).astype(np.float32),
                                  eps=1e-10)
    k8, ks = cpsparse.quantize_fp8(rng.standard_normal((10, 128)).astype(np.float32))
    w = rng.standard_normal((3, 8)).astype(np.float32)
    got = R.indexer.mqa_logits(q8, k8, ks[:, 0], w, np.array([-5, 2, 9]),
                               np.array([4, 2 ** 31 - 1, 3]))
    want = R.indexer.mqa_logits(q8, k8, ks[:, 0], w, np.array([0, 2, 9]),
                                np.array([4, 10, 3]))
    assert np.array_equal(got, want, equal_nan=True)
    logits = rng.standard_normal((2, 50)).astype(np.float32)
    top = R.indexer.topk_per_row(logits, np.array([-7, 45]), np.array([2 ** 31 - 1, 60]), 8)
    assert np.array_equal(np.sort(top[0]), np.sort(np.argsort(-logits[0])[:8]))
    assert top[1].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]


def test_reference_gather_reads_nothing_from_a_bad_page():
    rng = np.random.default_rng(6)
    data = rng.integers(0, 256, (3, BLOCK * 132), dtype=np.uint8)
    codes, scales = R.cache.indexer_read(data, BLOCK, 128, np.array([0, 3, -1, 2]),
                                         np.array([1, 1, 1, 1]))
    assert (codes[1:3] == 0).all() and (scales[1:3] == 0).all()
    assert codes[0].tolist() == data[0, 128:256].tolist()


# ---- int64 and the peers' views ----------------------------------------------------

def _indexer_inputs(rng):
    q8, qs = cpsparse.quantize_fp8(rng.standard_normal((6, 8, 128)).astype(np.float32),
                                   eps=1e-10)
    k8, ks = cpsparse.quantize_fp8(rng.standard_normal((9, 128)).astype(np.float32))
    w = cpsparse.fold_weights(rng.standard_normal((6, 8)).astype(np.float32), qs)
    return q8, k8, ks, w


def test_int64_index_arrays_match_int32_everywhere():
    rng = np.random.default_rng(7)
    q8, k8, ks, w = _indexer_inputs(rng)
    lo, hi = np.array([0, 0, 1, 2, 3, 3]), np.array([1, 4, 6, 9, 9, 5])
    both = [cpsparse.mqa_logits(q8, k8, ks[:, 0], w, lo.astype(t), hi.astype(t))
            for t in (np.int32, np.int64)]
    assert np.array_equal(*both)
    both = [cpsparse.topk_per_row(both[0], lo.astype(t), hi.astype(t), 2)
            for t in (np.int32, np.int64)]
    assert np.array_equal(*both)

    cache = cpsparse.IndexerKCache(3, BLOCK)
    keys = rng.standard_normal((100, 128)).astype(np.float32)
    caches = []
    for t in (np.int32, np.int64):
        c = cpsparse.IndexerKCache(3, BLOCK)
        c.insert(keys, np.arange(100).astype(t))          # vLLM's int64 slot_mapping
        caches.append(c)
    assert np.array_equal(caches[0].data, caches[1].data)
    cache = caches[1]
    table = np.array([[2, 0], [1, 0]])
    qd, _ = cpsparse.quantize_fp8(rng.standard_normal((2, 2, 8, 128)).astype(np.float32))
    wd = rng.standard_normal((4, 8)).astype(np.float32)
    both = [cpsparse.paged_mqa_logits(qd, cache, wd, np.array([100, 40]).astype(t),
                                      table.astype(t), 128) for t in (np.int32, np.int64)]
    assert np.array_equal(*both)
    both = [cpsparse.topk_per_row_decode(both[0], np.array([100, 40]).astype(t), 2, 16)
            for t in (np.int32, np.int64)]
    assert np.array_equal(*both)
    both = [cache.gather(table.astype(t), np.array([0, 100, 140]).astype(t))
            for t in (np.int32, np.int64)]
    assert all(np.array_equal(a, b) for a, b in zip(*both))

    mla = cpsparse.MLAKVCache(2, BLOCK)
    mla.insert(rng.standard_normal((5, 512)).astype(np.float32),
               rng.standard_normal((5, 64)).astype(np.float32), np.arange(5, dtype=np.int64))
    pos = np.array([[0, 3, -1], [1, 70, 2]])
    slots = [cpsparse.local_to_global_slots(pos.astype(t), np.array([0, 1]).astype(t),
                                            np.array([[0, 1], [1, 0]]).astype(t))
             for t in (np.int32, np.int64)]
    assert np.array_equal(*slots)
    q = rng.standard_normal((2, 4, 576)).astype(np.float32)
    outs = [cpsparse.sparse_mla_attention(q, mla, s.astype(t), SCALE)
            for s, t in zip(slots, (np.int32, np.int64))]
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    assert np.array_equal(mla.gather(np.array([0, 4], np.int64)),
                          mla.gather(np.array([0, 4], np.int32)))
    kv = rng.standard_normal((7, 576)).astype(np.float32)
    dense = [cpsparse.dense_mla_attention(q, kv, SCALE, cu_seqlens_q=np.array([0, 1, 2], t),
                                          cu_seqlens_k=np.array([0, 3, 7], t))
             for t in (np.int32, np.int64)]
    assert np.array_equal(dense[0][0], dense[1][0])


def test_int64_values_past_int32_are_out_of_range_not_wrapped():
    """2**32 wraps to slot 0 as int32; it must be refused (checks on) or skipped."""
    cache = cpsparse.IndexerKCache(1, BLOCK)
    with pytest.raises(ValueError, match="slot_mapping"):
        cache.insert(np.ones((1, 128), np.float32), np.array([2 ** 32], np.int64))
    before = cache.data.copy()
    R.cache.indexer_insert(cache.data, BLOCK, 128, np.ones((1, 128), np.uint8),
                           np.ones(1, np.float32), np.array([2 ** 32], np.int64))
    assert np.array_equal(cache.data, before)


def test_peer_views_are_accepted_as_they_are():
    rng = np.random.default_rng(8)
    cache = cpsparse.IndexerKCache(2, BLOCK)
    cache.insert(rng.standard_normal((100, 128)).astype(np.float32), np.arange(100))
    qd, _ = cpsparse.quantize_fp8(rng.standard_normal((1, 1, 8, 128)).astype(np.float32))
    wd = rng.standard_normal((1, 8)).astype(np.float32)
    args = (wd, np.array([100]), np.array([[1, 0]]), 128)
    want = cpsparse.paged_mqa_logits(qd, cache, *args)
    deepgemm_view = cache.data.reshape(2, BLOCK, 1, 132)          # [nb, bs, 1, D + 4]
    assert np.array_equal(cpsparse.paged_mqa_logits(qd, deepgemm_view, *args), want)
    wrapped = cpsparse.IndexerKCache.wrap(deepgemm_view)
    assert wrapped.data.shape == (2, BLOCK * 132)
    assert np.array_equal(cpsparse.paged_mqa_logits(qd.view(ml_dtypes.float8_e4m3fn),
                                                    cache, *args), want)

    mla = cpsparse.MLAKVCache(2, BLOCK)
    mla.insert(rng.standard_normal((9, 512)).astype(np.float32),
               rng.standard_normal((9, 64)).astype(np.float32), np.arange(9))
    q = rng.standard_normal((3, 4, 576)).astype(np.float32)
    idx = rng.integers(-1, 9, (3, 6)).astype(np.int32)
    want = cpsparse.sparse_mla_attention(q, mla, idx, SCALE)
    flashmla_cache = mla.data.reshape(2, BLOCK, 1, 656)           # [nb, bs, 1, 656]
    for kv in (flashmla_cache, flashmla_cache.view(ml_dtypes.float8_e4m3fn),
               cpsparse.MLAKVCache.wrap(flashmla_cache)):
        got = cpsparse.sparse_mla_attention(q, kv, idx[:, None, :], SCALE)   # [T, 1, topk]
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])

    q8, k8, ks, w = _indexer_inputs(rng)
    lo, hi = np.zeros(6, np.int32), np.arange(1, 7, dtype=np.int32)
    want = cpsparse.mqa_logits(q8, k8, ks[:, 0], w, lo, hi)
    got = cpsparse.mqa_logits(q8.view(ml_dtypes.float8_e4m3fn), k8.view(ml_dtypes.float8_e4m3fn),
                              ks, w, lo, hi)                     # ks as quantize_fp8 returns it
    assert np.array_equal(got, want)
    assert np.array_equal(cpsparse.dequantize_fp8(k8.view(ml_dtypes.float8_e4m3fn), ks),
                          cpsparse.dequantize_fp8(k8, ks))


def test_get_array_module_has_cupys_signature():
    x = np.zeros(3)
    assert cpsparse.get_array_module(x) is np
    assert cpsparse.get_array_module(x, None, 1.5, [1]) is np
    assert cpsparse.get_array_module() is np
    assert cpsparse.get_array_module(x, out=None, y=x) is np
    with pytest.raises(TypeError, match="Invalid type of y"):
        cpsparse.get_array_module(x, y=[1, 2])
