"""Batch metadata (cpsparse.metadata): the contract of DESIGN sections 7 and 8.

Every expectation below is recomputed by hand (plain loops over requests), not
read back from the code under test:

* decode/prefill split: a request is a decode when query_len <= next_n;
  decodes come first, otherwise ValueError naming the request;
* slot mapping, positions and request ids of every new token;
* prefill chunks: causal windows in the gathered keys, the logits byte budget,
  exact in-order coverage of the prefill tokens, splitting one long request;
* decode rows with padding (query_len < next_n);
* the MLA side: its own decode threshold, prefill.max_seq_len (context
  included), use_dense_mha = max_seq_len <= index_topk;
* the forward context.
"""

import dataclasses

import numpy as np
import pytest

from cpsparse.cache import IndexerKCache
from cpsparse.indexer import decode_row_ends
from cpsparse.metadata import (DEFAULT_LOGITS_BUDGET_BYTES, ForwardContext, build_batch,
                               decodes_first_order, get_forward_context, set_forward_context)

BS = 16
TOPK = 64


# ---------------------------------------------------------------- helpers ----

def shuffled_table(rng, seq_lens, block_size=BS, extra_cols=1):
    """A block table whose pages are a random permutation (no two requests share a page)."""
    seq_lens = np.asarray(seq_lens)
    need = -(-seq_lens // block_size)
    cols = int(need.max(initial=0)) + extra_cols
    num_blocks = max(1, int(need.sum()))
    perm = rng.permutation(num_blocks + 3)          # a few unused page ids too
    table = np.full((len(seq_lens), cols), 10_000, dtype=np.int32)   # unused columns: junk
    used = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[used:used + n]
        used += n
    return table, num_blocks + 3


def hand_tokens(query_lens, context_lens, table, block_size=BS):
    """(slots, positions, req_ids) by a plain loop over requests and tokens."""
    slots, positions, req_ids = [], [], []
    for r, (q, c) in enumerate(zip(query_lens, context_lens)):
        for i in range(q):
            p = c + i
            slots.append(int(table[r, p // block_size]) * block_size + p % block_size)
            positions.append(p)
            req_ids.append(r)
    return slots, positions, req_ids


def build(query_lens, context_lens, table, **kw):
    kw.setdefault("block_size", BS)
    kw.setdefault("index_topk", TOPK)
    return build_batch(query_lens, context_lens, table, **kw)


def prefill_chunks_check(meta, query_lens, context_lens, budget):
    """Checks every prefill chunk against the hand rules; returns the chunks."""
    q = list(query_lens)
    c = list(context_lens)
    nd = meta.num_decodes
    starts = np.concatenate([[0], np.cumsum(q)])
    # token -> (request, query index)
    owner = {}
    for r in range(nd, len(q)):
        for i in range(q[r]):
            owner[int(starts[r]) + i] = (r, i)
    chunks = meta.prefill.chunks if meta.prefill is not None else []
    expected_next = meta.num_decode_tokens
    for chunk in chunks:
        # contiguous, in order, no gap and no overlap
        assert chunk.token_start == expected_next
        assert chunk.token_end > chunk.token_start
        expected_next = chunk.token_end
        tokens = chunk.token_end - chunk.token_start
        assert chunk.num_tokens == tokens
        assert chunk.logits_bytes == 4 * tokens * chunk.num_keys
        assert 4 * tokens * chunk.num_keys <= budget or tokens == 1, (
            f"chunk [{chunk.token_start}, {chunk.token_end}) with {chunk.num_keys} keys "
            f"needs {4 * tokens * chunk.num_keys} bytes > budget {budget}")
        ks, ke = np.asarray(chunk.ks), np.asarray(chunk.ke)
        cu = np.asarray(chunk.cu_seq_lens)
        assert ks.dtype == np.int32 and ke.dtype == np.int32 and cu.dtype == np.int32
        assert ks.shape == ke.shape == (tokens,)
        assert cu[0] == 0 and cu[-1] == chunk.num_keys
        # the requests in the chunk, in order, and the keys gathered for each
        reqs = []
        for t in range(chunk.token_start, chunk.token_end):
            r, _ = owner[t]
            if not reqs or reqs[-1] != r:
                reqs.append(r)
        assert cu.shape == (len(reqs) + 1,)
        np.testing.assert_array_equal(np.asarray(chunk.block_table),
                                      np.asarray(meta.block_table)[reqs])
        off = 0
        for n, r in enumerate(reqs):
            toks = [t for t in range(chunk.token_start, chunk.token_end) if owner[t][0] == r]
            last_i = owner[toks[-1]][1]
            # only the keys up to the request's last query in the chunk are gathered
            assert cu[n] == off
            assert cu[n + 1] - cu[n] == c[r] + last_i + 1
            for t in toks:
                i = owner[t][1]
                j = t - chunk.token_start
                assert ks[j] == off, (t, ks[j], off)
                assert ke[j] == off + c[r] + i + 1, (t, ke[j], off + c[r] + i + 1)
            off += c[r] + last_i + 1
        assert off == chunk.num_keys
    assert expected_next == meta.num_tokens
    return chunks


# ------------------------------------------------- decode / prefill split ----

@pytest.mark.parametrize("query_lens, next_n, num_decodes", [
    ([1, 1, 5, 3], 1, 2),
    ([1, 2, 1, 5, 3], 2, 3),        # 2 <= next_n=2 is a decode, 3 > 2 is not
    ([4, 3, 4, 5], 4, 3),
    ([7, 9], 1, 0),
    ([1, 1, 1], 1, 3),
    ([2, 2], 1, 0),                 # query_len 2 > next_n 1: prefills
])
def test_decode_prefill_split(query_lens, next_n, num_decodes):
    ctx = [10 + 3 * r for r in range(len(query_lens))]
    seq = np.add(query_lens, ctx)
    table, _ = shuffled_table(np.random.default_rng(0), seq)
    meta = build(query_lens, ctx, table, next_n=next_n)
    dec_tokens = sum(query_lens[:num_decodes])
    assert meta.num_reqs == len(query_lens)
    assert meta.num_tokens == sum(query_lens)
    assert meta.num_decodes == num_decodes
    assert meta.num_prefills == len(query_lens) - num_decodes
    assert meta.num_decode_tokens == dec_tokens
    assert meta.num_prefill_tokens == sum(query_lens) - dec_tokens
    assert (meta.decode is None) == (num_decodes == 0)
    assert (meta.prefill is None) == (num_decodes == len(query_lens))
    if meta.decode is not None:
        assert meta.decode.next_n == next_n
        np.testing.assert_array_equal(np.asarray(meta.decode.block_table),
                                      table[:num_decodes])
    if meta.prefill is not None:
        assert meta.prefill.chunks[0].token_start == dec_tokens
        assert meta.prefill.chunks[-1].token_end == sum(query_lens)


@pytest.mark.parametrize("query_lens, next_n, bad", [
    ([1, 5, 1], 1, 2),
    ([5, 1], 1, 1),
    ([1, 1, 6, 7, 2, 9], 2, 4),     # 2 <= next_n=2 after a prefill
    ([3, 4, 0], 2, 2),              # an empty request counts as a decode too
])
def test_decode_after_prefill_raises_naming_the_request(query_lens, next_n, bad):
    ctx = [5] * len(query_lens)
    table, _ = shuffled_table(np.random.default_rng(1), np.add(query_lens, ctx))
    with pytest.raises(ValueError, match=rf"request {bad}\b") as info:
        build(query_lens, ctx, table, next_n=next_n)
    assert "decode" in str(info.value)
    # the order from decodes_first_order is accepted
    order = decodes_first_order(query_lens, next_n=next_n)
    q2 = list(np.asarray(query_lens)[order])
    meta = build(q2, ctx, table[order], next_n=next_n)
    assert meta.num_decodes == sum(1 for q in query_lens if q <= next_n)


def test_decodes_first_order():
    np.testing.assert_array_equal(decodes_first_order([5, 1, 7, 1], next_n=1), [1, 3, 0, 2])
    np.testing.assert_array_equal(decodes_first_order([3, 2, 1, 4, 2], next_n=2),
                                  [1, 2, 4, 0, 3])
    np.testing.assert_array_equal(decodes_first_order([1, 1], next_n=1), [0, 1])
    rng = np.random.default_rng(2)
    for _ in range(20):
        next_n = int(rng.integers(1, 5))
        q = rng.integers(0, 9, size=int(rng.integers(1, 12)))
        order = np.asarray(decodes_first_order(q, next_n=next_n))
        assert sorted(order.tolist()) == list(range(q.size))        # a permutation
        is_dec = q[order] <= next_n
        nd = int(is_dec.sum())
        assert is_dec[:nd].all() and not is_dec[nd:].any()           # decodes first
        # stable inside each group
        assert (np.diff(order[:nd]) > 0).all() and (np.diff(order[nd:]) > 0).all()


# ------------------------------------------- slots, positions, request ids ----

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slot_mapping_positions_req_ids_by_hand(seed):
    rng = np.random.default_rng(seed)
    next_n = int(rng.integers(1, 4))
    nd = int(rng.integers(0, 4))
    npf = int(rng.integers(1, 4))
    q = list(rng.integers(1, next_n + 1, size=nd)) + list(rng.integers(next_n + 1, 60, size=npf))
    ctx = list(rng.integers(0, 90, size=nd + npf))
    q, ctx = [int(v) for v in q], [int(v) for v in ctx]
    table, _ = shuffled_table(rng, np.add(q, ctx), extra_cols=2)
    meta = build(q, ctx, table, next_n=next_n)
    slots, positions, req_ids = hand_tokens(q, ctx, table)
    for name, got, want in (("slot_mapping", meta.slot_mapping, slots),
                            ("positions", meta.positions, positions),
                            ("req_ids", meta.req_ids, req_ids)):
        assert got.dtype == np.int32, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert len(set(slots)) == len(slots)           # distinct pages -> distinct slots
    np.testing.assert_array_equal(meta.query_start_loc, np.concatenate([[0], np.cumsum(q)]))
    np.testing.assert_array_equal(meta.seq_lens, np.add(q, ctx))
    np.testing.assert_array_equal(meta.context_lens, ctx)
    np.testing.assert_array_equal(meta.query_lens, q)
    np.testing.assert_array_equal(meta.last_token_rows, np.cumsum(q) - 1)


def test_slot_mapping_example_from_pages():
    table = np.array([[7, 3, 11], [2, 9, 0]], dtype=np.int32)
    meta = build([1, 3], [17, 14], table, block_size=BS)
    # request 0: position 17 -> page table[0, 1] = 3, offset 1
    # request 1: positions 14, 15 (page 2), 16 (page 9, offset 0)
    np.testing.assert_array_equal(meta.slot_mapping,
                                  [3 * 16 + 1, 2 * 16 + 14, 2 * 16 + 15, 9 * 16])
    np.testing.assert_array_equal(meta.positions, [17, 14, 15, 16])
    np.testing.assert_array_equal(meta.req_ids, [0, 1, 1, 1])


# ------------------------------------------------------- prefill windows ----

def test_causal_windows_single_chunk():
    q = [1, 2, 5, 3, 7]
    ctx = [30, 4, 0, 12, 40]
    table, _ = shuffled_table(np.random.default_rng(3), np.add(q, ctx))
    meta = build(q, ctx, table, next_n=2)
    assert meta.num_decodes == 2
    chunks = prefill_chunks_check(meta, q, ctx, DEFAULT_LOGITS_BUDGET_BYTES)
    assert len(chunks) == 1
    chunk = chunks[0]
    # by hand: requests 2, 3, 4 gathered back to back (5, 15, 47 keys)
    np.testing.assert_array_equal(chunk.cu_seq_lens, [0, 5, 20, 67])
    np.testing.assert_array_equal(chunk.ks, [0] * 5 + [5] * 3 + [20] * 7)
    np.testing.assert_array_equal(chunk.ke, [1, 2, 3, 4, 5, 18, 19, 20,
                                             61, 62, 63, 64, 65, 66, 67])


def test_windows_point_at_the_right_gathered_keys():
    """Gather keys tagged with (request, position) and read them through ks/ke."""
    rng = np.random.default_rng(4)
    q = [1, 9, 20, 6]
    ctx = [25, 17, 0, 33]
    seq = np.add(q, ctx)
    table, num_blocks = shuffled_table(rng, seq)
    table[table == 10_000] = 0                      # unused columns: any valid page
    cache = IndexerKCache(num_blocks, block_size=BS, head_dim=128)
    for r, n in enumerate(seq):
        pos = np.arange(n)
        codes = np.zeros((n, 128), np.uint8)
        codes[:, 0] = r
        codes[:, 1] = pos % 256
        codes[:, 2] = pos // 256
        slots = (table[r, pos // BS] * BS + pos % BS).astype(np.int32)
        cache.insert_quantized(codes, np.ones(n, np.float32), slots)
    for budget in (DEFAULT_LOGITS_BUDGET_BYTES, 4 * 8 * 40):
        meta = build(q, ctx, table, next_n=1, logits_budget_bytes=budget)
        _, positions, req_ids = hand_tokens(q, ctx, table)
        for chunk in prefill_chunks_check(meta, q, ctx, budget):
            codes, _ = cache.gather(chunk.block_table, chunk.cu_seq_lens)
            assert codes.shape[0] == chunk.num_keys
            for j, t in enumerate(range(chunk.token_start, chunk.token_end)):
                window = codes[chunk.ks[j]:chunk.ke[j]]
                assert window.shape[0] == positions[t] + 1
                assert (window[:, 0] == req_ids[t]).all()
                got_pos = window[:, 1].astype(int) + 256 * window[:, 2].astype(int)
                np.testing.assert_array_equal(got_pos, np.arange(positions[t] + 1))


# -------------------------------------------------------------- chunking ----

@pytest.mark.parametrize("seed", range(6))
def test_chunking_under_budget(seed):
    rng = np.random.default_rng(100 + seed)
    npf = int(rng.integers(2, 7))
    nd = int(rng.integers(0, 3))
    q = [1] * nd + [int(v) for v in rng.integers(2, 70, size=npf)]
    ctx = [int(v) for v in rng.integers(0, 80, size=nd + npf)]
    table, _ = shuffled_table(rng, np.add(q, ctx))
    sizes = [4 * a * (a + b) for a, b in zip(q[nd:], ctx[nd:])]
    for budget in (min(sizes) // 3 + 1, max(sizes), sum(sizes), 4 * 40 * 60, 100):
        meta = build(q, ctx, table, next_n=1, logits_budget_bytes=budget)
        chunks = prefill_chunks_check(meta, q, ctx, budget)
        assert sum(ch.num_tokens for ch in chunks) == sum(q[nd:])


def test_chunking_groups_requests_when_they_fit():
    q, ctx = [10, 10, 10], [0, 0, 0]
    table, _ = shuffled_table(np.random.default_rng(5), np.add(q, ctx))
    # 4 * 20 tokens * 20 keys = 1600 fits two requests, not three (4 * 30 * 30 = 3600)
    meta = build(q, ctx, table, logits_budget_bytes=1600)
    chunks = prefill_chunks_check(meta, q, ctx, 1600)
    assert [(c.token_start, c.token_end) for c in chunks] == [(0, 20), (20, 30)]
    meta = build(q, ctx, table)
    assert len(meta.prefill.chunks) == 1


def test_single_long_request_split_along_queries():
    q, ctx = [200], [50]
    table, _ = shuffled_table(np.random.default_rng(6), [250])
    budget = 4 * 30 * 250                  # far below 4 * 200 * 250
    meta = build(q, ctx, table, logits_budget_bytes=budget)
    chunks = prefill_chunks_check(meta, q, ctx, budget)
    assert len(chunks) > 1
    for chunk in chunks:
        assert np.asarray(chunk.block_table).shape[0] == 1
        np.testing.assert_array_equal(chunk.ks, 0)
        np.testing.assert_array_equal(chunk.ke, 50 + np.arange(chunk.token_start,
                                                               chunk.token_end) + 1)
        assert chunk.num_keys == 50 + chunk.token_end     # keys up to its last query


def test_budget_below_one_row_gives_single_row_chunks():
    q, ctx = [6, 5], [30, 0]
    table, _ = shuffled_table(np.random.default_rng(7), np.add(q, ctx))
    meta = build(q, ctx, table, logits_budget_bytes=8)      # < 4 * 1 * 31
    chunks = prefill_chunks_check(meta, q, ctx, 8)
    assert len(chunks) == 11
    assert all(c.num_tokens == 1 for c in chunks)


# ---------------------------------------------------------------- decode ----

def test_decode_metadata_uniform():
    q, ctx = [2, 2, 2, 40], [10, 0, 75, 3]
    table, _ = shuffled_table(np.random.default_rng(8), np.add(q, ctx))
    meta = build(q, ctx, table, next_n=2)
    d = meta.decode
    assert meta.num_decodes == 3 and meta.num_decode_tokens == 6
    assert not d.requires_padding
    assert d.next_n == 2
    assert d.max_context_len == 77
    np.testing.assert_array_equal(d.context_lens, [12, 2, 77])      # full lengths
    assert np.asarray(d.context_lens).dtype == np.int32
    np.testing.assert_array_equal(d.token_rows, np.arange(6))
    # row (b, j) sees positions < ctx + j + 1, i.e. its own position included
    ends = decode_row_ends(np.asarray(d.context_lens), 2)
    np.testing.assert_array_equal(ends[d.token_rows], np.asarray(meta.positions[:6]) + 1)


@pytest.mark.parametrize("next_n, q_dec", [(3, [3, 1, 2]), (4, [2, 4, 1, 3]), (2, [1, 2, 1])])
def test_decode_metadata_with_padding(next_n, q_dec):
    rng = np.random.default_rng(9)
    ctx_dec = [int(v) for v in rng.integers(0, 100, size=len(q_dec))]
    q = q_dec + [20]
    ctx = ctx_dec + [7]
    table, _ = shuffled_table(rng, np.add(q, ctx))
    meta = build(q, ctx, table, next_n=next_n)
    d = meta.decode
    b = len(q_dec)
    assert d.requires_padding
    lens = np.asarray(d.context_lens)
    assert lens.shape == (b, next_n) and lens.dtype == np.int32
    rows = []
    for r in range(b):
        for j in range(next_n):
            if j < q_dec[r]:
                assert lens[r, j] == ctx_dec[r] + j + 1, (r, j)
                rows.append(r * next_n + j)
            else:
                assert lens[r, j] == 0, (r, j)        # padding rows see nothing
    np.testing.assert_array_equal(d.token_rows, rows)
    np.testing.assert_array_equal(d.token_rows_host, rows)
    assert d.max_context_len == max(a + c for a, c in zip(q_dec, ctx_dec))
    ends = decode_row_ends(lens, next_n)
    nd = meta.num_decode_tokens
    np.testing.assert_array_equal(ends[np.asarray(d.token_rows)],
                                  np.asarray(meta.positions[:nd]) + 1)


def test_decode_only_batch_has_no_prefill():
    meta = build([1, 1], [30, 90], np.arange(14, dtype=np.int32).reshape(2, 7))
    assert meta.prefill is None and meta.mla.prefill is None
    assert meta.mla.num_decode_tokens == 2 and meta.mla.num_prefills == 0


# ------------------------------------------------------------ MLA side -----

def test_mla_own_decode_threshold_larger():
    q, ctx = [1, 3, 10], [5, 5, 5]
    table, _ = shuffled_table(np.random.default_rng(10), np.add(q, ctx))
    meta = build(q, ctx, table, next_n=1, mla_decode_threshold=4)
    assert meta.num_decodes == 1 and meta.num_decode_tokens == 1      # the indexer's split
    m = meta.mla
    assert m.decode_threshold == 4
    assert (m.num_decodes, m.num_decode_tokens) == (2, 4)
    assert (m.num_prefills, m.num_prefill_tokens) == (1, 10)
    assert m.prefill.max_seq_len == 15


def test_mla_own_decode_threshold_smaller():
    q, ctx = [3, 1, 10], [100, 2, 0]
    table, _ = shuffled_table(np.random.default_rng(11), np.add(q, ctx))
    meta = build(q, ctx, table, next_n=4, mla_decode_threshold=1)
    assert meta.num_decodes == 2 and meta.num_decode_tokens == 4
    m = meta.mla
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills) == (0, 0, 3)
    assert m.prefill.max_seq_len == 103
    assert m.prefill.use_dense_mha is False


def test_mla_threshold_defaults_to_next_n():
    q, ctx = [2, 2, 30], [4, 4, 0]
    table, _ = shuffled_table(np.random.default_rng(12), np.add(q, ctx))
    meta = build(q, ctx, table, next_n=2)
    assert meta.mla.decode_threshold == 2
    assert meta.mla.num_decodes == 2 and meta.mla.num_decode_tokens == 4


def test_mla_max_seq_len_includes_context_excludes_decodes():
    q, ctx = [1, 10, 20], [100, 60, 0]
    table, _ = shuffled_table(np.random.default_rng(13), np.add(q, ctx))
    meta = build(q, ctx, table)
    # the decode (length 101) is not a prefill; request 1 is 60 + 10 = 70 long
    assert meta.mla.prefill.max_seq_len == 70
    assert meta.mla.prefill.use_dense_mha is False
    meta = build([1, 30], [200, 0], np.arange(30, dtype=np.int32).reshape(2, 15))
    assert meta.mla.prefill.max_seq_len == 30
    assert meta.mla.prefill.use_dense_mha is True
    assert meta.mla.num_decode_tokens == 1


@pytest.mark.parametrize("q, ctx, dense", [
    ([64], [0], True), ([65], [0], False),
    ([10], [54], True), ([10], [55], False),          # context counts
    ([40, 64], [0, 0], True), ([40, 64], [25, 1], False),
    ([2, 64], [0, 0], True),
])
def test_use_dense_mha_boundary(q, ctx, dense):
    table = np.arange(5 * len(q), dtype=np.int32).reshape(len(q), 5)
    meta = build(q, ctx, table, index_topk=64)
    assert meta.mla.prefill.max_seq_len == max(a + b for a, b in zip(q, ctx))
    assert meta.mla.prefill.use_dense_mha is dense
    assert meta.index_topk == 64


# ------------------------------------------------------- forward context ----

def test_forward_context_maps_every_layer_and_nests():
    meta = build([3], [0], np.zeros((1, 1), np.int32), index_topk=8)
    ctx = ForwardContext.for_layers(meta, ["a", "b"])
    assert ctx.batch is meta
    assert set(ctx.attn_metadata) == {"a", "b"}
    assert ctx.attn_metadata["a"] is meta.mla and ctx.attn_metadata["b"] is meta.mla
    other = ForwardContext(batch=meta, attn_metadata={
        "a": dataclasses.replace(meta.mla, num_decode_tokens=1)})
    with pytest.raises(RuntimeError):
        get_forward_context()
    with set_forward_context(ctx) as got:
        assert got is ctx and get_forward_context() is ctx
        with set_forward_context(other):
            assert get_forward_context() is other
        assert get_forward_context() is ctx
        with pytest.raises(KeyError):
            with set_forward_context(other):
                raise KeyError("boom")
        assert get_forward_context() is ctx
    with pytest.raises(RuntimeError):
        get_forward_context()


# ------------------------------------------------------------ validation ----

def test_build_batch_validation():
    table = np.zeros((2, 2), np.int32)
    with pytest.raises(ValueError, match="R"):
        build([1, 2, 3], [0, 0], table)
    with pytest.raises(ValueError, match="R"):
        build([1, 2], [0, 0, 0], table)
    with pytest.raises(ValueError, match=">= 0"):
        build([1, -2], [0, 0], table)
    with pytest.raises(ValueError, match="block_table"):
        build([1, 30], [0, 5], table)                 # 35 tokens need 3 pages of 16
    with pytest.raises(ValueError, match="next_n"):
        build([1, 2], [0, 0], table, next_n=0)
    with pytest.raises(ValueError, match="logits_budget_bytes"):
        build([1, 2], [0, 0], table, logits_budget_bytes=0)
    with pytest.raises(ValueError, match="mla_decode_threshold"):
        build([1, 2], [0, 0], table, mla_decode_threshold=0)
    with pytest.raises((TypeError, ValueError), match="block_table"):
        build([1, 2], [0, 0], table.astype(np.float32))
