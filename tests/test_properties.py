"""Property-based tests (hypothesis) of the reference's invariants on random draws.

Each property is checked on random ragged batches, lengths, k, heads, shuffled
page tables and awkward values (zeros, subnormals, huge values, NaN where the
contract defines it). The GPU counterparts (kernel == reference on the same
draws) live in the GPU test files.
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cpsparse

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

special = st.sampled_from([0.0, -0.0, 1e-42, -3e-40, 1e-30, 448.0, 449.0, 1e30, -1e30,
                           2.0 ** -9, 2.0 ** -10])


@st.composite
def float_rows(draw, min_len=1, max_len=300):
    n = draw(st.integers(min_len, max_len))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["normal", "ties", "wide", "special"]))
    if kind == "normal":
        v = rng.standard_normal(n)
    elif kind == "ties":
        v = rng.integers(-3, 3, n).astype(np.float64)
    elif kind == "wide":
        v = rng.standard_normal(n) * np.exp(rng.uniform(-40, 40, n))
    else:
        v = np.array([draw(special) for _ in range(min(n, 20))] + list(rng.standard_normal(
            max(0, n - 20))))
    return v.astype(np.float32)


@SETTINGS
@given(st.lists(float_rows(), min_size=1, max_size=6), st.integers(1, 80),
       st.integers(0, 2 ** 32 - 1))
def test_topk_set_property(rows, k, seed):
    rng = np.random.default_rng(seed)
    width = max(len(r) for r in rows) + int(rng.integers(0, 5))
    logits = np.full((len(rows), width), np.nan, np.float32)     # garbage outside windows
    starts = np.zeros(len(rows), np.int32)
    ends = np.zeros(len(rows), np.int32)
    for i, r in enumerate(rows):
        s = int(rng.integers(0, width - len(r) + 1))
        logits[i, s:s + len(r)] = r
        starts[i], ends[i] = s, s + len(r)
    if rng.random() < 0.3:
        logits[0, starts[0]:ends[0]] = np.nan                     # NaN rows: defined rule
    out = cpsparse.topk_per_row(logits, starts, ends, k)
    for i in range(len(rows)):
        n = int(ends[i] - starts[i])
        row = logits[i, starts[i]:ends[i]]
        sel = out[i][out[i] >= 0]
        assert (out[i][len(sel):] == -1).all()
        assert len(sel) == min(n, k) and len(np.unique(sel)) == len(sel)
        assert ((sel >= 0) & (sel < n)).all()
        if n > k:
            rest = np.delete(np.arange(n), sel)
            key = np.where(np.isnan(row), -np.inf, row)           # NaN ranks lowest
            if np.isnan(row[sel]).any():                          # only when nothing else
                assert np.isnan(row[rest]).all()
            assert key[sel].min() >= key[rest].max()


@st.composite
def paged_batch(draw):
    lens = draw(st.lists(st.integers(0, 200), min_size=1, max_size=5))
    block = draw(st.sampled_from([8, 16, 64]))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    need = [-(-n // block) for n in lens]
    num_blocks = sum(need) + int(rng.integers(0, 4))              # unused pages too
    perm = rng.permutation(num_blocks)                             # shuffled, unshared
    table = np.full((len(lens), max(max(need), 1) + int(rng.integers(0, 3))), -1, np.int32)
    off = 0
    for r, m in enumerate(need):
        table[r, :m] = perm[off:off + m]
        off += m
    return lens, block, num_blocks, table, rng


@SETTINGS
@given(paged_batch(), st.sampled_from([16, 64, 128]))
def test_gather_after_insert_is_quantize(batch, dim):
    lens, block, num_blocks, table, rng = batch
    cache = cpsparse.IndexerKCache(num_blocks, block, dim)
    slots = [table[r, np.arange(n) // block] * block + np.arange(n) % block
             for r, n in enumerate(lens)]
    slots = np.concatenate(slots).astype(np.int32) if slots else np.zeros(0, np.int32)
    keys = (rng.standard_normal((slots.size, dim)) * np.exp(rng.uniform(-8, 8, (slots.size, 1)))
            ).astype(np.float32)
    cache.insert(keys, slots)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    codes, scales = cache.gather(table, cu)
    want_codes, want_scales = cpsparse.quantize_fp8(keys, block_size=dim)
    assert np.array_equal(codes, want_codes)
    assert np.array_equal(scales, want_scales[:, 0])


@SETTINGS
@given(paged_batch(), st.sampled_from([8, 16]), st.integers(1, 4), st.booleans())
def test_paged_logits_mask_and_agreement_with_prefill(batch, heads, next_n, two_d):
    lens, block, num_blocks, table, rng = batch
    dim = 128
    lens = np.asarray(lens, np.int32)
    cache = cpsparse.IndexerKCache(num_blocks, block, dim)
    for r, n in enumerate(lens):
        pos = np.arange(n)
        cache.insert(rng.standard_normal((n, dim)).astype(np.float32),
                     (table[r, pos // block] * block + pos % block).astype(np.int32))
    q8, _ = cpsparse.quantize_fp8(
        rng.standard_normal((len(lens), next_n, heads, dim)).astype(np.float32), eps=1e-10)
    w = rng.standard_normal((len(lens) * next_n, heads)).astype(np.float32)
    if two_d:
        ctx = np.stack([rng.integers(0, n + 1, next_n) for n in lens]).astype(np.int32)
    else:
        ctx = lens
    width = int(lens.max()) + 3
    logits = cpsparse.paged_mqa_logits(q8, cache, w, ctx, table, width)
    ends = cpsparse.indexer.decode_row_ends(ctx, next_n)
    cols = np.arange(width)[None, :]
    assert np.array_equal(np.isfinite(logits), cols < ends[:, None])   # -inf outside only
    # the same rows scored by the prefill op over the gathered keys
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    codes, scales = cache.gather(table, cu)
    for b in range(len(lens)):
        rows = slice(b * next_n, (b + 1) * next_n)
        if lens[b] == 0:
            continue
        ref = cpsparse.mqa_logits(q8[b], codes[cu[b]:cu[b + 1]], scales[cu[b]:cu[b + 1]],
                                  w[rows], np.zeros(next_n, np.int32),
                                  ends[rows].astype(np.int32))
        np.testing.assert_array_equal(logits[rows, :lens[b]], ref)


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 40), st.integers(0, 2 ** 32 - 1))
def test_sparse_attention_over_all_visible_keys_is_dense_causal(tokens, context, seed):
    rng = np.random.default_rng(seed)
    heads, dqk, dv = 2, 24, 16
    keys = context + tokens
    q = rng.standard_normal((tokens, heads, dqk)).astype(np.float32)
    kv = rng.standard_normal((keys, dqk)).astype(np.float32)
    dense_out, dense_lse = cpsparse.dense_mla_attention(q, kv, 0.3, d_v=dv)
    topk = keys + 2
    idx = np.full((tokens, topk), -1, np.int32)
    for i in range(tokens):
        visible = rng.permutation(context + i + 1)                # any order, -1 padded
        idx[i, :visible.size] = visible
    out, lse = cpsparse.sparse_mla_attention(q, kv, idx, 0.3, d_v=dv)
    np.testing.assert_allclose(out, dense_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, dense_lse, rtol=1e-6)


@SETTINGS
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1,
                max_size=64))
def test_e4m3_encode_matches_ml_dtypes_on_finite_saturated_values(values):
    x = np.asarray(values, np.float32)
    codes = cpsparse.reference.fp8.e4m3_encode(x)
    finite = np.isfinite(x)
    want = np.clip(x[finite], -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(codes[finite], want)
    assert (codes[np.isnan(x)] & 0x7F == 0x7F).all()
    assert np.array_equal(codes[np.isinf(x)] & 0x7F, np.full(np.isinf(x).sum(), 0x7E))


@pytest.mark.parametrize("value", [0.0, 1e-42, 1e38])
def test_quantize_of_constant_groups(value):
    """All-equal groups (zeros, subnormals, huge) quantize to one code and round-trip."""
    x = np.full((3, 128), value, np.float32)
    codes, scales = cpsparse.quantize_fp8(x)
    assert len(np.unique(codes)) == 1
    back = cpsparse.dequantize_fp8(codes, scales)
    np.testing.assert_allclose(back, x, rtol=2 ** -3, atol=1e-38)
