"""Indexer scoring: ``mqa_logits`` (prefill) and ``paged_mqa_logits`` (decode).

Oracles are independent of cpsparse.reference: fp8 codes are decoded with
``ml_dtypes.float8_e4m3fn``, keys are read back from the cache bytes with this
file's own page arithmetic, and the formula (DESIGN section 5)

    I[t, s] = s_k[s] * sum_h W[t, h] * relu(sum_d q8[t, h, d] * k8[s, d])

is evaluated one (t, s) pair at a time in float64.
"""

import ml_dtypes
import numpy as np
import pytest

import cpsparse
from cpsparse.indexer import fold_weights, mqa_logits, paged_mqa_logits

D = 128
PAGE = 64


# ---------------------------------------------------------------- helpers ----

def f8(codes):
    """float64 values of e4m3fn codes (uint8), decoded by ml_dtypes."""
    return np.ascontiguousarray(codes).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def pair_score(q8_t, k8_s, sk_s, w_t):
    """One logit: q8_t [H, D], k8_s [D] (float64 values), scalar key scale, w_t [H]."""
    dots = np.einsum("hd,d->h", q8_t, k8_s)
    return float(sk_s) * float(np.sum(w_t.astype(np.float64) * np.maximum(dots, 0.0)))


def oracle_mqa(q_codes, k_codes, k_scales, weights, ks, ke):
    m, n = q_codes.shape[0], k_codes.shape[0]
    q8, k8 = f8(q_codes), f8(k_codes)
    out = np.full((m, n), -np.inf)
    for t in range(m):
        for s in range(int(ks[t]), int(ke[t])):
            out[t, s] = pair_score(q8[t], k8[s], k_scales[s], weights[t])
    return out


def assert_logits_match(got, exp, rtol=1e-6):
    """-inf exactly where exp is -inf; finite elsewhere with relative error <= rtol."""
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.float32
    assert got.shape == exp.shape
    inside = np.isfinite(exp)
    np.testing.assert_array_equal(np.isneginf(got), ~inside)
    assert np.isfinite(got[inside]).all()
    if inside.any():
        e = exp[inside]
        err = np.abs(got[inside].astype(np.float64) - e)
        tol = rtol * np.abs(e) + 1e-12 * np.abs(e).max()
        worst = int(np.argmax(err - tol))
        assert (err <= tol).all(), (f"max violation at finite entry {worst}: "
                                   f"got {got[inside][worst]}, expected {e[worst]}")


def ragged_requests(rng, reqs, heads, extra_rows=()):
    """Packed prefill batch. reqs: (ctx, q_len) per request.

    Keys of request r are its ctx context tokens then its q_len new tokens,
    packed at rows cu[r]:cu[r+1]. extra_rows: (ks, ke) windows appended.
    """
    seq = [c + q for c, q in reqs]
    cu = np.concatenate([[0], np.cumsum(seq)]).astype(np.int64)
    n = int(cu[-1])
    ks, ke = [], []
    for r, (ctx, q_len) in enumerate(reqs):
        for i in range(q_len):
            ks.append(cu[r])
            ke.append(cu[r] + ctx + i + 1)
    for a, b in extra_rows:
        ks.append(a)
        ke.append(b)
    m = len(ks)
    # Keys of varied magnitude (so the per-key scales differ), queries too.
    k = (rng.standard_normal((n, D)) * np.exp(rng.normal(0, 1.5, (n, 1)))).astype(np.float32)
    q = (rng.standard_normal((m, heads, D)) *
         np.exp(rng.normal(0, 1.0, (m, heads, 1)))).astype(np.float32)
    w = rng.standard_normal((m, heads)).astype(np.float32)
    return dict(k=k, q=q, w=w, ks=np.array(ks, np.int32), ke=np.array(ke, np.int32), cu=cu)


def quantize_batch(b):
    k8, ksc = cpsparse.quantize_fp8(b["k"])                      # eps 1e-4, ue8m0, block 128
    q8, qs = cpsparse.quantize_fp8(b["q"], eps=1e-10)
    assert k8.dtype == np.uint8 and ksc.shape == (b["k"].shape[0], 1)
    assert qs.shape == b["q"].shape[:2] + (1,)
    w_folded = fold_weights(b["w"], qs, D)
    return q8, k8, np.ascontiguousarray(ksc[:, 0]), w_folded, qs


REQS = [(0, 1), (0, 6), (5, 1), (3, 0), (61, 4), (130, 3), (1, 2), (0, 0), (64, 1)]


# -------------------------------------------------------------- fold_weights --

def test_fold_weights_formula():
    rng = np.random.default_rng(7)
    for heads in (8, 32, 64):
        w = rng.standard_normal((5, heads)).astype(np.float32)
        s = np.exp(rng.normal(-5, 2, (5, heads))).astype(np.float32)
        exp = w.astype(np.float64) * s * D ** -0.5 * heads ** -0.5
        for qs in (s, s[..., None]):
            got = fold_weights(w, qs, D)
            assert got.dtype == np.float32 and got.shape == (5, heads)
            np.testing.assert_allclose(got, exp, rtol=1e-6, atol=0)


# ------------------------------------------------------------- mqa_logits -----

@pytest.mark.parametrize("heads", [8, 32, 64])
def test_mqa_logits_ragged_batch_matches_formula(heads):
    rng = np.random.default_rng(100 + heads)
    n_keys = sum(c + q for c, q in REQS)
    extra = [(0, 0), (5, 5), (n_keys, n_keys), (10, 40), (0, n_keys)]
    b = ragged_requests(rng, REQS, heads, extra_rows=extra)
    q8, k8, ksc, w, _ = quantize_batch(b)
    got = mqa_logits(q8, k8, ksc, w, b["ks"], b["ke"])
    exp = oracle_mqa(q8, k8, ksc, w, b["ks"], b["ke"])
    assert_logits_match(got, exp)
    # The windows really are the DESIGN ones: row i of request r sees ctx + i + 1 keys.
    n_seen = np.isfinite(got).sum(axis=1)
    np.testing.assert_array_equal(n_seen, b["ke"].astype(np.int64) - b["ks"])
    # Rows with ks == ke are entirely -inf.
    empty = b["ks"] == b["ke"]
    assert empty.sum() == 3
    assert np.isneginf(got[empty]).all()


def test_mqa_logits_window_edges_explicit():
    """A 1-token request and a 0-context request, checked entry by entry."""
    rng = np.random.default_rng(3)
    b = ragged_requests(rng, [(0, 1), (0, 3), (2, 2)], 8)
    q8, k8, ksc, w, _ = quantize_batch(b)
    got = mqa_logits(q8, k8, ksc, w, b["ks"], b["ke"])
    # request 0: key row 0; request 1: rows 1..3 causal; request 2: rows 4..7, ctx 2.
    windows = [(0, 1), (1, 2), (1, 3), (1, 4), (4, 7), (4, 8)]
    np.testing.assert_array_equal(np.stack([b["ks"], b["ke"]], 1), windows)
    q8v, k8v = f8(q8), f8(k8)
    for t, (lo, hi) in enumerate(windows):
        for s in range(got.shape[1]):
            if lo <= s < hi:
                want = pair_score(q8v[t], k8v[s], ksc[s], w[t])
                assert got[t, s] == pytest.approx(want, rel=1e-6, abs=1e-30)
            else:
                assert got[t, s] == -np.inf


def test_mqa_logits_negative_weights_and_relu():
    """relu is applied per head before the weighted sum (negative dots contribute 0)."""
    heads = 8
    q = np.zeros((1, heads, D), np.float32)
    k = np.zeros((2, D), np.float32)
    k[0, 0] = 1.0
    k[1, 0] = -1.0
    q[0, :, 0] = np.arange(1, heads + 1)           # positive dot with key 0, negative with 1
    q8, qs = cpsparse.quantize_fp8(q, eps=1e-10)
    k8, ksc = cpsparse.quantize_fp8(k)
    w = np.where(np.arange(heads) % 2 == 0, 1.0, -0.5).astype(np.float32)[None, :]
    got = mqa_logits(q8, k8, np.ascontiguousarray(ksc[:, 0]), w,
                     np.array([0], np.int32), np.array([2], np.int32))
    qv = f8(q8)[0, :, 0]
    kv = f8(k8)[:, 0]
    want0 = ksc[0, 0] * np.sum(w[0] * np.maximum(qv * kv[0], 0))
    assert got[0, 0] == pytest.approx(want0, rel=1e-6)
    assert want0 != 0
    assert got[0, 1] == 0.0                          # every head's dot is negative


def test_mqa_logits_no_keys_and_no_queries():
    rng = np.random.default_rng(4)
    q8, _ = cpsparse.quantize_fp8(rng.standard_normal((3, 8, D)).astype(np.float32), eps=1e-10)
    w = np.ones((3, 8), np.float32)
    z = np.zeros(3, np.int32)
    got = mqa_logits(q8, np.zeros((0, D), np.uint8), np.zeros(0, np.float32), w, z, z)
    assert got.shape == (3, 0) and got.dtype == np.float32
    k8, ksc = cpsparse.quantize_fp8(rng.standard_normal((4, D)).astype(np.float32))
    got = mqa_logits(np.zeros((0, 8, D), np.uint8), k8, np.ascontiguousarray(ksc[:, 0]),
                     np.zeros((0, 8), np.float32), np.zeros(0, np.int32),
                     np.zeros(0, np.int32))
    assert got.shape == (0, 4) and got.dtype == np.float32


@pytest.mark.parametrize("heads", [8, 64])
def test_mqa_logits_approximates_unquantized_scores(heads):
    """End to end: fp8 scores with folded weights ~ the float scores."""
    rng = np.random.default_rng(11 + heads)
    b = ragged_requests(rng, [(20, 6), (0, 5), (70, 2)], heads)
    q8, k8, ksc, w_folded, _ = quantize_batch(b)
    got = mqa_logits(q8, k8, ksc, w_folded, b["ks"], b["ke"])
    q, k, w = (b[x].astype(np.float64) for x in ("q", "k", "w"))
    ref = np.full(got.shape, -np.inf)
    for t in range(got.shape[0]):
        for s in range(b["ks"][t], b["ke"][t]):
            dots = q[t] @ k[s]
            ref[t, s] = np.sum(w[t] * np.maximum(dots, 0)) * D ** -0.5 * heads ** -0.5
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(got), fin)
    diff = got[fin] - ref[fin]
    rel = np.linalg.norm(diff) / np.linalg.norm(ref[fin])
    assert rel < 0.06, rel          # about 0.036 for e4m3 (3 mantissa bits)
    assert np.corrcoef(got[fin], ref[fin])[0, 1] > 0.995


# ------------------------------------------------------- paged_mqa_logits -----

def build_paged_cache(rng, lens, pad_value=-1, spare_blocks=3, extra_cols=1):
    """IndexerKCache holding len keys per request, on shuffled disjoint pages.

    Returns cache, block_table (int32 [B, max_blocks]), the float keys per
    request and their slots. Unused pages get junk keys; unused table columns
    hold pad_value.
    """
    need = [-(-L // PAGE) for L in lens]
    num_blocks = sum(need) + spare_blocks
    perm = rng.permutation(num_blocks)
    table = np.full((len(lens), max(need) + extra_cols), pad_value, np.int32)
    cache = cpsparse.IndexerKCache(num_blocks=num_blocks, block_size=PAGE, head_dim=D)
    used = 0
    keys, slots = [], []
    for b, L in enumerate(lens):
        table[b, :need[b]] = perm[used:used + need[b]]
        used += need[b]
        k = (rng.standard_normal((L, D)) * np.exp(rng.normal(0, 1, (L, 1)))).astype(np.float32)
        p = np.arange(L)
        slots.append((table[b, p // PAGE].astype(np.int64) * PAGE + p % PAGE).astype(np.int32))
        keys.append(k)
    # Junk in the spare pages (never referenced by the table).
    spare = perm[used:]
    junk_slots = (spare[:, None] * PAGE + np.arange(PAGE)[None, :]).reshape(-1).astype(np.int32)
    junk = (100 * rng.standard_normal((junk_slots.size, D))).astype(np.float32)
    # Insert in a shuffled order, with -1 padding slots mixed in.
    all_k = np.concatenate(keys + [junk, np.full((3, D), 1e3, np.float32)])
    all_s = np.concatenate(slots + [junk_slots, np.full(3, -1, np.int32)])
    order = rng.permutation(all_s.size)
    cache.insert(all_k[order], all_s[order])
    return cache, table, keys, slots


def read_key(data, slot):
    """(float64 codes [D], float scale) of a slot, straight from the page bytes."""
    blk, off = divmod(int(slot), PAGE)
    page = np.asarray(data[blk]).reshape(-1)
    codes = page[off * D:(off + 1) * D]
    sbytes = page[PAGE * D + 4 * off:PAGE * D + 4 * off + 4]
    scale = float(np.frombuffer(sbytes.tobytes(), dtype="<f4")[0])
    return f8(codes), scale


def decode_ends(context_lens, next_n):
    ends = []
    for b in range(context_lens.shape[0]):
        for j in range(next_n):
            if context_lens.ndim == 1:
                ends.append(max(0, int(context_lens[b]) - next_n + j + 1))
            else:
                ends.append(int(context_lens[b, j]))
    return ends


def oracle_paged(q_codes, data, weights, context_lens, table, max_len):
    batch, next_n = q_codes.shape[:2]
    q8 = f8(q_codes)
    out = np.full((batch * next_n, max_len), -np.inf)
    ends = decode_ends(context_lens, next_n)
    for b in range(batch):
        for j in range(next_n):
            row = b * next_n + j
            for p in range(ends[row]):
                slot = int(table[b, p // PAGE]) * PAGE + p % PAGE
                k8, sk = read_key(data, slot)
                out[row, p] = pair_score(q8[b, j], k8, sk, weights[row])
    return out


def decode_queries(rng, batch, next_n, heads):
    q = rng.standard_normal((batch, next_n, heads, D)).astype(np.float32)
    q8, qs = cpsparse.quantize_fp8(q, eps=1e-10)
    w = rng.standard_normal((batch * next_n, heads)).astype(np.float32)
    return q8, fold_weights(w, qs.reshape(batch * next_n, heads), D)


LENS = [63, 64, 65, 128, 1, 129, 4, 200]


def test_cache_bytes_hold_quantize_fp8_of_inserted_keys():
    """The oracle's byte reader agrees with quantize_fp8 of the inserted float keys."""
    rng = np.random.default_rng(20)
    cache, table, keys, slots = build_paged_cache(rng, LENS)
    for k, s in zip(keys, slots):
        codes, scales = cpsparse.quantize_fp8(k)
        for i in range(k.shape[0]):
            k8, sk = read_key(cache.data, s[i])
            np.testing.assert_array_equal(k8, f8(codes[i]))
            assert sk == scales[i, 0]


def test_paged_mqa_logits_clean_logits_is_a_bool_and_the_reference_writes_every_position():
    """clean_logits=False on the NumPy backend: the reference writes -inf past the
    windows either way (the same array as True); a non-bool is refused before anything
    runs, numpy.bool_ is a bool."""
    rng = np.random.default_rng(41)
    cache, table, _, _ = build_paged_cache(rng, LENS)
    lens = np.array(LENS, np.int32)
    q8, w = decode_queries(rng, len(LENS), 2, 16)
    clean = paged_mqa_logits(q8, cache, w, lens, table, max(LENS) + 3)
    for flag in (False, np.bool_(False), np.bool_(True)):
        got = paged_mqa_logits(q8, cache, w, lens, table, max(LENS) + 3, clean_logits=flag)
        np.testing.assert_array_equal(got, clean)
    for bad in (0, 1, None, "no", [False]):
        with pytest.raises(TypeError, match="Invalid clean_logits: expected a bool, got "):
            paged_mqa_logits(q8, cache, w, lens, table, max(LENS) + 3, clean_logits=bad)


@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("raw", [False, True], ids=["cache_obj", "raw_uint8"])
def test_paged_mqa_logits_1d_context_lens(next_n, raw):
    rng = np.random.default_rng(30 + next_n + 10 * raw)
    heads = 32
    cache, table, _, _ = build_paged_cache(rng, LENS)
    lens = np.array(LENS, np.int32)
    max_len = max(LENS) + 7
    q8, w = decode_queries(rng, len(LENS), next_n, heads)
    got = paged_mqa_logits(q8, cache.data if raw else cache, w, lens, table, max_len)
    exp = oracle_paged(q8, cache.data, w, lens, table, max_len)
    assert_logits_match(got, exp)
    # Row (b, j) sees exactly max(0, L_b - next_n + j + 1) positions, from 0.
    for b, L in enumerate(LENS):
        for j in range(next_n):
            seen = max(0, L - next_n + j + 1)
            row = got[b * next_n + j]
            assert np.isfinite(row[:seen]).all()
            assert np.isneginf(row[seen:]).all()


@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("raw", [False, True], ids=["cache_obj", "raw_uint8"])
def test_paged_mqa_logits_2d_context_lens(next_n, raw):
    rng = np.random.default_rng(50 + next_n + 10 * raw)
    heads = 8
    cache, table, _, _ = build_paged_cache(rng, LENS, pad_value=0)
    lens2 = np.stack([rng.integers(0, L + 1, next_n) for L in LENS]).astype(np.int32)
    lens2[0, -1] = LENS[0]          # full length and 0-length rows present
    lens2[1, 0] = 0
    lens2[2, -1] = 64               # a page edge
    max_len = max(LENS) + 1
    q8, w = decode_queries(rng, len(LENS), next_n, heads)
    got = paged_mqa_logits(q8, cache.data if raw else cache, w, lens2, table, max_len)
    exp = oracle_paged(q8, cache.data, w, lens2, table, max_len)
    assert_logits_match(got, exp)
    np.testing.assert_array_equal(np.isfinite(got).sum(axis=1), lens2.reshape(-1))


def test_paged_mqa_logits_page_edges_by_float_keys():
    """Second oracle: the scores of the keys as quantize_fp8 quantizes the inserted floats."""
    rng = np.random.default_rng(70)
    lens = [1, 63, 64, 65, 127, 128, 129]
    cache, table, keys, _ = build_paged_cache(rng, lens, spare_blocks=0, extra_cols=0)
    next_n = 2
    q8, w = decode_queries(rng, len(lens), next_n, 16)
    ctx = np.array(lens, np.int32)
    got = paged_mqa_logits(q8, cache, w, ctx, table, max(lens))
    q8v = f8(q8)
    for b, k in enumerate(keys):
        codes, scales = cpsparse.quantize_fp8(k)
        k8 = f8(codes)
        for j in range(next_n):
            row = b * next_n + j
            end = max(0, lens[b] - next_n + j + 1)
            for p in range(max(lens)):
                if p < end:
                    want = pair_score(q8v[b, j], k8[p], scales[p, 0], w[row])
                    assert got[row, p] == pytest.approx(want, rel=1e-6, abs=1e-30)
                else:
                    assert got[row, p] == -np.inf


@pytest.mark.parametrize("next_n", [1, 2])
def test_reference_paged_windows_end_at_max_context_len(next_n):
    """With the host checks off (the kernels' production mode) max_context_len may be
    shorter than a context: the reference's windows end there, so its logits are the
    full-width logits cut at that column (the contract the kernels are tested against)."""
    from cpsparse.reference import indexer as ref
    rng = np.random.default_rng(72 + next_n)
    cache, table, _, _ = build_paged_cache(rng, LENS)
    lens = np.array(LENS, np.int32)
    q8, w = decode_queries(rng, len(LENS), next_n, 8)
    full = ref.paged_mqa_logits(q8, cache.data, PAGE, w, lens, table, max(LENS))
    for width in (1, 64, 100, max(LENS) - 1):
        got = ref.paged_mqa_logits(q8, cache.data, PAGE, w, lens, table, width)
        np.testing.assert_array_equal(got, full[:, :width])


def test_paged_mqa_logits_zero_length_request():
    rng = np.random.default_rng(71)
    cache, table, _, _ = build_paged_cache(rng, [70, 5])
    q8, w = decode_queries(rng, 3, 1, 8)
    table3 = np.concatenate([table, np.full((1, table.shape[1]), -1, np.int32)])
    lens = np.array([70, 5, 0], np.int32)
    got = paged_mqa_logits(q8, cache, w, lens, table3, 80)
    exp = oracle_paged(q8, cache.data, w, lens, table3, 80)
    assert_logits_match(got, exp)
    assert np.isneginf(got[2]).all()


@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_paged_equals_prefill_over_gathered_keys(next_n):
    rng = np.random.default_rng(90 + next_n)
    heads = 16
    cache, table, _, _ = build_paged_cache(rng, LENS)
    lens = np.array(LENS, np.int32)
    cu = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    codes, scales = cache.gather(table, cu)
    q8, w = decode_queries(rng, len(LENS), next_n, heads)
    max_len = max(LENS) + 3
    paged = paged_mqa_logits(q8, cache, w, lens, table, max_len)
    ends = decode_ends(lens, next_n)
    ks = np.repeat(cu[:-1], next_n).astype(np.int32)
    ke = (ks + np.array(ends)).astype(np.int32)
    pre = mqa_logits(q8.reshape(-1, heads, D), codes, scales, w, ks, ke)
    assert pre.shape == (len(LENS) * next_n, int(cu[-1]))
    for b, L in enumerate(LENS):
        rows = slice(b * next_n, (b + 1) * next_n)
        np.testing.assert_allclose(paged[rows, :L], pre[rows, cu[b]:cu[b + 1]],
                                   rtol=1e-6, atol=0)
        assert np.isneginf(paged[rows, L:]).all()
        assert np.isneginf(pre[rows, :cu[b]]).all() and np.isneginf(pre[rows, cu[b + 1]:]).all()
    assert np.isfinite(paged).sum() == sum(ends) > 0


@pytest.mark.slow
def test_paged_mqa_logits_larger_h64_next_n4():
    rng = np.random.default_rng(123)
    lens = [int(x) for x in rng.integers(1, 700, 6)] + [640, 641]
    cache, table, _, _ = build_paged_cache(rng, lens)
    next_n = 4
    q8, w = decode_queries(rng, len(lens), next_n, 64)
    ctx = np.array(lens, np.int32)
    got = paged_mqa_logits(q8, cache, w, ctx, table, max(lens))
    q8v = f8(q8)
    # Vectorised oracle (einsum over all positions of a request, own byte reader).
    for b, L in enumerate(lens):
        k8 = np.empty((L, D))
        sk = np.empty(L)
        for p in range(L):
            k8[p], sk[p] = read_key(cache.data, table[b, p // PAGE] * PAGE + p % PAGE)
        dots = np.einsum("jhd,pd->jhp", q8v[b], k8)
        vals = np.einsum("jh,jhp->jp", w[b * next_n:(b + 1) * next_n].astype(np.float64),
                         np.maximum(dots, 0)) * sk[None, :]
        for j in range(next_n):
            end = max(0, L - next_n + j + 1)
            exp = np.full(max(lens), -np.inf)
            exp[:end] = vals[j, :end]
            assert_logits_match(got[b * next_n + j][None], exp[None])


def test_oracle_sanity_detects_wrong_scale():
    """The comparison helper is not vacuous: a perturbed result fails it."""
    rng = np.random.default_rng(5)
    b = ragged_requests(rng, [(3, 2)], 8)
    q8, k8, ksc, w, _ = quantize_batch(b)
    got = mqa_logits(q8, k8, ksc, w, b["ks"], b["ke"])
    exp = oracle_mqa(q8, k8, ksc, w, b["ks"], b["ke"])
    assert_logits_match(got, exp)
    bad = got.copy()
    bad[np.isfinite(bad)] *= np.float32(1 + 1e-5)
    assert (bad != got).any()
    with pytest.raises(AssertionError):
        assert_logits_match(bad, exp)


@pytest.mark.parametrize("batch,width,sms", [
    (64, 32768, 132), (128, 32768, 132), (8, 32768, 132), (1, 32768, 132),
    (4, 131072, 132), (3, 9029, 132), (1, 1, 132), (1000, 4096, 78), (2, 1 << 20, 132),
])
def test_ws_decode_plan_items_within_the_page_cap(batch, width, sms):
    """The warp-specialized decode plan (pure: no device) depends on the shapes alone:
    items of at most BT_CAP pages (the kernel's page-id buffer) in whole stages, enough
    of them to cover a row; one CTA an SM, never more than the batch's stages."""
    from cpsparse.raw_kernels import indexer as kin
    variant, nc, nch, hp, stages, piece_tiles, pieces = kin.ws_decode_plan(batch, width, sms)
    assert (variant, nc, nch, hp, stages) == ("ws", 128, 1, 64, kin.WS_STAGES)
    assert piece_tiles == kin.BT_CAP and piece_tiles % kin.WS_MATH == 0
    assert pieces * piece_tiles * kin.TILE >= width > (pieces - 1) * piece_tiles * kin.TILE
    stages_w = -(-width // (kin.TILE * kin.WS_MATH))
    assert kin.ws_grid(batch, width, sms) == min(sms, batch * stages_w) >= 1


@pytest.mark.parametrize("row_lens,width,ctas", [
    ([32768] * 64, 32768, 132), ([131072] * 4, 131072, 132), ([32768], 32768, 132),
    ([4096] * 256, 4096, 132), ([1, 63, 64, 65, 700, 9000, 2], 9029, 3),
    ([0, 0, 0], 300, 5), ([5000, 0, 70000, -3, 1 << 20], 65536, 7),
    ("mixed", 65536, 132), ("mixed", 32768, 1), ("skewed", 131072, 132),
])
def test_ws_decode_shares_tile_the_batch_by_weight(row_lens, width, ctas):
    """The shares of cps_wsd_share (as benchmarks.model_wsd_shares finds them, pure: no
    device) against a stage-by-stage oracle: every stage of every request's row belongs to
    exactly one CTA, the one whose [c total / ctas, (c + 1) total / ctas) holds the weight
    before the stage, so no share outweighs total / ctas by a stage or more, whatever the
    lengths."""
    from benchmarks import model_wsd_shares
    from cpsparse.raw_kernels import indexer as kin
    rng = np.random.default_rng(7)
    if row_lens == "mixed":
        row_lens = rng.integers(1, width + 1, size=64)
    elif row_lens == "skewed":           # one long request among many short ones
        row_lens = np.concatenate([[width], rng.integers(1, 2048, size=127)])
    key = kin.WSD_KEY_WEIGHT
    assert model_wsd_shares.KEYS == kin.TILE * kin.WS_MATH
    cuts = model_wsd_shares.shares(row_lens, width, ctas, key)
    stages_w = -(-width // 256)
    # the oracle: each stage's weight in request-major order
    lens = np.clip(np.asarray(row_lens, np.int64), 0, width)
    stage = np.arange(stages_w) * 256
    weights = np.concatenate([np.where(stage < n, key, 1) for n in lens])
    before = np.concatenate([[0], np.cumsum(weights)])[:-1]
    total = int(weights.sum())
    owner = np.searchsorted([c * total // ctas for c in range(1, ctas)], before, side="right")
    assert cuts[0] == 0 and cuts[-1] == len(weights)
    assert np.all(np.diff(cuts) >= 0)
    for c in range(ctas):
        mine = np.flatnonzero(owner == c)
        assert np.array_equal(mine, np.arange(cuts[c], cuts[c + 1])), c
        assert weights[mine].sum() < total / ctas + key, c


@pytest.mark.parametrize("row_lens,width,ctas", [
    ([4096] * 64, 4096, 132), ([4097, 4200, 4150], 4200, 132), ([513] * 6, 768, 5),
    ([300] * 2, 300, 7), ([32768], 32768, 132), ([131072] * 4, 131072, 132),
    ([1000] * 200, 1000, 1),
])
def test_ws_decode_full_batch_cuts_come_from_the_launch(row_lens, width, ctas):
    """When every request holds keys in all of its U stages, cps_wsd_share returns
    after one barrier and the producer takes the cuts ceil(floor(c T / G) / KEY_WEIGHT),
    T = KEY_WEIGHT U batch, in 32-bit arithmetic (the guess's bounds): the same cuts as
    the scan and search it skips (benchmarks.model_wsd_shares), ends anywhere in the last
    stage, more CTAs than stages included (pure: no device)."""
    from benchmarks import model_wsd_shares
    from cpsparse.raw_kernels import indexer as kin
    key = kin.WSD_KEY_WEIGHT
    stages_w = -(-width // 256)
    assert all(-(-n // 256) == stages_w for n in row_lens), "not a full batch"
    total = key * stages_w * len(row_lens)
    assert total * ctas <= 0xFFFFFFFF
    closed = [-(-(c * total // ctas) // key) for c in range(ctas + 1)]
    assert closed == list(model_wsd_shares.shares(row_lens, width, ctas, key))


@pytest.mark.parametrize("fp4", [False, True])
def test_ws_decode_kernels_cover_fp8_and_mxfp4_pages_of_64(fp4):
    """Which decode shapes the warp-specialized kernels take (pure: no device), their names,
    their plans' ring depth and their shared memory: the fp8 ring (4 stages of 32 KB) and the MXFP4 one (8 of 16 KB)
    within the H200's 227 KB a CTA, the MXFP4 one 4 KB larger (the stages' scales, masks and
    mbarriers)."""
    from cpsparse.raw_kernels import indexer as kin
    covers = [kin.uses_ws_decode("wgmma", n, h, 128, bs)
              for n, h, bs in ((1, 64, 64), (2, 57, 64), (3, 64, 64), (1, 56, 64), (2, 64, 128),
                               (1, 64, 32))]
    assert covers == [True, True, False, False, False, False], covers
    assert not kin.uses_ws_decode("mma", 1, 64, 128, 64)
    plan = kin.ws_decode_plan(64, 32768, 132, fp4)
    assert plan[4] == (kin.WSD_FP4_STAGES if fp4 else kin.WS_STAGES), plan
    assert kin.ws_kernel_name(2, fp4) == f"cps_paged_mqa_logits_{'fp4_' if fp4 else ''}ws_h64n2"
    smem = kin.ws_decode_smem_bytes(fp4)
    assert smem <= 227 * 1024, smem
    keys = kin.TILE * kin.WS_MATH
    assert smem - kin.ws_decode_smem_bytes(fp4, stages=1) == (
        (kin.WSD_FP4_STAGES if fp4 else kin.WS_STAGES) - 1) * (keys * (68 if fp4 else 132) + 20)
    if fp4:
        assert smem - kin.ws_decode_smem_bytes(False) == 4 * (keys * 4 + 20)


def test_wsd_share_model_balances_mixed_batches_and_keeps_uniform_ones():
    """The cost model's verdict (benchmarks.model_wsd_shares): on a mixed batch the
    busiest CTA of the shares carries about the mean, under 0.6 of the round robin's;
    on uniform batches within 4% of the round robin's."""
    from benchmarks import model_wsd_shares as m
    for name, (lens, width) in m.batches().items():
        old, _ = m.busiest(lens, width, round_robin=True)
        new, mean = m.busiest(lens, width)
        if "U(" in name:
            assert new < 0.6 * old and new < 1.15 * mean, (name, old, new, mean)
        else:
            assert new <= 1.04 * old, (name, old, new)
