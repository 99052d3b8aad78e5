"""GPU kernels vs the reference on hypothesis draws (bounded number of examples)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpsparse

pytestmark = pytest.mark.gpu

GPU = settings(max_examples=12, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow,
                                      HealthCheck.function_scoped_fixture])


def _cp():
    import cupy
    return cupy


def _rel(got, want):
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got)), "-inf masks differ"
    if not fin.any():
        return 0.0
    return np.linalg.norm(got[fin] - want[fin]) / max(np.linalg.norm(want[fin]), 1e-30)


@GPU
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from([8, 16, 32, 64]),
       st.lists(st.tuples(st.integers(0, 700), st.integers(1, 40)), min_size=1, max_size=4))
def test_mqa_logits_on_draws(seed, heads, requests):
    cp = _cp()
    rng = np.random.default_rng(seed)
    ks, ke, cu = [], [], 0
    for ctx, q in requests:
        ks += [cu] * q
        ke += [cu + ctx + i + 1 for i in range(q)]
        cu += ctx + q
    ks, ke = np.array(ks, np.int32), np.array(ke, np.int32)
    q8, qs = cpsparse.quantize_fp8(rng.standard_normal((ks.size, heads, 128)).astype(
        np.float32), eps=1e-10)
    k8, ksc = cpsparse.quantize_fp8(rng.standard_normal((cu, 128)).astype(np.float32))
    w = cpsparse.fold_weights(rng.standard_normal((ks.size, heads)).astype(np.float32), qs)
    args = (q8, k8, ksc[:, 0].copy(), w, ks, ke)
    want = cpsparse.mqa_logits(*args)
    got = cpsparse.mqa_logits(*[cp.asarray(a) for a in args]).get()
    if np.isfinite(want).sum() >= 256:
        assert _rel(got, want) <= 1e-3          # DESIGN section 11, on enough entries
    # Entry by entry, relative to the magnitude of the terms summed (|q|.|k| with
    # |W|): FP8 tensor-core accumulation is not exact, and signed terms and head
    # weights can cancel, so a lone entry's relative error is not bounded; its error
    # against the terms' magnitude is.
    mag = cpsparse.mqa_logits(q8 & 0x7F, k8 & 0x7F, ksc[:, 0].copy(), np.abs(w), ks, ke)
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got))
    assert (np.abs(got[fin] - want[fin]) <= 1e-3 * mag[fin] + 1e-30).all()


@GPU
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 4),
       st.lists(st.integers(1, 3000), min_size=1, max_size=5), st.sampled_from([8, 64]))
def test_paged_logits_and_decode_topk_on_draws(seed, next_n, lens, heads):
    cp = _cp()
    rng = np.random.default_rng(seed)
    lens = np.maximum(np.array(lens, np.int32), next_n)
    need = -(-lens // 64)
    table = np.full((lens.size, need.max() + 1), -1, np.int32)
    perm = rng.permutation(int(need.sum()) + 3)
    off = 0
    for r, m in enumerate(need):
        table[r, :m] = perm[off:off + m]
        off += m
    cache = cpsparse.IndexerKCache(int(need.sum()) + 3)
    for r, n in enumerate(lens):
        pos = np.arange(n)
        cache.insert(rng.standard_normal((n, 128)).astype(np.float32),
                     (table[r, pos // 64] * 64 + pos % 64).astype(np.int32))
    q8, _ = cpsparse.quantize_fp8(rng.standard_normal((lens.size, next_n, heads, 128)).astype(
        np.float32), eps=1e-10)
    w = rng.standard_normal((lens.size * next_n, heads)).astype(np.float32)
    width = int(lens.max()) + 5
    want = cpsparse.paged_mqa_logits(q8, cache, w, lens, table, width)
    dcache = cpsparse.IndexerKCache.wrap(cp.asarray(cache.data))
    got_d = cpsparse.paged_mqa_logits(cp.asarray(q8), dcache, cp.asarray(w), cp.asarray(lens),
                                      cp.asarray(table), width)
    assert _rel(got_d.get(), want) <= 1e-3
    k = int(rng.choice([512, 1024, 2048]))
    idx = cpsparse.topk_per_row_decode(cp.asarray(want), cp.asarray(lens), next_n, k).get()
    ends = cpsparse.indexer.decode_row_ends(lens, next_n)
    for r in range(idx.shape[0]):
        n = int(ends[r])
        sel = idx[r][idx[r] >= 0]
        assert len(sel) == min(n, k) and len(np.unique(sel)) == len(sel)
        if n > k:
            row = want[r, :n]
            assert row[sel].min() >= np.delete(row, sel).max()


@GPU
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 300), st.integers(1, 9000),
       st.sampled_from([512, 1024, 2048]), st.sampled_from(["normal", "ties", "neginf"]))
def test_topk_on_draws(seed, rows, width, k, kind):
    cp = _cp()
    rng = np.random.default_rng(seed)
    if kind == "normal":
        logits = rng.standard_normal((rows, width)).astype(np.float32)
    elif kind == "ties":
        logits = rng.integers(-2, 3, (rows, width)).astype(np.float32)
    else:
        logits = np.where(rng.random((rows, width)) < 0.7, -np.inf,
                          rng.standard_normal((rows, width))).astype(np.float32)
    starts = rng.integers(0, width, rows).astype(np.int32)
    ends = np.minimum(starts + rng.integers(0, width + 1, rows), width).astype(np.int32)
    idx = cpsparse.topk_per_row(cp.asarray(logits), cp.asarray(starts), cp.asarray(ends),
                                k).get()
    for r in range(rows):
        n = int(ends[r] - starts[r])
        sel = idx[r][idx[r] >= 0]
        assert len(sel) == min(n, k) and len(np.unique(sel)) == len(sel)
        assert (idx[r][len(sel):] == -1).all()
        if n > k:
            row = logits[r, starts[r]:ends[r]]
            assert row[sel].min() >= np.delete(row, sel).max()


@GPU
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from([32, 64, 128, 256]),
       st.sampled_from(["ue8m0", None]), st.floats(-30, 30))
def test_quantize_on_draws(seed, block, fmt, log_scale):
    cp = _cp()
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((17, 512)) * np.exp(log_scale)).astype(np.float32)
    c_d, s_d = cpsparse.quantize_fp8(cp.asarray(x), block, fmt, eps=1e-10)
    c_h, s_h = cpsparse.quantize_fp8(x, block, fmt, eps=1e-10)
    assert np.array_equal(c_d.get(), c_h) and np.array_equal(s_d.get(), s_h)


def _bf16_exact(a):
    return cpsparse.reference.fp8.bf16_decode(cpsparse.reference.fp8.bf16_encode(a))


@GPU
@given(st.integers(0, 2 ** 32 - 1), st.sampled_from([16, 64, 128]),
       st.sampled_from([512, 2048]), st.integers(1, 6))
def test_sparse_attention_on_draws(seed, heads, topk, tokens):
    cp = _cp()
    rng = np.random.default_rng(seed)
    slots = 4096
    kv = _bf16_exact(rng.standard_normal((slots, 576)).astype(np.float32))
    q = _bf16_exact((rng.standard_normal((tokens, heads, 576)) * 0.05).astype(np.float32))
    idx = rng.integers(-1, slots, (tokens, topk)).astype(np.int32)
    idx[0, rng.random(topk) < 0.5] = -1
    out_h, lse_h = cpsparse.sparse_mla_attention(q, kv, idx, 0.07)
    out_d, lse_d = cpsparse.sparse_mla_attention(cp.asarray(q), cp.asarray(kv),
                                                 cp.asarray(idx), 0.07)
    assert np.linalg.norm(out_d.get() - out_h) <= 1e-2 * np.linalg.norm(out_h)
    assert np.abs(lse_d.get() - lse_h).max() <= 1e-3
