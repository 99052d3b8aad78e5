"""MLA attention: sparse over top-k slots, dense causal, slot mapping, softmax scale.

Oracles are per-(token, head) loops in float64 with ``scipy.special.softmax``
and ``scipy.special.logsumexp``; the fp8_ds_mla records are decoded from the
cache bytes here (ml_dtypes e4m3 codes [0, 512) times the float32 scale of
each 128, bf16 RoPE bytes [528, 656)).
"""

import math

import ml_dtypes
import numpy as np
import pytest
from scipy.special import logsumexp, softmax

import cpsparse
from cpsparse.attention import (dense_mla_attention, local_to_global_slots, softmax_scale,
                                sparse_mla_attention)

LORA, ROPE = 512, 64
DQK = LORA + ROPE
SCALE = (128 + 64) ** -0.5


# ---------------------------------------------------------------- helpers ----

def oracle_attention(q, key_rows, sm_scale, d_v):
    """q [T, H, D]; key_rows[t]: float64 [n_t, D] (repeats allowed, n_t may be 0)."""
    q = np.asarray(q).astype(np.float64)
    tokens, heads, _ = q.shape
    out = np.zeros((tokens, heads, d_v))
    lse = np.full((tokens, heads), -np.inf)
    for t in range(tokens):
        keys = key_rows[t]
        if len(keys) == 0:
            continue
        for h in range(heads):
            s = sm_scale * (keys @ q[t, h])
            out[t, h] = softmax(s) @ keys[:, :d_v]
            lse[t, h] = logsumexp(s)
    return out, lse


def assert_attention_close(got, exp, rtol=1e-5):
    out, lse = got
    eo, el = exp
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert out.shape == eo.shape and lse.shape == el.shape
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    empty = np.isneginf(el)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert (out[empty] == 0).all()
    for t, h in zip(*np.nonzero(~empty)):
        ref = eo[t, h]
        err = np.linalg.norm(out[t, h].astype(np.float64) - ref)
        assert err <= rtol * np.linalg.norm(ref) + 1e-30, (t, h, err, np.linalg.norm(ref))
        assert abs(float(lse[t, h]) - el[t, h]) <= rtol * max(1.0, abs(el[t, h])), (t, h)


def random_indices(rng, tokens, topk, num_slots, p_masked=0.2, p_repeat=0.1):
    idx = rng.integers(0, num_slots, (tokens, topk))
    rep = rng.random((tokens, topk)) < p_repeat
    idx[:, 1:][rep[:, 1:]] = idx[:, :1].repeat(topk - 1, axis=1)[rep[:, 1:]]
    idx[rng.random((tokens, topk)) < p_masked] = -1
    return idx.astype(np.int32)


def rows_of(kv64, indices):
    return [kv64[[int(i) for i in row if i >= 0]] for row in indices]


def f8(codes):
    return np.ascontiguousarray(codes).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def decode_record(rec):
    """float64 [576] key row of one 656-byte fp8_ds_mla record."""
    rec = np.ascontiguousarray(rec)
    assert rec.shape == (656,)
    latent = f8(rec[:512]).reshape(4, 128)
    scales = np.frombuffer(rec[512:528].tobytes(), dtype="<f4").astype(np.float64)
    rope = np.frombuffer(rec[528:656].tobytes(), dtype=ml_dtypes.bfloat16).astype(np.float64)
    return np.concatenate([(latent * scales[:, None]).reshape(-1), rope])


def decoded_slots(data):
    """float64 [num_slots, 576] from the raw [num_blocks, block_size, 656] bytes."""
    nb, bs, _ = data.shape
    return np.stack([decode_record(data[s // bs, s % bs]) for s in range(nb * bs)])


def filled_mla_cache(rng, num_blocks=4, block_size=16, fill=0.8):
    cache = cpsparse.MLAKVCache(num_blocks=num_blocks, block_size=block_size)
    n = num_blocks * block_size
    slots = rng.permutation(n)[:int(n * fill)].astype(np.int32)
    kv_c = (rng.standard_normal((slots.size, LORA)) *
            np.exp(rng.normal(0, 1, (slots.size, 4))).repeat(128, axis=1)).astype(np.float32)
    k_pe = rng.standard_normal((slots.size, ROPE)).astype(np.float32)
    cache.insert(kv_c, k_pe, slots)
    return cache, slots, kv_c, k_pe


# ---------------------------------------------------- sparse, dense kv rows ---

@pytest.mark.parametrize("heads", [1, 4, 16])
@pytest.mark.parametrize("topk", [1, 7, 64])
def test_sparse_dense_workspace(heads, topk):
    rng = np.random.default_rng(heads * 100 + topk)
    slots, tokens = 50, 5
    kv = rng.standard_normal((slots, DQK)).astype(np.float32)
    q = rng.standard_normal((tokens, heads, DQK)).astype(np.float32)
    idx = random_indices(rng, tokens, topk, slots)
    idx[0, 0] = 3                     # at least one valid entry in row 0
    got = sparse_mla_attention(q, kv, idx, SCALE)
    assert got[0].shape == (tokens, heads, DQK - 64)               # default d_v = D - 64
    exp = oracle_attention(q, rows_of(kv.astype(np.float64), idx), SCALE, DQK - 64)
    assert_attention_close(got, exp)


@pytest.mark.parametrize("d_v", [1, 128, 512, 576])
def test_sparse_d_v(d_v):
    rng = np.random.default_rng(d_v)
    kv = rng.standard_normal((30, DQK)).astype(np.float32)
    q = rng.standard_normal((3, 4, DQK)).astype(np.float32)
    idx = random_indices(rng, 3, 10, 30, p_masked=0.1)
    got = sparse_mla_attention(q, kv, idx, 0.05, d_v=d_v)
    assert got[0].shape == (3, 4, d_v)
    assert_attention_close(got, oracle_attention(q, rows_of(kv.astype(np.float64), idx),
                                                 0.05, d_v))


def test_sparse_small_head_dim_and_low_precision_inputs():
    rng = np.random.default_rng(5)
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float64):
        kv = rng.standard_normal((20, 72)).astype(dtype)
        q = rng.standard_normal((4, 2, 72)).astype(dtype)
        idx = random_indices(rng, 4, 6, 20)
        idx[:, 0] = [0, 19, 5, 5]
        got = sparse_mla_attention(q, kv, idx, 0.3)
        exp = oracle_attention(q, rows_of(np.asarray(kv).astype(np.float64), idx), 0.3, 8)
        assert_attention_close(got, exp)


@pytest.mark.parametrize("out_dtype,want", [(None, np.float32), ("float32", np.float32),
                                             ("bfloat16", ml_dtypes.bfloat16),
                                             (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
                                             ("float16", np.float16),
                                             (np.dtype(np.float16), np.float16)])
def test_out_dtype_rounds_the_float32_out(out_dtype, want):
    """out_dtype on every route (dense rows, the fp8 cache, with the extras, dense
    causal): the float32 out rounded to nearest even (NaN rows stay NaN), lse float32
    and unchanged."""
    rng = np.random.default_rng(7)
    cache, slots, _, _ = filled_mla_cache(rng)
    kv = rng.standard_normal((30, DQK)).astype(np.float32)
    q = rng.standard_normal((3, 4, DQK)).astype(np.float32) * 0.1
    q[1, 2, 5] = np.nan
    idx = random_indices(rng, 3, 10, 30, p_masked=0.2)
    idx[:, 0] = 1
    sink = rng.standard_normal(4).astype(np.float32)
    calls = [lambda **kw: sparse_mla_attention(q, kv, idx, SCALE, **kw),
             lambda **kw: sparse_mla_attention(q, cache, slots[idx % slots.size], SCALE,
                                               **kw),
             lambda **kw: sparse_mla_attention(q, cache, slots[idx % slots.size], SCALE,
                                               attn_sink=sink, topk_length=np.array([1, 5, 9]),
                                               **kw),
             lambda **kw: sparse_mla_attention(q, cache, slots[idx % slots.size], SCALE,
                                               extra_kv_cache=kv, extra_indices=idx, **kw),
             lambda **kw: dense_mla_attention(q, kv, SCALE, **kw)]
    for call in calls:
        out32, lse32 = call()
        out, lse = call(out_dtype=out_dtype)
        assert out.dtype == np.dtype(want) and lse.dtype == np.float32
        expect = out32.astype(want)
        nan = np.isnan(expect.astype(np.float32))
        assert nan[1, 2].all() and (np.isnan(out.astype(np.float32)) == nan).all()
        assert (out[~nan].view(np.uint8) == expect[~nan].view(np.uint8)).all()
        np.testing.assert_array_equal(lse, lse32)


@pytest.mark.parametrize("bad", ["float64", np.int32, "bf16", 3, object(), ">f2", ">f4",
                                 ("f4", -1), "dtype('float16')"])
def test_out_dtype_refuses_other_types(bad):
    """Any out_dtype but float32, bfloat16 and float16 is a TypeError naming it, before
    any work (on both ops)."""
    kv = np.zeros((4, 8), np.float32)
    q = np.zeros((1, 1, 8), np.float32)
    sparse_mla_attention(q, kv, np.zeros((1, 2), np.int32), 1.0, d_v=4,
                         out_dtype=np.dtype("float16"))   # (the memo: another key)
    for call in (lambda: sparse_mla_attention(q, kv, np.zeros((1, 2), np.int32), 1.0,
                                              d_v=4, out_dtype=bad),
                 lambda: dense_mla_attention(q, kv, 1.0, d_v=4, out_dtype=bad)):
        with pytest.raises(TypeError, match="Invalid out_dtype: expected float32, "
                                            "bfloat16 or float16"):
            call()


def test_out_dtype_bfloat16_by_name_needs_ml_dtypes(monkeypatch):
    """out_dtype="bfloat16" imports ml_dtypes (its NumPy dtype): without it, a TypeError
    that says so; the other dtypes need nothing."""
    from cpsparse import _validation
    monkeypatch.setattr(_validation, "_OUT_DTYPES", {})
    monkeypatch.setitem(__import__("sys").modules, "ml_dtypes", None)   # import fails
    kv, q = np.zeros((4, 8), np.float32), np.zeros((1, 1, 8), np.float32)
    with pytest.raises(TypeError, match="bfloat16 needs the ml_dtypes package"):
        sparse_mla_attention(q, kv, np.zeros((1, 2), np.int32), 1.0, d_v=4,
                             out_dtype="bfloat16")
    out, _ = sparse_mla_attention(q, kv, np.zeros((1, 2), np.int32), 1.0, d_v=4,
                                  out_dtype="float16")
    assert out.dtype == np.float16


def test_sparse_masked_rows_and_repeats():
    rng = np.random.default_rng(6)
    kv = rng.standard_normal((10, DQK)).astype(np.float32)
    q = rng.standard_normal((4, 3, DQK)).astype(np.float32)
    q[3] = q[1]
    idx = np.array([[-1, -1, -1, -1],
                    [2, 2, 5, -1],
                    [-1, 7, -1, -1],
                    [5, 2, -1, 2]], np.int32)
    out, lse = sparse_mla_attention(q, kv, idx, SCALE)
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all()
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert_attention_close((out, lse), oracle_attention(q, rows_of(kv.astype(np.float64), idx),
                                                        SCALE, 512))
    # Same multiset of slots, different order and masking => same result.
    np.testing.assert_allclose(out[1], out[3], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(lse[1], lse[3], rtol=1e-6)
    # A single valid key: output is that key's value row, lse its score.
    np.testing.assert_allclose(out[2], np.broadcast_to(kv[7, :512], (3, 512)), rtol=1e-6)
    np.testing.assert_allclose(lse[2], SCALE * q[2] @ kv[7], rtol=1e-5)


def test_sparse_repeated_index_counts_twice():
    """q = 0 => uniform weights over listed entries: [a, a, b] -> (2 v_a + v_b) / 3, lse log 3."""
    kv = np.zeros((4, 8), np.float32)
    kv[1, :4] = [3, 0, 0, 0]
    kv[2, :4] = [0, 3, 0, 0]
    q = np.zeros((2, 2, 8), np.float32)
    idx = np.array([[1, 1, 2, -1], [1, 2, -1, -1]], np.int32)
    out, lse = sparse_mla_attention(q, kv, idx, 1.0, d_v=4)
    np.testing.assert_allclose(out[0, 0], [2, 1, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(out[1, 1], [1.5, 1.5, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(lse[0], math.log(3), rtol=1e-6)
    np.testing.assert_allclose(lse[1], math.log(2), rtol=1e-6)


def test_sparse_all_masked_and_empty_topk():
    rng = np.random.default_rng(8)
    kv = rng.standard_normal((6, DQK)).astype(np.float32)
    q = rng.standard_normal((3, 4, DQK)).astype(np.float32)
    out, lse = sparse_mla_attention(q, kv, np.full((3, 5), -1, np.int32), SCALE)
    assert out.shape == (3, 4, 512) and (out == 0).all() and np.isneginf(lse).all()
    out, lse = sparse_mla_attention(q, kv, np.zeros((3, 0), np.int32), SCALE)
    assert out.shape == (3, 4, 512) and (out == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("kind", ["dense_workspace", "mla_cache"])
def test_sparse_all_masked_over_empty_cache(kind):
    """Every index is -1 (valid per validation for 0 slots): out 0, lse -inf, no crash."""
    q = np.ones((2, 2, DQK), np.float32)
    kv = (np.zeros((0, DQK), np.float32) if kind == "dense_workspace"
          else cpsparse.MLAKVCache(num_blocks=0, block_size=64))
    out, lse = sparse_mla_attention(q, kv, np.full((2, 3), -1, np.int32), SCALE)
    assert out.shape == (2, 2, LORA)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_sparse_large_scores_are_stable():
    """Scores in the hundreds: no overflow, matches logsumexp."""
    rng = np.random.default_rng(9)
    kv = rng.standard_normal((40, DQK)).astype(np.float32)
    q = (10 * rng.standard_normal((3, 2, DQK))).astype(np.float32)
    idx = random_indices(rng, 3, 16, 40, p_masked=0.0)
    got = sparse_mla_attention(q, kv, idx, 2.0)
    exp = oracle_attention(q, rows_of(kv.astype(np.float64), idx), 2.0, 512)
    assert np.abs(exp[1]).max() > 500
    assert_attention_close(got, exp)


# ------------------------------------------------------ sparse, fp8_ds_mla ---

@pytest.mark.parametrize("heads", [1, 4, 16])
@pytest.mark.parametrize("raw", [False, True], ids=["cache_obj", "raw_uint8"])
def test_sparse_fp8_ds_mla_cache(heads, raw):
    rng = np.random.default_rng(40 + heads + raw)
    cache, slots, _, _ = filled_mla_cache(rng)
    assert cache.data.shape == (4, 16, 656)
    decoded = decoded_slots(cache.data)
    tokens, topk = 4, 24
    idx = random_indices(rng, tokens, topk, cache.num_slots)
    idx[1] = -1
    q = rng.standard_normal((tokens, heads, DQK)).astype(np.float32)
    got = sparse_mla_attention(q, cache.data if raw else cache, idx, SCALE)
    assert got[0].shape == (tokens, heads, LORA)                 # default d_v = kv_lora_rank
    exp = oracle_attention(q, rows_of(decoded, idx), SCALE, LORA)
    assert_attention_close(got, exp)
    assert np.isneginf(got[1][1]).all() and (got[0][1] == 0).all()


def test_fp8_ds_mla_oracle_decode_matches_inserted_values():
    """The byte decoder used as oracle reads back what was inserted (sanity of layout)."""
    rng = np.random.default_rng(41)
    cache, slots, kv_c, k_pe = filled_mla_cache(rng)
    decoded = decoded_slots(cache.data)
    bf16_pe = k_pe.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(decoded[slots, LORA:], bf16_pe)
    lat = decoded[slots, :LORA].reshape(-1, 4, 128)
    ref = kv_c.astype(np.float64).reshape(-1, 4, 128)
    amax = np.abs(ref).max(axis=2, keepdims=True)
    assert (np.abs(lat - ref) <= amax / 448 * 16 + 1e-30).all()     # within a half e4m3 step
    # Scales are max(amax / 448, FLT_MIN), not powers of two.
    sc = np.stack([np.frombuffer(cache.data[s // 16, s % 16, 512:528].tobytes(), "<f4")
                   for s in slots])
    np.testing.assert_allclose(sc, amax[..., 0] / 448, rtol=1e-6)


@pytest.mark.parametrize("d_v", [128, 576])
def test_sparse_fp8_ds_mla_d_v(d_v):
    rng = np.random.default_rng(42 + d_v)
    cache, _, _, _ = filled_mla_cache(rng, num_blocks=2, block_size=8, fill=1.0)
    decoded = decoded_slots(cache.data)
    idx = random_indices(rng, 3, 9, cache.num_slots)
    q = rng.standard_normal((3, 2, DQK)).astype(np.float32)
    got = sparse_mla_attention(q, cache, idx, SCALE, d_v=d_v)
    assert_attention_close(got, oracle_attention(q, rows_of(decoded, idx), SCALE, d_v))


def test_sparse_cache_equals_dense_workspace_of_gathered_rows():
    rng = np.random.default_rng(43)
    cache, _, _, _ = filled_mla_cache(rng, fill=1.0)
    all_slots = np.arange(cache.num_slots, dtype=np.int32)
    workspace = cache.gather(all_slots)
    idx = random_indices(rng, 5, 17, cache.num_slots)
    q = rng.standard_normal((5, 4, DQK)).astype(np.float32)
    a = sparse_mla_attention(q, cache, idx, SCALE)
    b = sparse_mla_attention(q, workspace, idx, SCALE, d_v=LORA)
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(a[1], b[1], rtol=1e-6)


# ------------------------------------------------------------------ dense ----

def oracle_dense(q, kv, sm_scale, cu_q, cu_k, d_v):
    kv64 = np.asarray(kv).astype(np.float64)
    rows = [None] * q.shape[0]
    for r in range(len(cu_q) - 1):
        q_len = cu_q[r + 1] - cu_q[r]
        k_len = cu_k[r + 1] - cu_k[r]
        for i in range(q_len):
            visible = min(max(k_len - q_len + i + 1, 0), k_len)
            rows[cu_q[r] + i] = kv64[cu_k[r]:cu_k[r] + visible]
    return oracle_attention(q, rows, sm_scale, d_v)


def packed(rng, reqs, heads, dqk):
    cu_q = np.concatenate([[0], np.cumsum([a for a, _ in reqs])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in reqs])]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), heads, dqk)).astype(np.float32)
    kv = rng.standard_normal((int(cu_k[-1]), dqk)).astype(np.float32)
    return q, kv, cu_q, cu_k


REQS = [(3, 3), (1, 9), (4, 20), (0, 5), (2, 2), (1, 1)]


@pytest.mark.parametrize("heads", [1, 4, 16])
def test_dense_packed_causal_bottom_right(heads):
    rng = np.random.default_rng(60 + heads)
    q, kv, cu_q, cu_k = packed(rng, REQS, heads, DQK)
    got = dense_mla_attention(q, kv, SCALE, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert got[0].shape == (q.shape[0], heads, DQK - 64)
    assert_attention_close(got, oracle_dense(q, kv, SCALE, cu_q, cu_k, DQK - 64))


def test_dense_causal_structure_explicit():
    """Query i (of 2) with 5 keys sees keys 0..3+i: the value of a later key is invisible."""
    q = np.zeros((2, 1, 8), np.float32)
    kv = np.zeros((5, 8), np.float32)
    kv[:, 0] = [1, 2, 3, 4, 100]
    out, lse = dense_mla_attention(q, kv, 1.0, d_v=1)
    np.testing.assert_allclose(out[:, 0, 0], [2.5, 22.0], rtol=1e-6)
    np.testing.assert_allclose(lse[:, 0], [math.log(4), math.log(5)], rtol=1e-6)


def test_dense_default_single_request_and_d_v():
    rng = np.random.default_rng(61)
    q = rng.standard_normal((6, 2, 200)).astype(np.float32)
    kv = rng.standard_normal((9, 200)).astype(np.float32)
    for d_v in (None, 7, 200):
        got = dense_mla_attention(q, kv, 0.1, d_v=d_v)
        dv = 136 if d_v is None else d_v
        exp = oracle_dense(q, kv, 0.1, [0, 6], [0, 9], dv)
        assert_attention_close(got, exp)


def test_dense_queries_without_visible_keys():
    """q_len > k_len: the first queries see no key -> out 0, lse -inf (as in sparse)."""
    rng = np.random.default_rng(62)
    q, kv, cu_q, cu_k = packed(rng, [(4, 2), (2, 0), (1, 3)], 2, 72)
    out, lse = dense_mla_attention(q, kv, 0.2, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert (out[:2] == 0).all() and np.isneginf(lse[:2]).all()       # keys j < 2 - 4 + i + 1
    assert (out[4:6] == 0).all() and np.isneginf(lse[4:6]).all()     # no keys at all
    assert np.isfinite(lse[2:4]).all() and np.isfinite(lse[6]).all()
    assert_attention_close((out, lse), oracle_dense(q, kv, 0.2, cu_q, cu_k, 8))


@pytest.mark.parametrize("heads", [1, 16])
def test_dense_equals_sparse_over_visible_keys(heads):
    rng = np.random.default_rng(63 + heads)
    q, kv, cu_q, cu_k = packed(rng, REQS + [(3, 1)], heads, DQK)
    tokens = q.shape[0]
    lists = []
    for r in range(len(cu_q) - 1):
        q_len, k_len = cu_q[r + 1] - cu_q[r], cu_k[r + 1] - cu_k[r]
        for i in range(q_len):
            vis = min(max(k_len - q_len + i + 1, 0), k_len)
            lists.append(list(range(cu_k[r], cu_k[r] + vis)))
    width = max(len(x) for x in lists) + 2
    idx = np.full((tokens, width), -1, np.int32)
    for t, lst in enumerate(lists):
        perm = rng.permutation(width)[:len(lst)]        # scattered among -1 padding
        idx[t, perm] = lst
    dense = dense_mla_attention(q, kv, SCALE, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    sparse = sparse_mla_attention(q, kv, idx, SCALE)
    np.testing.assert_allclose(dense[0], sparse[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(dense[1]), np.isneginf(sparse[1]))
    assert np.isneginf(dense[1]).any()          # the (3, 1) request has keyless queries
    fin = np.isfinite(dense[1])
    np.testing.assert_allclose(dense[1][fin], sparse[1][fin], rtol=1e-6)


# --------------------------------------------------- local_to_global_slots ---

@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_local_to_global_slots_vs_loop(block_size):
    rng = np.random.default_rng(block_size)
    reqs, max_blocks, tokens, topk = 3, 5, 7, 11
    table = rng.permutation(reqs * max_blocks + 4)[:reqs * max_blocks]
    table = table.reshape(reqs, max_blocks).astype(np.int32)
    req_ids = rng.integers(0, reqs, tokens).astype(np.int32)
    idx = rng.integers(0, max_blocks * block_size, (tokens, topk)).astype(np.int32)
    idx[rng.random((tokens, topk)) < 0.3] = -1
    idx[0, 0] = max_blocks * block_size - 1
    got = local_to_global_slots(idx, req_ids, table, block_size)
    assert got.dtype == np.int32 and got.shape == idx.shape
    for t in range(tokens):
        for j in range(topk):
            p = int(idx[t, j])
            if p < 0:
                assert got[t, j] == -1
            else:
                page = int(table[req_ids[t], p // block_size])
                assert got[t, j] == page * block_size + p % block_size


def test_paging_maps_every_out_of_range_input_to_minus_one():
    """cpsparse.paging.page_slots (what the reference and the checks-off paths use): a
    negative request id is not the table's last row, nor a position past the row, a
    negative page id or a slot past int32 anything but -1 (never wrapped)."""
    from cpsparse import paging
    block = 16
    big = paging.INT32_MAX // block                  # its slots past offset 15 overflow
    table = np.array([[3, -1, 1], [2, big, 0]], np.int64)
    cases = [  # (req, pos, expected slot)
        (0, 5, 3 * block + 5), (1, 40, 0 * block + 8), (0, 16, -1), (0, -1, -1),
        (-1, 5, -1), (2, 5, -1), (0, 3 * block, -1), (1, 16 + 15, big * block + 15),
        (0, 47, 1 * block + 15)]
    req = np.array([c[0] for c in cases])
    pos = np.array([c[1] for c in cases])
    got = paging.page_slots(table, req, pos, block)
    assert got.dtype == np.int32
    assert got.tolist() == [c[2] for c in cases]
    # a page id whose slots pass int32: -1, not a wrapped slot of another request
    assert paging.page_slots(np.array([[big + 1]], np.int64), 0, 0, block).tolist() == -1


def test_decode_row_ends_clip_at_zero():
    """Row (b, j) of next_n sees < L - next_n + j + 1 positions, never a negative end."""
    from cpsparse import paging
    ends = paging.decode_row_ends(np.array([1, 0, 5], np.int32), 3)
    assert ends.tolist() == [0, 0, 1, 0, 0, 0, 3, 4, 5]


def test_local_to_global_slots_default_block_size_example():
    got = local_to_global_slots(np.array([[0, 65, -1, 127]], np.int32),
                                np.array([0], np.int32), np.array([[7, 3]], np.int32))
    np.testing.assert_array_equal(got, [[448, 193, -1, 255]])


def test_topk_positions_through_slots_to_attention():
    """Request-local positions mapped to slots then attended == attention over the rows."""
    rng = np.random.default_rng(70)
    cache, _, _, _ = filled_mla_cache(rng, num_blocks=6, block_size=8, fill=1.0)
    table = np.array([[5, 0, 3], [2, 4, 1]], np.int32)
    decoded = decoded_slots(cache.data)
    req_ids = np.array([1, 0, 1], np.int32)
    pos = np.array([[0, 9, 23, -1], [17, -1, -1, 2], [8, 8, 1, 15]], np.int32)
    slots = local_to_global_slots(pos, req_ids, table, 8)
    q = rng.standard_normal((3, 4, DQK)).astype(np.float32)
    got = sparse_mla_attention(q, cache, slots, SCALE)
    rows = []
    for t in range(3):
        rows.append(np.stack([decoded[table[req_ids[t], p // 8] * 8 + p % 8]
                              for p in pos[t] if p >= 0]))
    assert_attention_close(got, oracle_attention(q, rows, SCALE, LORA))


# ------------------------------------------------------------ softmax_scale --

def test_softmax_scale():
    assert softmax_scale() == pytest.approx(192 ** -0.5, rel=1e-12)
    assert softmax_scale(128, 64) == pytest.approx(0.07216878364870322, rel=1e-12)
    assert softmax_scale(192, 64) == pytest.approx(256 ** -0.5, rel=1e-12)
    # YaRN (DeepSeek-V3: factor 40, mscale_all_dim 1): mscale = 0.1 * ln(40) + 1.
    m = 0.1 * math.log(40) + 1
    assert softmax_scale(128, 64, mscale=m) == pytest.approx(192 ** -0.5 * m * m, rel=1e-12)
    assert softmax_scale(128, 64, mscale=1.0) == pytest.approx(192 ** -0.5, rel=1e-12)


@pytest.mark.slow
def test_sparse_fp8_cache_topk2048_heads128():
    rng = np.random.default_rng(99)
    cache, _, _, _ = filled_mla_cache(rng, num_blocks=40, block_size=64, fill=1.0)
    decoded = decoded_slots(cache.data)
    idx = random_indices(rng, 2, 2048, cache.num_slots)
    q = rng.standard_normal((2, 128, DQK)).astype(np.float32)
    got = sparse_mla_attention(q, cache, idx, SCALE)
    assert_attention_close(got, oracle_attention(q, rows_of(decoded, idx), SCALE, LORA))


def test_split_kv_schedule():
    """choose_splits: 1 when the units fill the GPU; else every split non-empty with at
    least MIN_TILES_PER_SPLIT tiles, and the grid no larger than the SM count."""
    from cpsparse.raw_kernels import attention as katt
    assert katt.choose_splits(128, 32, 132) == 1            # B=128: one wave already
    assert katt.choose_splits(66, 32, 132) == 2
    assert katt.choose_splits(2, 32, 132) == 16             # B=1, H=128: 32 CTAs
    assert katt.choose_splits(1, 3, 132) == 1               # too few tiles to share
    for units in range(1, 140):
        for tiles in (1, 2, 4, 5, 8, 31, 32, 33, 64, 2048):
            s = katt.choose_splits(units, tiles, 132)
            assert 1 <= s <= katt.MAX_SPLITS
            if s > 1:
                per = -(-tiles // s)
                assert per >= katt.MIN_TILES_PER_SPLIT and (s - 1) * per < tiles
                assert units * s <= 132


def test_split_kv_merge_kernel_by_rows():
    """The merge's body with 16 splits' loads in flight (cps_mla_combine_few_rows) up to
    COMBINE_FEW_ROWS_PER_SM rows an SM (B=1, 2, 4 x 128 heads on 132 SMs), with 8 and 64
    registers (cps_mla_combine) past it (B=8 x 128 heads, the kernel the peer A/B timed
    there)."""
    from cpsparse.raw_kernels import attention as katt
    few, lean = "cps_mla_combine_few_rows", "cps_mla_combine"
    assert [katt.combine_kernel_name(b * 128, 132) for b in (1, 2, 4, 8)] == [few] * 3 + [lean]
    limit = katt.COMBINE_FEW_ROWS_PER_SM * 132
    assert katt.combine_kernel_name(limit, 132) == few
    assert katt.combine_kernel_name(limit + 1, 132) == lean


def test_dense_rows_kernel_takes_positive_scales_only():
    """The dense-rows kernel masks before it scales (its row max is of unscaled scores):
    sm_scale <= 0 goes to the reference; the fp8 kernel scales first and takes any."""
    from cpsparse.raw_kernels import attention as katt
    assert katt.supports_scale(0.05, False) and katt.supports_scale(1e-30, False)
    assert not katt.supports_scale(0.0, False) and not katt.supports_scale(-0.05, False)
    assert katt.supports_scale(0.0, True) and katt.supports_scale(-0.05, True)
