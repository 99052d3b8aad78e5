"""The chunked code paths of the NumPy reference (issue 12, item 9).

The reference splits its work to keep temporaries under a byte budget, the
``WORKSPACE_BYTES`` constant of :mod:`cpsparse.reference.indexer` and of
:mod:`cpsparse.reference.attention`:

* ``mqa_logits``: row chunks, each scoring the key range [min ks, max ke) of
  its rows (``paged_mqa_logits`` goes through it too);
* ``topk_per_row`` / ``topk_per_row_decode``: chunks of the rows longer than k;
* ``sparse_mla_attention``: token chunks;
* ``dense_mla_attention``: query chunks inside each request.

At the default budget the small inputs of the rest of the suite always fit
in one chunk, so those loops never ran more than once. Here the budget is
set small (down to chunks of one row), so that chunk boundaries fall inside
requests and between rows with unrelated windows. The public ops run on
NumPy inputs and are checked against oracles written below with plain
NumPy / SciPy: one row (or query, or token) at a time, with no call into
:mod:`cpsparse.reference`.
"""

import ml_dtypes
import numpy as np
import pytest
from scipy.special import logsumexp, softmax

import cpsparse
from cpsparse.reference import attention as ref_attention
from cpsparse.reference import indexer as ref_indexer

DEFAULT = None   # a budget parameter meaning: leave WORKSPACE_BYTES alone (one chunk)


def set_budget(monkeypatch, module, nbytes):
    """Set ``module.WORKSPACE_BYTES`` (raising if the constant is gone)."""
    if nbytes is not DEFAULT:
        monkeypatch.setattr(module, "WORKSPACE_BYTES", nbytes, raising=True)


# ---------------------------------------------------------------- codecs -----

def e4m3_values():
    """float64[256]: the value of each OCP e4m3fn code (0x7F and 0xFF are NaN)."""
    c = np.arange(256)
    sign = np.where(c & 0x80, -1.0, 1.0)
    exp = (c >> 3) & 0xF
    man = c & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    mag = np.where((exp == 15) & (man == 7), np.nan, mag)
    return sign * mag


E4M3 = e4m3_values()
FINITE_CODES = np.array([c for c in range(256) if c not in (0x7F, 0xFF)], np.uint8)


def test_e4m3_table_matches_ml_dtypes():
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(E4M3, want)


def random_codes(rng, shape):
    return rng.choice(FINITE_CODES, size=shape)


def decode_mla_records(records, lora, rope):
    """Rows [N, lora + rope] (float32 values, as float64) of fp8_ds_mla records.

    Layout (:class:`cpsparse.MLAKVCache`): lora e4m3 codes, lora // 128 float32
    scales, rope bfloat16 values.
    """
    groups = lora // 128
    codes = records[:, :lora]
    scales = np.ascontiguousarray(records[:, lora:lora + 4 * groups]).view("<f4")
    bits = np.ascontiguousarray(records[:, lora + 4 * groups:lora + 4 * groups + 2 * rope])
    pe = (bits.view("<u2").astype(np.uint32) << 16).view(np.float32)
    # code * scale is exact in float64; rounding it once gives the float32 product.
    latent = (E4M3[codes] * np.repeat(scales.astype(np.float64), 128, axis=1))
    return np.concatenate([latent.astype(np.float32), pe], axis=1).astype(np.float64)


# ---------------------------------------------------------------- oracles ----

def logits_oracle(q_codes, k_codes, k_scales, weights, ks, ke):
    """[M, N] float64, one query row at a time; -inf outside [ks, ke)."""
    m, n = q_codes.shape[0], k_codes.shape[0]
    out = np.full((m, n), -np.inf)
    for i in range(m):
        lo, hi = int(ks[i]), int(ke[i])
        if hi <= lo:
            continue
        q = E4M3[q_codes[i]]                       # [H, D]
        k = E4M3[k_codes[lo:hi]]                   # [n, D]
        relu = np.maximum(q @ k.T, 0.0)            # [H, n]  (exact: fp8 products)
        out[i, lo:hi] = (weights[i].astype(np.float64) @ relu) * k_scales[lo:hi]
    return out


def assert_logits(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert not np.isnan(got).any()
    fin = np.isfinite(want)
    scale = float(np.abs(want[fin]).max()) if fin.any() else 1.0
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-6, atol=1e-12 * scale)


def topk_row_oracle(values, k):
    """Documented top-k of one window (float32 [n]): positions relative to its start."""
    n = len(values)
    if n <= k:
        return list(range(n)) + [-1] * (k - n)

    def key(p):
        v = float(values[p])
        return (1, 0.0, p) if np.isnan(v) else (0, -v, p)   # -0.0 == 0.0 ties by position
    return sorted(range(n), key=key)[:k]


def topk_oracle(logits, starts, ends, k):
    return np.array([topk_row_oracle(logits[i, int(starts[i]):int(ends[i])], k)
                     for i in range(logits.shape[0])], np.int32).reshape(-1, k)


def attention_row(q_heads, rows, sm_scale, d_v):
    """(out [H, d_v], lse [H]) of one query over key rows [n, D] (float64)."""
    heads = q_heads.shape[0]
    if rows.shape[0] == 0:
        return np.zeros((heads, d_v)), np.full(heads, -np.inf)
    s = sm_scale * (q_heads.astype(np.float64) @ rows.T)          # [H, n]
    return softmax(s, axis=1) @ rows[:, :d_v], logsumexp(s, axis=1)


def sparse_oracle(q, rows_of, indices, sm_scale, d_v):
    """Per token: attention over the rows of its valid indices (repeats count twice)."""
    t, h, _ = q.shape
    out, lse = np.zeros((t, h, d_v)), np.zeros((t, h))
    for i in range(t):
        sel = indices[i][indices[i] >= 0]
        out[i], lse[i] = attention_row(q[i], rows_of(sel), sm_scale, d_v)
    return out, lse


def dense_oracle(q, kv, sm_scale, d_v, cu_q, cu_k):
    """Per request, per query: bottom-right causal, query i sees keys j < k_len - q_len + i + 1."""
    t, h, _ = q.shape
    out, lse = np.zeros((t, h, d_v)), np.full((t, h), -np.inf)
    kv64 = kv.astype(np.float64)
    for r in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[r]), int(cu_q[r + 1]), int(cu_k[r]), int(cu_k[r + 1])
        q_len, k_len = q1 - q0, k1 - k0
        for i in range(q_len):
            visible = min(max(k_len - q_len + i + 1, 0), k_len)
            out[q0 + i], lse[q0 + i] = attention_row(q[q0 + i], kv64[k0:k0 + visible],
                                                     sm_scale, d_v)
    return out, lse


def assert_attention(got, want):
    out, lse = got
    w_out, w_lse = want
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert out.shape == w_out.shape and lse.shape == w_lse.shape
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(w_lse))
    fin = np.isfinite(w_lse)
    np.testing.assert_allclose(lse[fin], w_lse[fin], rtol=1e-5, atol=1e-6)
    scale = max(1.0, float(np.abs(w_out).max()))
    np.testing.assert_allclose(out, w_out, rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_array_equal(out[~fin], 0.0)


# ------------------------------------------------------------ mqa_logits -----

H_IDX, D_IDX = 4, 16

# Ragged windows over N = 23 keys: later rows start before earlier ones, some
# are empty, some cover everything, so a chunk's [min ks, max ke) is no
# single row's window (and a chunk may hold only empty rows: rows 10-11).
RAGGED = [(5, 9), (2, 4), (7, 7), (0, 23), (10, 12), (10, 10), (3, 15), (20, 23),
          (0, 1), (22, 23), (11, 11), (11, 11), (4, 18), (6, 8), (1, 22)]
N_RAGGED = 23
ROW_BYTES = 8 * H_IDX * N_RAGGED          # one row of the reference's [rows, H, N] float64 block


def indexer_inputs(rng, m, n):
    q = random_codes(rng, (m, H_IDX, D_IDX))
    k = random_codes(rng, (n, D_IDX))
    k_scales = rng.uniform(0.5, 2.0, n).astype(np.float32)
    weights = rng.standard_normal((m, H_IDX)).astype(np.float32)
    return q, k, k_scales, weights


@pytest.mark.parametrize("budget", [1, ROW_BYTES, 2 * ROW_BYTES, 3 * ROW_BYTES - 1,
                                    4 * ROW_BYTES, 7 * ROW_BYTES, DEFAULT])
def test_mqa_logits_ragged_windows(monkeypatch, budget):
    set_budget(monkeypatch, ref_indexer, budget)
    rng = np.random.default_rng(1)
    ks = np.array([w[0] for w in RAGGED], np.int32)
    ke = np.array([w[1] for w in RAGGED], np.int32)
    q, k, k_scales, weights = indexer_inputs(rng, len(RAGGED), N_RAGGED)
    got = cpsparse.mqa_logits(q, k, k_scales, weights, ks, ke)
    assert_logits(got, logits_oracle(q, k, k_scales, weights, ks, ke))


@pytest.mark.parametrize("budget", [1, 2 * 8 * H_IDX * 30, 5 * 8 * H_IDX * 30])
def test_mqa_logits_packed_prefill(monkeypatch, budget):
    """Requests of a prefill chunk: ks = cu[r], ke = cu[r] + ctx + i + 1; chunks cut requests."""
    set_budget(monkeypatch, ref_indexer, budget)
    rng = np.random.default_rng(2)
    ctx_and_new = [(4, 3), (0, 5), (9, 1), (2, 6)]           # (context, new tokens)
    cu = np.cumsum([0] + [c + t for c, t in ctx_and_new])
    ks, ke = [], []
    for r, (ctx, new) in enumerate(ctx_and_new):
        ks += [cu[r]] * new
        ke += [cu[r] + ctx + i + 1 for i in range(new)]
    ks, ke = np.array(ks, np.int32), np.array(ke, np.int32)
    n = int(cu[-1])
    assert n == 30
    q, k, k_scales, weights = indexer_inputs(rng, len(ks), n)
    got = cpsparse.mqa_logits(q, k, k_scales, weights, ks, ke)
    assert_logits(got, logits_oracle(q, k, k_scales, weights, ks, ke))


@pytest.mark.parametrize("budget", [1, 8 * H_IDX * 12 * 2, 8 * H_IDX * 12 * 3 + 5])
def test_mqa_logits_random_windows(monkeypatch, budget):
    set_budget(monkeypatch, ref_indexer, budget)
    rng = np.random.default_rng(3)
    m, n = 21, 12
    a, b = rng.integers(0, n + 1, m), rng.integers(0, n + 1, m)
    ks, ke = np.minimum(a, b).astype(np.int32), np.maximum(a, b).astype(np.int32)
    ks[[4, 9]], ke[[4, 9]] = 0, n                 # full windows
    ks[[5, 6]] = ke[[5, 6]]                        # empty ones
    q, k, k_scales, weights = indexer_inputs(rng, m, n)
    got = cpsparse.mqa_logits(q, k, k_scales, weights, ks, ke)
    assert_logits(got, logits_oracle(q, k, k_scales, weights, ks, ke))


# ------------------------------------------------------ paged_mqa_logits -----

def paged_case(rng, lens_per_request, next_n, block_size=4, max_context_len=13):
    """A filled IndexerKCache, its block table, and each request's keys by position."""
    batch = len(lens_per_request)
    max_blocks = -(-max_context_len // block_size)
    num_blocks = batch * max_blocks + 2
    cache = cpsparse.IndexerKCache(num_blocks=num_blocks, block_size=block_size,
                                   head_dim=D_IDX)
    block_table = rng.permutation(num_blocks)[:batch * max_blocks].reshape(batch, max_blocks)
    block_table = block_table.astype(np.int32)
    keys = []
    for b, length in enumerate(lens_per_request):
        codes = random_codes(rng, (length, D_IDX))
        scales = rng.uniform(0.5, 2.0, length).astype(np.float32)
        pos = np.arange(length)
        slots = (block_table[b, pos // block_size] * block_size + pos % block_size)
        cache.insert_quantized(codes, scales, slots.astype(np.int32))
        keys.append((codes, scales))
    q = random_codes(rng, (batch, next_n, H_IDX, D_IDX))
    weights = rng.standard_normal((batch * next_n, H_IDX)).astype(np.float32)
    return cache, block_table, keys, q, weights


def paged_oracle(q, keys, weights, ends, width):
    batch, next_n = q.shape[:2]
    out = np.full((batch * next_n, width), -np.inf)
    for b in range(batch):
        codes, scales = keys[b]
        for j in range(next_n):
            row = b * next_n + j
            e = int(ends[row])
            out[row:row + 1, :codes.shape[0]] = logits_oracle(
                q[b, j:j + 1], codes, scales, weights[row:row + 1],
                np.array([0]), np.array([e]))
    return out


@pytest.mark.parametrize("budget", [1, 8 * H_IDX * 11 * 2, DEFAULT])
@pytest.mark.parametrize("form", ["1d", "2d"])
def test_paged_mqa_logits_chunks(monkeypatch, budget, form):
    set_budget(monkeypatch, ref_indexer, budget)
    rng = np.random.default_rng(4)
    next_n, width = 3, 13
    if form == "1d":
        lens = np.array([7, 2, 11, 3], np.int32)     # row (b, j) sees < L - next_n + j + 1
        ends = np.maximum(lens[:, None] - next_n + np.arange(next_n) + 1, 0).reshape(-1)
        stored = lens
    else:                                           # ragged, decreasing, empty rows
        lens = np.array([[5, 3, 9], [0, 0, 1], [4, 4, 4], [11, 2, 0]], np.int32)
        ends = lens.reshape(-1)
        stored = lens.max(axis=1)
    cache, block_table, keys, q, weights = paged_case(rng, stored, next_n)
    got = cpsparse.paged_mqa_logits(q, cache, weights, lens, block_table, width)
    assert_logits(got, paged_oracle(q, keys, weights, ends, width))


# ---------------------------------------------------------- topk_per_row -----

W_TOPK, K_TOPK = 40, 6
TOPK_ROW_BYTES = 8 * W_TOPK     # one row of the reference's [rows, W] uint64 key block


def topk_case(rng):
    """Rows of every kind; values outside each window are huge (never chosen)."""
    n, k = W_TOPK, K_TOPK
    nan, inf = np.nan, np.inf
    starts, ends, rows = [], [], []

    def add(start, values):
        row = np.full(n, 1e30, np.float32)
        row[start:start + len(values)] = values
        rows.append(row)
        starts.append(start)
        ends.append(start + len(values))

    add(3, [])                                                   # empty
    add(0, rng.integers(0, 5, n))                                # long, many ties
    add(5, rng.standard_normal(k))                               # len == k: shortcut
    add(10, [1.0, inf, -inf, nan, -2.0, -inf, nan, 0.5, -inf])   # long: -inf then NaN
    add(1, [0.0, -0.0, 0.0, -1.0, -0.0, 2.0, -0.0])              # -0.0 ties +0.0
    add(20, rng.standard_normal(2))                              # short
    add(0, np.full(n, nan))                                      # all NaN
    add(7, np.full(n - 7, 3.25))                                 # all equal
    add(2, rng.standard_normal(37))                              # long, distinct
    add(33, [nan, -inf, nan, -inf, 4.0, nan, -inf])              # long, mostly non-finite
    add(0, rng.integers(-2, 2, 9).astype(np.float32))            # long, ties
    add(30, rng.standard_normal(3))                              # short
    add(4, rng.standard_normal(30))                              # long
    add(11, [-inf] * 8)                                          # long, all -inf
    add(16, rng.integers(0, 3, 24))                              # long, ties, ends at n
    add(25, rng.standard_normal(k + 1))                          # long by one
    logits = np.array(rows, np.float32)
    return logits, np.array(starts, np.int32), np.array(ends, np.int32)


@pytest.mark.parametrize("budget", [1, TOPK_ROW_BYTES, 2 * TOPK_ROW_BYTES,
                                    3 * TOPK_ROW_BYTES + 7, 5 * TOPK_ROW_BYTES, DEFAULT])
def test_topk_per_row_chunks(monkeypatch, budget):
    set_budget(monkeypatch, ref_indexer, budget)
    logits, starts, ends = topk_case(np.random.default_rng(5))
    want = topk_oracle(logits, starts, ends, K_TOPK)
    got = cpsparse.topk_per_row(logits, starts, ends, K_TOPK)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    # Into rows of a shared buffer: the rows around stay untouched.
    m = logits.shape[0]
    buf = np.full((m + 3, K_TOPK), 777, np.int32)
    res = cpsparse.topk_per_row(logits, starts, ends, K_TOPK, out=buf[1:1 + m])
    np.testing.assert_array_equal(res, want)
    np.testing.assert_array_equal(buf[1:1 + m], want)
    np.testing.assert_array_equal(buf[[0, m + 1, m + 2]], 777)


@pytest.mark.parametrize("budget", [1, 2 * 8 * 16, 3 * 8 * 16])
@pytest.mark.parametrize("form", ["1d", "2d"])
def test_topk_per_row_decode_chunks(monkeypatch, budget, form):
    set_budget(monkeypatch, ref_indexer, budget)
    rng = np.random.default_rng(6)
    next_n, k, width = 2, 4, 16
    if form == "1d":
        lens = np.array([9, 1, 15, 4, 6, 16], np.int32)
        ends = np.maximum(lens[:, None] - next_n + np.arange(next_n) + 1, 0).reshape(-1)
    else:
        lens = np.array([[9, 3], [0, 16], [7, 5], [12, 12], [2, 10], [16, 0]], np.int32)
        ends = lens.reshape(-1)
    rows = lens.shape[0] * next_n
    logits = rng.integers(-3, 4, (rows, width)).astype(np.float32)     # ties
    logits[rng.random((rows, width)) < 0.1] = np.nan
    logits[rng.random((rows, width)) < 0.1] = -np.inf
    want = topk_oracle(logits, np.zeros(rows, np.int64), ends, k)
    got = cpsparse.topk_per_row_decode(logits, lens, next_n, k)
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------- sparse_mla_attention ----

def sparse_indices(rng, tokens, topk, num_slots):
    idx = rng.integers(-1, num_slots, (tokens, topk))
    idx[1, :] = 3                                  # one slot, topk times
    idx[4, :] = -1                                 # no valid index: out 0, lse -inf
    idx[5, 2:] = -1                                # two valid
    idx[6, 3] = idx[6, 1] = 7                      # a repeat among others
    idx[tokens - 1, :] = rng.permutation(num_slots)[:topk]   # last token fully valid
    return idx.astype(np.int32)


@pytest.mark.parametrize("chunk_tokens", [1, 2, 3, 4, None])
def test_sparse_mla_attention_dense_workspace(monkeypatch, chunk_tokens):
    tokens, heads, dqk, d_v, slots, topk = 9, 3, 40, 24, 30, 7
    set_budget(monkeypatch, ref_attention,
               DEFAULT if chunk_tokens is None else chunk_tokens * 8 * topk * (dqk + heads))
    rng = np.random.default_rng(7)
    q = rng.standard_normal((tokens, heads, dqk)).astype(np.float32)
    kv = rng.standard_normal((slots, dqk)).astype(np.float32)
    indices = sparse_indices(rng, tokens, topk, slots)
    sm_scale = 1.5 * dqk ** -0.5
    got = cpsparse.sparse_mla_attention(q, kv, indices, sm_scale, d_v=d_v)
    want = sparse_oracle(q, lambda sel: kv[sel].astype(np.float64), indices, sm_scale, d_v)
    assert_attention(got, want)
    assert (got[1][4] == -np.inf).all() and (got[0][4] == 0).all()


@pytest.mark.parametrize("chunk_tokens", [1, 2, 3, None])
@pytest.mark.parametrize("form", ["cache", "raw"])
def test_sparse_mla_attention_fp8_cache(monkeypatch, chunk_tokens, form):
    lora, rope, block_size, num_blocks = 128, 16, 4, 7
    tokens, heads, topk = 8, 2, 6
    dqk = lora + rope
    set_budget(monkeypatch, ref_attention,
               DEFAULT if chunk_tokens is None else chunk_tokens * 8 * topk * (dqk + heads))
    rng = np.random.default_rng(8)
    cache = cpsparse.MLAKVCache(num_blocks=num_blocks, block_size=block_size,
                                kv_lora_rank=lora, rope_dim=rope)
    slots = num_blocks * block_size
    cache.insert(rng.standard_normal((slots, lora)).astype(np.float32),
                 rng.standard_normal((slots, rope)).astype(np.float32),
                 rng.permutation(slots).astype(np.int32))
    table = decode_mla_records(cache.data.reshape(slots, -1), lora, rope)
    # The own decode agrees with the cache's (so the oracle reads what the op reads).
    np.testing.assert_array_equal(table, cache.gather(np.arange(slots, dtype=np.int32)))
    q = rng.standard_normal((tokens, heads, dqk)).astype(np.float32)
    indices = sparse_indices(rng, tokens, topk, slots)
    sm_scale = dqk ** -0.5
    kv_cache = cache if form == "cache" else cache.data
    got = cpsparse.sparse_mla_attention(q, kv_cache, indices, sm_scale)   # d_v = lora
    want = sparse_oracle(q, lambda sel: table[sel], indices, sm_scale, lora)
    assert_attention(got, want)


# ---------------------------------------------------- dense_mla_attention ----

@pytest.mark.parametrize("budget", [1, 8 * 2 * 12 * 2, 8 * 2 * 12 * 3, DEFAULT])
def test_dense_mla_attention_requests(monkeypatch, budget):
    set_budget(monkeypatch, ref_attention, budget)
    rng = np.random.default_rng(9)
    heads, dqk, d_v = 2, 24, 16
    shapes = [(5, 9), (1, 1), (7, 7), (0, 3), (3, 12), (4, 6), (2, 2)]   # (q_len, k_len)
    cu_q = np.cumsum([0] + [s[0] for s in shapes]).astype(np.int32)
    cu_k = np.cumsum([0] + [s[1] for s in shapes]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), heads, dqk)).astype(np.float32)
    kv = rng.standard_normal((int(cu_k[-1]), dqk)).astype(np.float32)
    sm_scale = 1.3 * dqk ** -0.5
    got = cpsparse.dense_mla_attention(q, kv, sm_scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                       d_v=d_v)
    assert_attention(got, dense_oracle(q, kv, sm_scale, d_v, cu_q, cu_k))


@pytest.mark.parametrize("budget", [1, 8 * 3 * 10 * 4])
def test_dense_mla_attention_single_request(monkeypatch, budget):
    set_budget(monkeypatch, ref_attention, budget)
    rng = np.random.default_rng(10)
    q = rng.standard_normal((6, 3, 72)).astype(np.float32)
    kv = rng.standard_normal((10, 72)).astype(np.float32)
    got = cpsparse.dense_mla_attention(q, kv, 0.1)                        # d_v = 72 - 64
    assert_attention(got, dense_oracle(q, kv, 0.1, 8, [0, 6], [0, 10]))


# ------------------------------------------- the budget really splits work ----

def count_calls(monkeypatch, module, name):
    """Wrap ``module.name`` to count its calls (skip if the helper is gone)."""
    fn = getattr(module, name, None)
    if fn is None:
        pytest.skip(f"{module.__name__}.{name} no longer exists")
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_small_budget_makes_many_chunks(monkeypatch):
    """Guard: the budgets used above do split the work (else these tests prove nothing)."""
    set_budget(monkeypatch, ref_indexer, 1)
    set_budget(monkeypatch, ref_attention, 1)
    rng = np.random.default_rng(11)

    scored = count_calls(monkeypatch, ref_indexer, "_score_block")
    q, k, k_scales, weights = indexer_inputs(rng, 6, 8)
    cpsparse.mqa_logits(q, k, k_scales, weights, np.zeros(6, np.int32),
                        np.arange(3, 9, dtype=np.int32))
    assert len(scored) >= 6          # one chunk per row

    keyed = count_calls(monkeypatch, ref_indexer, "order_keys")
    cpsparse.topk_per_row(rng.standard_normal((5, 9)).astype(np.float32),
                          np.zeros(5, np.int32), np.full(5, 9, np.int32), 2)
    assert len(keyed) >= 5

    softmaxes = count_calls(monkeypatch, ref_attention, "_softmax_rows")
    qa = rng.standard_normal((4, 1, 72)).astype(np.float32)
    kva = rng.standard_normal((5, 72)).astype(np.float32)
    cpsparse.sparse_mla_attention(qa, kva, np.zeros((4, 2), np.int32), 0.1)
    assert len(softmaxes) >= 4
    cpsparse.dense_mla_attention(qa, kva, 0.1)
    assert len(softmaxes) >= 8
