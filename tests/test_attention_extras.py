"""sparse_mla_attention's FlashMLA extras (attn_sink, topk_length, an extra key
cache with its own indices and lengths) against an independent float64 oracle:
one explicit softmax over the concatenated key lists, with the sink as one more
logit of value zero in the denominator."""

import numpy as np
import pytest

import cpsparse
from cpsparse.attention import sparse_mla_attention

LORA, ROPE = 128, 64
D = LORA + ROPE


def _cache(rng, num_blocks, block=16, nan_slot=None):
    cache = cpsparse.MLAKVCache(num_blocks, block, LORA, ROPE)
    n = num_blocks * block
    cache.insert(rng.standard_normal((n, LORA)).astype(np.float32),
                 rng.standard_normal((n, ROPE)).astype(np.float32), np.arange(n, dtype=np.int32))
    if nan_slot is not None:     # a NaN key that only a masked entry names
        cache.records()[nan_slot, :LORA] = 0x7F          # e4m3 NaN codes
    return cache


def oracle(q, sources, sm_scale, d_v, sink=None):
    """sources: [(cache, indices [T, k], lengths [T] or None)]; float64 out, lse."""
    tokens, heads, _ = q.shape
    out = np.zeros((tokens, heads, d_v))
    lse = np.full((tokens, heads), -np.inf)
    for t in range(tokens):
        keys = []
        for cache, idx, lens in sources:
            n = idx.shape[1] if lens is None else min(int(lens[t]), idx.shape[1])
            keep = [int(s) for s in idx[t, :n] if 0 <= s < cache.num_slots]
            if keep:
                keys.append(cache.gather(np.array(keep, np.int32)).astype(np.float64))
        if not keys:
            continue
        k = np.concatenate(keys)
        s = (q[t].astype(np.float64) @ k.T) * sm_scale                 # [H, n]
        m = s.max(axis=1, keepdims=True)
        e = np.exp(s - m)
        denom = e.sum(axis=1, keepdims=True)
        lse[t] = (m + np.log(denom))[:, 0]
        if sink is not None:
            with np.errstate(over="ignore"):
                denom = denom + np.exp(sink.astype(np.float64)[:, None] - m)
        out[t] = (e / denom) @ k[:, :d_v]
    return out, lse


def _inputs(seed=0, tokens=5, heads=4, topk=12, extra_topk=6):
    rng = np.random.default_rng(seed)
    main, extra = _cache(rng, 3), _cache(rng, 2)
    q = (rng.standard_normal((tokens, heads, D)) * 0.2).astype(np.float32)
    idx = rng.integers(-1, main.num_slots, (tokens, topk)).astype(np.int32)
    e_idx = rng.integers(-1, extra.num_slots, (tokens, extra_topk)).astype(np.int32)
    return rng, main, extra, q, idx, e_idx


def _close(got, want):
    out, lse = got
    np.testing.assert_allclose(out, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want[1], rtol=1e-6, atol=1e-6)


def test_attn_sink():
    rng, main, _, q, idx, _ = _inputs()
    sink = rng.standard_normal(4).astype(np.float32)
    sink[1], sink[2] = np.inf, -np.inf
    got = sparse_mla_attention(q, main, idx, 0.1, attn_sink=sink)
    _close(got, oracle(q, [(main, idx, None)], 0.1, LORA, sink))
    assert np.all(got[0][:, 1] == 0)                       # +inf: no output
    plain = sparse_mla_attention(q, main, idx, 0.1)
    np.testing.assert_array_equal(got[0][:, 2], plain[0][:, 2])   # -inf: no effect
    np.testing.assert_array_equal(got[1], plain[1])               # lse unchanged


def test_topk_length_zero_short_and_past_topk():
    _, main, _, q, idx, _ = _inputs()
    lens = np.array([0, 3, 12, 40, 7], np.int64)
    got = sparse_mla_attention(q, main, idx, 0.1, topk_length=lens)
    _close(got, oracle(q, [(main, idx, lens)], 0.1, LORA))
    assert np.all(got[0][0] == 0) and np.all(got[1][0] == -np.inf)   # length 0: empty


def test_an_empty_row_stays_zero_with_any_sink():
    """A row with no key (lse -inf) keeps out 0 under every sink, -inf included (there
    exp(sink - lse) is exp(nan): the factor must not be computed from it)."""
    _, main, _, q, idx, _ = _inputs()
    sink = np.array([0.5, np.inf, -np.inf, -3.0], np.float32)
    lens = np.array([0, 3, 12, 40, 7], np.int64)
    out, lse = sparse_mla_attention(q, main, idx, 0.1, attn_sink=sink, topk_length=lens)
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)
    _close((out, lse), oracle(q, [(main, idx, lens)], 0.1, LORA, sink))


def test_masked_tail_is_never_read():
    rng = np.random.default_rng(3)
    main = _cache(rng, 2, nan_slot=7)
    q = rng.standard_normal((2, 4, D)).astype(np.float32)
    idx = np.array([[1, 2, 7, 7], [7, 3, 4, 5]], np.int32)
    out, lse = sparse_mla_attention(q, main, idx, 0.1, topk_length=np.array([2, 0]))
    assert np.isfinite(out).all() and np.isfinite(lse[0]).all()
    out, _ = sparse_mla_attention(q, main, idx, 0.1)           # without: the NaN is read
    assert np.isnan(out).all()


@pytest.mark.parametrize("with_lengths", [False, True])
def test_extra_cache_in_the_same_softmax(with_lengths):
    rng, main, extra, q, idx, e_idx = _inputs(seed=1)
    lens = np.array([12, 0, 5, 12, 1], np.int32) if with_lengths else None
    e_lens = np.array([6, 6, 0, 2, 9], np.int32) if with_lengths else None
    sink = rng.standard_normal(4).astype(np.float32)
    got = sparse_mla_attention(q, main, idx, 0.1, topk_length=lens, extra_kv_cache=extra,
                               extra_indices=e_idx, extra_topk_length=e_lens, attn_sink=sink)
    _close(got, oracle(q, [(main, idx, lens), (extra, e_idx, e_lens)], 0.1, LORA, sink))


def test_extra_forms_and_an_empty_row():
    """The extra cache as a raw fp8_ds_mla array and FlashMLA's [T, 1, k] indices; a
    row with nothing in either list stays out 0, lse -inf, with a sink."""
    rng, main, extra, q, idx, e_idx = _inputs(seed=2)
    idx[4] = -1
    e_idx[4] = -1
    sink = np.zeros(4, np.float32)
    got = sparse_mla_attention(q, main, idx[:, None, :], 0.1, extra_kv_cache=extra.data,
                               extra_indices=e_idx[:, None, :], attn_sink=sink)
    _close(got, oracle(q, [(main, idx, None), (extra, e_idx, None)], 0.1, LORA, sink))
    assert np.all(got[0][4] == 0) and np.all(got[1][4] == -np.inf)


@pytest.mark.parametrize("kwargs,err,message", [
    (lambda e, ei: dict(extra_kv_cache=e), ValueError, "Invalid extra_kv_cache: expected"),
    (lambda e, ei: dict(extra_indices=ei), ValueError, "Invalid extra_kv_cache: expected"),
    (lambda e, ei: dict(extra_topk_length=np.zeros(5, np.int32)), ValueError,
     "Invalid extra_topk_length"),
    (lambda e, ei: dict(attn_sink=np.zeros(3, np.float32)), ValueError,
     "Invalid shape of attn_sink"),
    (lambda e, ei: dict(attn_sink=np.zeros(4)), TypeError, "Invalid dtype of attn_sink"),
    (lambda e, ei: dict(topk_length=np.array([1, 2, -1, 0, 0])), ValueError,
     "Invalid topk_length: expected values >= 0"),
    (lambda e, ei: dict(topk_length=np.zeros(4, np.int32)), ValueError,
     "Invalid shape of topk_length"),
    (lambda e, ei: dict(extra_kv_cache=e, extra_indices=np.where(ei < 0, e.num_slots, ei)),
     ValueError, "Invalid extra_indices"),
])
def test_extras_are_validated(kwargs, err, message):
    _, main, extra, q, idx, e_idx = _inputs()
    with pytest.raises(err, match=message):
        sparse_mla_attention(q, main, idx, 0.1, **kwargs(extra, e_idx))
