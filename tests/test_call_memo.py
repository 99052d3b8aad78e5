"""The public ops' memo of validated argument layouts (cpsparse._validation.CallMemo).

A hit skips the structural checks, so: the same layouts hit, any change of type,
shape, strides, dtype or scalar misses and is checked again, value checks run on
every call, and a hit computes what a miss computes for every accepted form of
the arguments (raw cache arrays, peer views, float8 codes).
"""

import ml_dtypes
import numpy as np
import pytest

import cpsparse
from cpsparse import _backend, attention, indexer
from cpsparse import _validation as V

MEMOS = [indexer._PAGED_CALLS, indexer._TOPK_CALLS, indexer._TOPK_DECODE_CALLS,
         indexer._MQA_CALLS, attention._SLOTS_CALLS, attention._SPARSE_CALLS]


@pytest.fixture(autouse=True)
def empty_memos():
    for m in MEMOS:
        m.clear()
    yield
    for m in MEMOS:
        m.clear()


def _paged_args(rng, batch=2, next_n=2, ctx=(70, 5)):
    cache = cpsparse.IndexerKCache(num_blocks=4, block_size=64, head_dim=128)
    n = 4 * 64
    cache.insert(rng.standard_normal((n, 128)).astype(np.float32), np.arange(n, dtype=np.int32))
    q8, qs = cpsparse.quantize_fp8(
        rng.standard_normal((batch, next_n, 8, 128)).astype(np.float32), eps=1e-10)
    w = np.ascontiguousarray(rng.standard_normal((batch * next_n, 8)).astype(np.float32))
    return [q8, cache, w, np.array(ctx, np.int32), np.array([[0, 1], [2, 3]], np.int32), 72]


def _attention_args(rng, tokens=3):
    cache = cpsparse.MLAKVCache(num_blocks=2, block_size=64)
    cache.insert(rng.standard_normal((128, 512)).astype(np.float32),
                 rng.standard_normal((128, 64)).astype(np.float32),
                 np.arange(128, dtype=np.int32))
    q = rng.standard_normal((tokens, 4, 576)).astype(np.float32)
    idx = rng.integers(-1, 128, size=(tokens, 40)).astype(np.int32)
    return [q, cache, idx, 0.07]


class _Counter:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = _backend.get_array_module

        def counted(*a, **k):
            self.calls += 1
            return real(*a, **k)
        monkeypatch.setattr(_backend, "get_array_module", counted)


def test_layouts_key():
    a = np.zeros((2, 3), np.float32)
    assert V.layouts(a, None) == V.layouts(np.ones((2, 3), np.float32), None)
    assert V.layouts(a) != V.layouts(a.T)                     # strides
    assert V.layouts(a) != V.layouts(a.astype(np.float64))    # dtype
    assert V.layouts(a) != V.layouts(a.reshape(3, 2))         # shape
    assert V.layouts(a, [1, 2]) is None                       # not an array: no key


def test_clear_all_empties_every_memo():
    """CallMemo.clear_all (a kernel module compiled again) leaves no op's entry behind."""
    for m in MEMOS:
        m.put(("k",), 1)
    assert all(m in V.CallMemo._ALL for m in MEMOS)
    V.CallMemo.clear_all()
    assert all(len(m) == 0 for m in MEMOS)


def test_memo_is_bounded_and_ignores_none_keys():
    m = V.CallMemo("x", size=3)
    assert m.put(None, 1) == 1 and len(m) == 0 and m.get(None) is None
    for i in range(4):
        m.put(i, i)
    assert len(m) <= 3 and m.get(3) == 3


def test_same_layouts_skip_the_structural_checks(monkeypatch):
    rng = np.random.default_rng(0)
    args = _paged_args(rng)
    counter = _Counter(monkeypatch)
    first = indexer.paged_mqa_logits(*args)
    assert counter.calls >= 1
    args2 = _paged_args(np.random.default_rng(1))      # new arrays, same layouts
    before = counter.calls
    again = indexer.paged_mqa_logits(*args2)
    assert counter.calls == before                     # a hit: no backend lookup
    assert again.shape == first.shape and not np.array_equal(again, first)
    ref = indexer.paged_mqa_logits_core(np, args2[0], *args2[1:])
    np.testing.assert_array_equal(again, ref)


@pytest.mark.parametrize("change", ["strides", "dtype", "scalar_type", "max_len"])
def test_a_changed_layout_is_checked_again(change):
    rng = np.random.default_rng(0)
    args = _paged_args(rng)
    indexer.paged_mqa_logits(*args)
    if change == "strides":      # same shape and dtype, not C-contiguous
        w = np.asfortranarray(args[2])
        args[2] = w
        err, msg = ValueError, "Invalid layout of weights"
    elif change == "dtype":
        args[3] = args[3].astype(np.uint32)
        err, msg = TypeError, "Invalid dtype of context_lens"
    elif change == "scalar_type":
        args[5] = 72.0
        err, msg = TypeError, "Invalid max_context_len"
    else:
        args[5] = 60                                    # value check: shorter than ctx 70
        err, msg = ValueError, "Invalid max_context_len"
    with pytest.raises(err, match=msg):
        indexer.paged_mqa_logits(*args)


def test_value_checks_run_on_a_hit():
    rng = np.random.default_rng(0)
    args = _attention_args(rng)
    attention.sparse_mla_attention(*args)
    args[2] = args[2].copy()
    args[2][1, 3] = 128                                 # past the 128 slots
    with pytest.raises(ValueError, match="Invalid indices"):
        attention.sparse_mla_attention(*args)
    with pytest.raises(ValueError, match="Invalid req_ids"):
        local = np.zeros((2, 4), np.int32)
        attention.local_to_global_slots(local, np.array([0, 0], np.int32),
                                        np.array([[1, 2]], np.int32))
        attention.local_to_global_slots(local, np.array([0, 1], np.int32),
                                        np.array([[1, 2]], np.int32))


def test_bool_is_not_an_int_after_a_hit():
    logits = np.random.default_rng(0).standard_normal((2, 10)).astype(np.float32)
    lens = np.array([10], np.int32)
    indexer.topk_per_row_decode(logits, lens, 2, 1)
    with pytest.raises(TypeError, match="Invalid k"):
        indexer.topk_per_row_decode(logits, lens, 2, True)
    indexer.topk_per_row(logits, np.zeros(2, np.int32), np.full(2, 10, np.int32), 1)
    with pytest.raises(TypeError, match="Invalid k"):
        indexer.topk_per_row(logits, np.zeros(2, np.int32), np.full(2, 10, np.int32), True)


@pytest.mark.parametrize("form", ["2d", "3d", "4d"])
def test_paged_raw_cache_forms_hit_like_a_miss(form):
    rng = np.random.default_rng(0)
    args = _paged_args(rng)
    cache = args[1]
    view = {"2d": cache.data, "3d": cache.data.reshape(4, 64, 132),
            "4d": cache.data.reshape(4, 64, 1, 132)}[form]
    want = indexer.paged_mqa_logits(*args)               # IndexerKCache form
    args[1] = view
    miss = indexer.paged_mqa_logits(*args)
    hit = indexer.paged_mqa_logits(*args)
    assert len(indexer._PAGED_CALLS) == 2
    np.testing.assert_array_equal(miss, want)
    np.testing.assert_array_equal(hit, want)


def test_paged_float8_codes_hit_like_a_miss():
    rng = np.random.default_rng(0)
    args = _paged_args(rng)
    want = indexer.paged_mqa_logits(*args)
    args[0] = args[0].view(ml_dtypes.float8_e4m3fn)
    for _ in range(2):
        np.testing.assert_array_equal(indexer.paged_mqa_logits(*args), want)


@pytest.mark.parametrize("form", ["cache", "3d", "4d", "float8", "flashmla_indices", "dense"])
def test_attention_forms_hit_like_a_miss(form):
    rng = np.random.default_rng(0)
    args = _attention_args(rng)
    cache = args[1]
    want = attention.sparse_mla_attention(*args)
    if form == "dense":
        args[1] = cache.gather(np.arange(128, dtype=np.int32))
        args[2] = np.where(args[2] < 0, -1, args[2]).astype(np.int32)
        want = attention.sparse_mla_attention(*args, d_v=512)
    elif form == "3d":
        args[1] = cache.data
    elif form == "4d":
        args[1] = cache.data.reshape(2, 64, 1, 656)
    elif form == "float8":
        args[1] = cache.data.view(ml_dtypes.float8_e4m3fn)
    elif form == "flashmla_indices":
        args[2] = args[2].reshape(3, 1, 40)
    kw = dict(d_v=512) if form == "dense" else {}
    for _ in range(2):                                    # a miss, then a hit
        out, lse = attention.sparse_mla_attention(*args, **kw)
        np.testing.assert_array_equal(out, want[0])
        np.testing.assert_array_equal(lse, want[1])
    assert len(attention._SPARSE_CALLS) == (1 if form == "cache" else 2)


def _prefill_args(rng, m=5, n=40, heads=8):
    q8, qs = cpsparse.quantize_fp8(rng.standard_normal((m, heads, 128)).astype(np.float32),
                                   eps=1e-10)
    k8, ks8 = cpsparse.quantize_fp8(rng.standard_normal((n, 128)).astype(np.float32))
    w = np.ascontiguousarray(rng.standard_normal((m, heads)).astype(np.float32) * qs[..., 0])
    ke = np.arange(n - m + 1, n + 1, dtype=np.int32)
    return [q8, k8, ks8, w, np.zeros(m, np.int32), ke]


@pytest.mark.parametrize("form", ["scales_n1", "scales_n", "float8", "int64_windows", "mxfp4"])
def test_prefill_forms_hit_like_a_miss(form):
    """mqa_logits keeps its checks' conclusions by layouts too: a hit computes what a miss
    computes for every accepted form ([N, 1] and [N] scales, float8 codes, int64 windows,
    MXFP4 keys), and changed values are still read."""
    rng = np.random.default_rng(0)
    args = _prefill_args(rng)
    if form == "scales_n":
        args[2] = args[2][:, 0].copy()
    elif form == "float8":
        args[0] = args[0].view(ml_dtypes.float8_e4m3fn)
        args[1] = args[1].view(ml_dtypes.float8_e4m3fn)
    elif form == "int64_windows":
        args[4], args[5] = args[4].astype(np.int64), args[5].astype(np.int64)
    elif form == "mxfp4":
        cache = cpsparse.IndexerKCache(1, 64, 128, dtype="mxfp4")
        cache.insert(rng.standard_normal((40, 128)).astype(np.float32),
                     np.arange(40, dtype=np.int32))
        args[1], args[2] = cache.gather(np.zeros((1, 1), np.int32), np.array([0, 40], np.int32))
    codes, scales = args[1], args[2]
    if form != "mxfp4":
        codes, scales = V.as_codes(codes), scales.reshape(-1)
    want = indexer.mqa_logits_core(np, V.as_codes(args[0]), codes, scales, *args[3:])
    for _ in range(2):                                    # a miss, then a hit
        np.testing.assert_array_equal(indexer.mqa_logits(*args), want)
    assert len(indexer._MQA_CALLS) == 1
    args[3] = args[3] * 2                                 # new values, same layouts
    np.testing.assert_array_equal(indexer.mqa_logits(*args), want * 2)


def test_prefill_changed_layout_and_values_are_checked_again():
    rng = np.random.default_rng(0)
    args = _prefill_args(rng)
    indexer.mqa_logits(*args)
    bad = list(args)
    bad[5] = args[5].astype(np.uint32)
    with pytest.raises(TypeError, match="Invalid dtype of ke"):
        indexer.mqa_logits(*bad)
    bad = list(args)
    bad[5] = args[5] + 1                                  # past the 40 keys: a value check
    with pytest.raises(ValueError, match="Invalid ke"):
        indexer.mqa_logits(*bad)
