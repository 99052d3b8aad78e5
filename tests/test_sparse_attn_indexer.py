"""sparse_attn_indexer, the orchestration of DESIGN section 7, driven directly.

Inputs are random indexer queries (quantized with cpsparse.quantize_fp8, head
weights folded with cpsparse.fold_weights) and random keys in an IndexerKCache.
The oracle scores every token's visible keys from scratch (float64, the e4m3
codes decoded with ml_dtypes), so it shares no code with the scoring under test;
top-k rows are then held to the set test of DESIGN section 6.
"""

import dataclasses
import re

import ml_dtypes
import numpy as np
import pytest

import cpsparse
import cpsparse.indexer as indexer_mod
import cpsparse.sparse_attn_indexer as sai_mod
from cpsparse import _backend
from cpsparse.cache import IndexerKCache
from cpsparse.indexer import IndexerStats, sparse_attn_indexer
from cpsparse.metadata import ForwardContext, build_batch, set_forward_context

H, D, BS, K = 8, 128, 16, 64
NAME = "layers.0.attn"
SENTINEL = 12345


# ---------------------------------------------------------------- helpers ----

class Problem:
    """A batch of requests: every key of every request, its cache and table."""

    def __init__(self, query_lens, context_lens, *, seed=0, next_n=1, extra_blocks=2,
                 **build_kw):
        rng = np.random.default_rng(seed)
        self.q_lens = [int(v) for v in query_lens]
        self.ctx = [int(v) for v in context_lens]
        self.seq = [a + b for a, b in zip(self.q_lens, self.ctx)]
        need = [-(-s // BS) for s in self.seq]
        self.num_blocks = sum(need) + extra_blocks
        perm = rng.permutation(self.num_blocks)
        cols = max(need) + 1
        self.table = np.zeros((len(self.seq), cols), np.int32)
        used = 0
        for r, n in enumerate(need):
            self.table[r, :n] = perm[used:used + n]
            self.table[r, n:] = perm[-1]               # valid but unused
            used += n
        # all keys of every request (context and new), float32 [seq, D]
        self.keys = [(rng.standard_normal((s, D)) * rng.uniform(0.5, 2.0)).astype(np.float32)
                     for s in self.seq]
        self.meta = build_batch(self.q_lens, self.ctx, self.table, next_n=next_n,
                                block_size=BS, index_topk=K, **build_kw)
        t = self.meta.num_tokens
        q = rng.standard_normal((t, H, D)).astype(np.float32)
        q *= rng.uniform(0.1, 3.0, size=(t, H, 1)).astype(np.float32)
        self.q_codes, q_scales = cpsparse.quantize_fp8(q, eps=1e-10)
        raw_w = rng.standard_normal((t, H)).astype(np.float32)
        self.weights = cpsparse.fold_weights(raw_w, q_scales[..., 0], D)
        self.new_keys = np.concatenate(
            [self.keys[r][self.ctx[r]:] for r in range(len(self.seq))]) if t else \
            np.zeros((0, D), np.float32)
        self.rng = rng

    def cache_with_context(self):
        """A cache holding every request's context keys (not the new ones)."""
        cache = IndexerKCache(self.num_blocks, block_size=BS, head_dim=D)
        for r, c in enumerate(self.ctx):
            if c:
                pos = np.arange(c)
                slots = (self.table[r, pos // BS] * BS + pos % BS).astype(np.int32)
                cache.insert(self.keys[r][:c], slots)
        return cache

    def rebuild(self, **kw):
        kw.setdefault("block_size", BS)
        kw.setdefault("index_topk", K)
        return build_batch(self.q_lens, self.ctx, self.table, **kw)

    def run(self, *, meta=None, cache=None, buf=None, rows=None, **kw):
        meta = self.meta if meta is None else meta
        cache = self.cache_with_context() if cache is None else cache
        if buf is None:
            buf = np.full((rows or meta.num_tokens + 5, K), SENTINEL, np.int32)
        stats = kw.pop("stats", None) or IndexerStats()
        out = sparse_attn_indexer(self.q_codes, self.weights, self.new_keys, cache, meta,
                                  buf, stats=stats, **kw)
        assert out is buf
        return buf, cache, stats

    # -- the independent oracle --

    def scores(self, t):
        """float64 scores of token t over positions [0, p] of its request."""
        r = int(self.meta.req_ids[t])
        p = int(self.meta.positions[t])
        k_codes, k_scales = cpsparse.quantize_fp8(self.keys[r][:p + 1])   # ue8m0, eps 1e-4
        k8 = k_codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        q8 = self.q_codes[t].view(ml_dtypes.float8_e4m3fn).astype(np.float64)   # [H, D]
        dots = np.maximum(q8 @ k8.T, 0.0)                                         # [H, n]
        return k_scales[:, 0].astype(np.float64) * (self.weights[t].astype(np.float64) @ dots)

    def check_rows(self, buf, tokens=None):
        tokens = range(self.meta.num_tokens) if tokens is None else tokens
        for t in tokens:
            check_topk_row(self.scores(t), buf[t], K, where=f"token {t}")

    def quantized_keys(self):
        """(codes, scales) every request's keys quantized as the cache stores them."""
        codes, scales = cpsparse.quantize_fp8(np.concatenate(self.keys))
        return codes, scales[:, 0]

    def gather_all(self, cache):
        cu = np.concatenate([[0], np.cumsum(self.seq)]).astype(np.int32)
        return cache.gather(self.table, cu)


def check_topk_row(scores, row, k, where=""):
    """DESIGN section 6 for one row whose window is [0, len(scores))."""
    n = scores.shape[0]
    row = np.asarray(row)
    if n <= k:
        np.testing.assert_array_equal(row[:n], np.arange(n), err_msg=where)
        np.testing.assert_array_equal(row[n:], -1, err_msg=where)
        return
    assert (row >= 0).all() and (row < n).all(), (where, row)
    assert np.unique(row).size == k, (where, "duplicate indices")
    chosen = np.zeros(n, bool)
    chosen[row] = True
    tol = 1e-5 * max(1e-30, np.abs(scores).max())
    assert scores[chosen].min() >= scores[~chosen].max() - tol, (
        where, scores[chosen].min(), scores[~chosen].max())


def same_sets(a, b):
    """Row-by-row equality of the selected sets (order free)."""
    np.testing.assert_array_equal(np.sort(a, axis=1), np.sort(b, axis=1))


def ctx_with(meta, name=NAME, **mla_changes):
    mla = meta.mla
    prefill_changes = {k: mla_changes.pop(k) for k in ("use_dense_mha", "max_seq_len")
                       if k in mla_changes}
    if prefill_changes:
        mla = dataclasses.replace(mla, prefill=dataclasses.replace(mla.prefill,
                                                                   **prefill_changes))
    mla = dataclasses.replace(mla, **mla_changes)
    return ForwardContext(batch=meta, attn_metadata={name: mla})


# -------------------------------------------------- rows vs the oracle -------

@pytest.mark.parametrize("q, ctx, next_n", [
    ([40, 90], [0, 0], 1),                       # one short, one long prefill
    ([1, 1, 30, 50], [100, 20, 50, 0], 1),       # decodes + prefills, with context
    ([2, 2, 70], [10, 80, 3], 2),
])
def test_rows_match_independent_scoring(q, ctx, next_n):
    p = Problem(q, ctx, seed=sum(q), next_n=next_n)
    buf, cache, stats = p.run()
    p.check_rows(buf)
    assert (buf[p.meta.num_tokens:] == SENTINEL).all()
    assert stats.calls == 1 and stats.skipped == 0 and stats.scored_calls == 1
    assert stats.decode_rows == p.meta.num_decode_tokens
    assert stats.prefill_rows == p.meta.num_prefill_tokens
    assert stats.inserted_keys == p.meta.num_tokens
    codes, scales = p.gather_all(cache)
    want_codes, want_scales = p.quantized_keys()
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scales, want_scales)


def test_rows_match_library_scoring_of_the_cache():
    """Same check, scores taken from cpsparse.mqa_logits over the gathered cache."""
    p = Problem([5, 80], [70, 10], seed=3)
    buf, cache, _ = p.run()
    for r in range(2):
        codes, scales = cache.gather(p.table[r:r + 1], np.array([0, p.seq[r]], np.int32))
        rows = np.flatnonzero(np.asarray(p.meta.req_ids) == r)
        pos = np.asarray(p.meta.positions)[rows]
        logits = cpsparse.mqa_logits(p.q_codes[rows], codes, scales, p.weights[rows],
                                     np.zeros(rows.size, np.int32), (pos + 1).astype(np.int32))
        for j, t in enumerate(rows):
            check_topk_row(logits[j, :pos[j] + 1].astype(np.float64), buf[t], K)
            np.testing.assert_allclose(logits[j, :pos[j] + 1], p.scores(t), rtol=1e-5,
                                       atol=1e-6 * np.abs(p.scores(t)).max())


@pytest.mark.parametrize("next_n, q_dec, ctx_dec", [
    (1, [1, 1, 1], [5, 70, 130]),
    (2, [2, 2], [60, 90]),
    (2, [1, 2, 1], [63, 100, 0]),               # padded
    (4, [4, 4], [61, 120]),
    (4, [3, 1, 4, 2], [62, 200, 10, 64]),        # padded, windows around k = 64
])
def test_decode_next_n(next_n, q_dec, ctx_dec):
    for with_prefill in (False, True):
        q = q_dec + ([40] if with_prefill else [])
        ctx = ctx_dec + ([30] if with_prefill else [])
        p = Problem(q, ctx, seed=next_n * 10 + len(q), next_n=next_n)
        assert p.meta.decode.requires_padding == any(v != next_n for v in q_dec)
        buf, _, stats = p.run()
        p.check_rows(buf)
        assert (buf[p.meta.num_tokens:] == SENTINEL).all()
        assert stats.decode_rows == sum(q_dec)


def test_chunked_prefill_equals_unchunked():
    p = Problem([1, 2, 30, 75, 20, 100], [90, 3, 40, 0, 10, 5], seed=11, next_n=2)
    full, _, s_full = p.run()
    tiny = p.rebuild(next_n=2, logits_budget_bytes=4 * 8 * 64)
    assert len(tiny.prefill.chunks) > len(p.meta.prefill.chunks) == 1
    chunked, _, s_chunk = p.run(meta=tiny)
    assert s_chunk.prefill_chunks == len(tiny.prefill.chunks) and s_full.prefill_chunks == 1
    same_sets(chunked, full)
    p.check_rows(chunked)


def test_mixed_batch_equals_each_request_alone():
    q, ctx = [1, 2, 25, 90], [80, 40, 45, 0]
    p = Problem(q, ctx, seed=12, next_n=2)
    buf, _, _ = p.run()
    starts = np.concatenate([[0], np.cumsum(q)])
    for r in range(len(q)):
        alone = build_batch([q[r]], [ctx[r]], p.table[r:r + 1], next_n=2, block_size=BS,
                            index_topk=K)
        cache = p.cache_with_context()                # same slots, same contents
        rows = slice(starts[r], starts[r + 1])
        one = np.full((q[r], K), SENTINEL, np.int32)
        sparse_attn_indexer(p.q_codes[rows], p.weights[rows], p.new_keys[rows], cache, alone,
                            one)
        same_sets(one, buf[rows])


# ------------------------------------------------------- the early return ----

def short_prefill(seed=20):
    """Prefill-only batch with every full length <= K: the MLA says use_dense_mha."""
    p = Problem([30, 20], [10, 0], seed=seed)
    assert p.meta.mla.prefill.use_dense_mha and p.meta.mla.num_decode_tokens == 0
    return p


def assert_fired(p, buf, cache, stats):
    assert stats.skipped == 1 and stats.scored_calls == 0
    assert stats.decode_rows == 0 and stats.prefill_rows == 0
    assert (buf == SENTINEL).all(), "the early return must leave the buffer untouched"
    codes, scales = p.gather_all(cache)             # ... but the keys are inserted
    want_codes, want_scales = p.quantized_keys()
    np.testing.assert_array_equal(codes, want_codes)
    np.testing.assert_array_equal(scales, want_scales)
    assert stats.inserted_keys == p.meta.num_tokens


def assert_not_fired(p, buf, stats):
    assert stats.skipped == 0 and stats.scored_calls == 1
    p.check_rows(buf)
    assert (buf[p.meta.num_tokens:] == SENTINEL).all()


def test_early_return_fires():
    p = short_prefill()
    buf, cache, stats = p.run(dense_mha_metadata_layer_name=NAME,
                              forward_context=ForwardContext.for_layers(p.meta, [NAME]))
    assert_fired(p, buf, cache, stats)


def test_early_return_reads_the_current_forward_context():
    p = short_prefill()
    with set_forward_context(ForwardContext.for_layers(p.meta, [NAME])):
        buf, cache, stats = p.run(dense_mha_metadata_layer_name=NAME)
    assert_fired(p, buf, cache, stats)
    # an explicit forward_context wins over the current one
    with set_forward_context(ForwardContext.for_layers(p.meta, [NAME])):
        buf, _, stats = p.run(dense_mha_metadata_layer_name=NAME,
                              forward_context=ctx_with(p.meta, use_dense_mha=False))
    assert_not_fired(p, buf, stats)


def test_early_return_off_for_empty_name():
    p = short_prefill()
    buf, _, stats = p.run(dense_mha_metadata_layer_name="",
                          forward_context=ForwardContext.for_layers(p.meta, [NAME]))
    assert_not_fired(p, buf, stats)


def test_name_not_in_forward_context_is_refused_not_a_silently_disabled_skip():
    p = short_prefill()
    cache = p.cache_with_context()
    before = cache.data.copy()
    buf = np.full((p.meta.num_tokens, K), SENTINEL, np.int32)
    with pytest.raises(ValueError, match="Invalid dense_mha_metadata_layer_name: "
                                         "'layers.7.attn' is not a layer"):
        p.run(cache=cache, buf=buf, dense_mha_metadata_layer_name="layers.7.attn",
              forward_context=ForwardContext.for_layers(p.meta, [NAME]))
    assert np.array_equal(cache.data, before) and (buf == SENTINEL).all()


def _bad_indexer_calls(p):
    """(what, kwargs overriding a valid call, error, message) for every argument."""
    t = p.meta.num_tokens
    other_bs = build_batch(p.q_lens, p.ctx, np.repeat(p.table, 2, axis=1), block_size=BS // 2,
                           index_topk=K)
    bad_pages = p.table.copy()
    bad_pages[-1, 0] = p.num_blocks + 3
    return [
        ("q_codes dtype", dict(q_codes=p.q_codes.astype(np.float32)), TypeError,
         "Invalid dtype of q_codes"),
        ("q_codes rows", dict(q_codes=p.q_codes[:t - 1]), ValueError,
         "Invalid shape of q_codes: expected at least"),
        ("q_codes head_dim", dict(q_codes=p.q_codes[..., :64].copy()), ValueError,
         "Invalid shape of q_codes: expected D = 128"),
        ("weights heads", dict(weights=p.weights[:, :4]), ValueError, "Invalid shape of weights"),
        ("weights rows", dict(weights=p.weights[:t - 1]), ValueError,
         "Invalid shape of weights: expected at least"),
        ("weights dtype", dict(weights=p.weights.astype(np.float64)), TypeError,
         "Invalid dtype of weights"),
        ("k rows", dict(k=p.new_keys[:t - 1]), ValueError, "Invalid shape of k: expected at least"),
        ("k dim", dict(k=p.new_keys[:, :64]), ValueError, "Invalid shape of k"),
        ("k dtype", dict(k=p.new_keys.astype(np.int32)), TypeError, "Invalid dtype of k"),
        ("k_cache type", dict(k_cache=object()), TypeError, "Invalid type of k_cache"),
        ("buffer rows", dict(topk_indices_buffer=np.full((t - 1, K), SENTINEL, np.int32)),
         ValueError, "Invalid shape of topk_indices_buffer: expected at least"),
        ("buffer topk", dict(topk_indices_buffer=np.full((t, K // 2), SENTINEL, np.int32)),
         ValueError, "expected 64 columns (the metadata's index_topk)"),
        ("buffer dtype", dict(topk_indices_buffer=np.full((t, K), SENTINEL, np.int64)),
         TypeError, "Invalid dtype of topk_indices_buffer"),
        ("metadata block_size", dict(metadata=other_bs), ValueError,
         "built with block_size=8, but k_cache have block_size=16"),
        ("metadata index_topk", dict(metadata=p.rebuild(index_topk=2 * K)), ValueError,
         "Invalid shape of topk_indices_buffer: expected 128 columns"),
        ("metadata page ids", dict(metadata=build_batch(p.q_lens, p.ctx, bad_pages,
                                                        block_size=BS, index_topk=K)),
         ValueError, f"uses page id {p.num_blocks + 3}"),
        ("metadata type", dict(metadata=dict(num_tokens=t)), TypeError,
         "Invalid metadata: expected BatchMetadata"),
    ]


@pytest.mark.parametrize("case", range(17))
def test_a_refused_call_changes_nothing(case):
    """DESIGN section 11: every argument is checked before the first write."""
    p = Problem([1, 1, 30, 70], [40, 20, 0, 10])          # decodes and prefills, many keys
    what, override, exc, message = _bad_indexer_calls(p)[case]
    cache = p.cache_with_context()
    before = cache.data.copy()
    args = dict(q_codes=p.q_codes, weights=p.weights, k=p.new_keys, k_cache=cache,
                metadata=p.meta,
                topk_indices_buffer=np.full((p.meta.num_tokens, K), SENTINEL, np.int32))
    args.update(override)
    buffers = [args["topk_indices_buffer"]]
    with pytest.raises(exc, match=re.escape(message)):
        sparse_attn_indexer(args.pop("q_codes"), args.pop("weights"), args.pop("k"),
                            args.pop("k_cache"), args.pop("metadata"),
                            args.pop("topk_indices_buffer"),
                            forward_context=ForwardContext.for_layers(p.meta, [NAME]),
                            dense_mha_metadata_layer_name=NAME)
    assert np.array_equal(cache.data, before), f"{what}: the cache changed"
    assert all((b == SENTINEL).all() for b in buffers), f"{what}: the buffer changed"


def test_every_bad_argument_case_is_listed():
    assert len(_bad_indexer_calls(Problem([1, 30], [5, 0]))) == 17


def test_early_return_off_when_mla_says_sparse():
    p = short_prefill()
    buf, _, stats = p.run(dense_mha_metadata_layer_name=NAME,
                          forward_context=ctx_with(p.meta, use_dense_mha=False))
    assert_not_fired(p, buf, stats)


def test_early_return_off_with_mla_decode_tokens_hand_edited():
    p = short_prefill()
    buf, _, stats = p.run(dense_mha_metadata_layer_name=NAME,
                          forward_context=ctx_with(p.meta, num_decodes=1,
                                                   num_decode_tokens=1))
    assert_not_fired(p, buf, stats)


def test_early_return_off_with_mla_decode_threshold():
    # The indexer sees two prefills (3 > next_n = 1); the MLA, with threshold 4,
    # sees a decode of 3 tokens that it will attend sparsely: no early return.
    p = Problem([3, 20], [10, 0], seed=21, mla_decode_threshold=4)
    assert p.meta.num_decode_tokens == 0 and p.meta.mla.num_decode_tokens == 3
    assert p.meta.mla.prefill.use_dense_mha
    buf, _, stats = p.run(dense_mha_metadata_layer_name=NAME,
                          forward_context=ForwardContext.for_layers(p.meta, [NAME]))
    assert_not_fired(p, buf, stats)


def test_early_return_off_with_a_real_decode_in_the_batch():
    p = Problem([1, 20], [10, 0], seed=22)
    assert p.meta.mla.prefill.use_dense_mha and p.meta.mla.num_decode_tokens == 1
    buf, _, stats = p.run(dense_mha_metadata_layer_name=NAME,
                          forward_context=ForwardContext.for_layers(p.meta, [NAME]))
    assert_not_fired(p, buf, stats)


def test_early_return_uses_mla_decode_count_not_the_indexers():
    # next_n = 2 makes request 0 an indexer decode, but the MLA (threshold 1)
    # attends every token densely: the MLA's num_decode_tokens == 0 decides.
    p = Problem([2, 20], [10, 0], seed=23, next_n=2, mla_decode_threshold=1)
    assert p.meta.num_decode_tokens == 2 and p.meta.mla.num_decode_tokens == 0
    buf, cache, stats = p.run(dense_mha_metadata_layer_name=NAME,
                              forward_context=ForwardContext.for_layers(p.meta, [NAME]))
    assert_fired(p, buf, cache, stats)


def test_early_return_off_while_capturing(monkeypatch):
    p = short_prefill()
    monkeypatch.setattr(_backend, "is_stream_capturing", lambda xp: True)
    buf, _, stats = p.run(dense_mha_metadata_layer_name=NAME,
                          forward_context=ForwardContext.for_layers(p.meta, [NAME]))
    assert_not_fired(p, buf, stats)


def test_early_return_off_for_long_prefill():
    p = Problem([30, 50], [10, 20], seed=24)
    assert not p.meta.mla.prefill.use_dense_mha
    buf, _, stats = p.run(dense_mha_metadata_layer_name=NAME,
                          forward_context=ForwardContext.for_layers(p.meta, [NAME]))
    assert_not_fired(p, buf, stats)


@pytest.mark.parametrize("fires", [True, False])
def test_skip_k_cache_insert_leaves_cache_bytes(fires):
    p = short_prefill() if fires else Problem([1, 70], [50, 5], seed=25)
    cache = p.cache_with_context()
    before = cache.data.copy()
    buf, _, stats = p.run(cache=cache, skip_k_cache_insert=True,
                          dense_mha_metadata_layer_name=NAME,
                          forward_context=ForwardContext.for_layers(p.meta, [NAME]))
    np.testing.assert_array_equal(cache.data, before)
    assert stats.inserted_keys == 0
    assert stats.skipped == int(fires)
    # and without the flag the bytes do change
    p.run(cache=cache, dense_mha_metadata_layer_name=NAME,
          forward_context=ForwardContext.for_layers(p.meta, [NAME]))
    assert not np.array_equal(cache.data, before)


# ------------------------------------------------------ buffer clearing ------

def spy_topk(monkeypatch, buf, tokens):
    """Snapshot buf[:tokens] at the first top-k call of the indexer."""
    seen = []

    def wrap(fn):
        def spy(*args, **kwargs):
            if not seen:
                seen.append(buf[:tokens].copy())
            return fn(*args, **kwargs)
        return spy

    monkeypatch.setattr(sai_mod, "topk_per_row_core", wrap(sai_mod.topk_per_row_core))
    monkeypatch.setattr(sai_mod, "topk_per_row_decode_core",
                        wrap(sai_mod.topk_per_row_decode_core))
    return seen


def garbage_buffer(rows, seed=30):
    rng = np.random.default_rng(seed)
    buf = rng.integers(-(1 << 30), 1 << 30, size=(rows, K)).astype(np.int32)
    buf[buf == -1] = 7
    return buf


@pytest.mark.parametrize("q, ctx, next_n", [
    ([20, 90], [10, 0], 1),            # one short, one long prefill row set
    ([1, 3, 40], [30, 70, 0], 4),      # padded decodes + prefill
])
def test_buffer_cleared_before_writing(monkeypatch, q, ctx, next_n):
    p = Problem(q, ctx, seed=31, next_n=next_n)
    t = p.meta.num_tokens
    buf = garbage_buffer(t + 7)
    rest = buf[t:].copy()
    seen = spy_topk(monkeypatch, buf, t)
    p.run(buf=buf, skip_topk_buffer_clear=False)
    assert (seen[0] == -1).all(), "rows [0, T) must be -1 before any top-k is written"
    p.check_rows(buf)                       # short windows end in -1 padding
    np.testing.assert_array_equal(buf[t:], rest)


@pytest.mark.parametrize("q, ctx, next_n", [
    ([20, 90], [10, 0], 1),
    ([1, 3, 40], [30, 70, 0], 4),
])
def test_skip_topk_buffer_clear(monkeypatch, q, ctx, next_n):
    p = Problem(q, ctx, seed=32, next_n=next_n)
    t = p.meta.num_tokens
    buf = garbage_buffer(t + 7)
    before = buf.copy()
    seen = spy_topk(monkeypatch, buf, t)
    p.run(buf=buf, skip_topk_buffer_clear=True)
    # no clear: the first top-k finds the caller's contents still there
    np.testing.assert_array_equal(seen[0], before[:t])
    np.testing.assert_array_equal(buf[t:], before[t:])
    # every token row is then written whole by its top-k (DESIGN section 6: a
    # short row is 0 .. len-1 then -1), so the result equals the cleared run.
    p.check_rows(buf)
    cleared, _, _ = p.run(buf=garbage_buffer(t + 7), skip_topk_buffer_clear=False)
    np.testing.assert_array_equal(buf[:t], cleared[:t])


def test_early_return_does_not_clear():
    p = short_prefill()
    buf = garbage_buffer(p.meta.num_tokens + 3)
    before = buf.copy()
    p.run(buf=buf, dense_mha_metadata_layer_name=NAME,
          forward_context=ForwardContext.for_layers(p.meta, [NAME]))
    np.testing.assert_array_equal(buf, before)


# ------------------------------------------------------------ validation -----

def test_validation():
    p = Problem([10, 20], [0, 0], seed=40)
    cache = p.cache_with_context()
    t = p.meta.num_tokens
    with pytest.raises(ValueError, match="topk_indices_buffer"):
        sparse_attn_indexer(p.q_codes, p.weights, p.new_keys, cache, p.meta,
                            np.zeros((t - 1, K), np.int32))
    with pytest.raises(ValueError, match="q_codes"):
        sparse_attn_indexer(p.q_codes[:t - 1], p.weights, p.new_keys, cache, p.meta,
                            np.zeros((t, K), np.int32))
    with pytest.raises((TypeError, ValueError), match="topk_indices_buffer"):
        sparse_attn_indexer(p.q_codes, p.weights, p.new_keys, cache, p.meta,
                            np.zeros((t, K), np.int64))
    with pytest.raises(TypeError, match="k_cache"):
        sparse_attn_indexer(p.q_codes, p.weights, p.new_keys, cache.data, p.meta,
                            np.zeros((t, K), np.int32))
    with pytest.raises((TypeError, ValueError), match="weights"):
        sparse_attn_indexer(p.q_codes, p.weights[:, :4].copy(), p.new_keys, cache, p.meta,
                            np.zeros((t, K), np.int32))
    with pytest.raises(TypeError):
        sparse_attn_indexer(p.q_codes, p.weights, p.new_keys.tolist(), cache, p.meta,
                            np.zeros((t, K), np.int32))


# ------------------------------------------------------------------- GPU -----

@pytest.mark.gpu
@pytest.mark.parametrize("fires", [False, True])
def test_cupy_matches_numpy(fires, cupy_kernels):
    import cupy
    p = short_prefill(seed=50) if fires else Problem([1, 3, 40, 90], [70, 20, 30, 0], seed=50,
                                                     next_n=4)
    ref, ref_cache, ref_stats = p.run(dense_mha_metadata_layer_name=NAME,
                                      forward_context=ForwardContext.for_layers(p.meta, [NAME]))
    cache = IndexerKCache(p.num_blocks, block_size=BS, head_dim=D, xp=cupy)
    for r, c in enumerate(p.ctx):
        if c:
            pos = np.arange(c)
            slots = (p.table[r, pos // BS] * BS + pos % BS).astype(np.int32)
            cache.insert(cupy.asarray(p.keys[r][:c]), cupy.asarray(slots))
    meta = build_batch(p.q_lens, p.ctx, cupy.asarray(p.table), next_n=p.meta.next_n,
                       block_size=BS, index_topk=K)
    buf = cupy.full((p.meta.num_tokens + 5, K), SENTINEL, cupy.int32)
    stats = IndexerStats()
    sparse_attn_indexer(cupy.asarray(p.q_codes), cupy.asarray(p.weights),
                        cupy.asarray(p.new_keys), cache, meta, buf, stats=stats,
                        dense_mha_metadata_layer_name=NAME,
                        forward_context=ForwardContext.for_layers(meta, [NAME]))
    assert stats.skipped == ref_stats.skipped == int(fires)
    np.testing.assert_array_equal(cupy.asnumpy(cache.data), ref_cache.data)
    got = cupy.asnumpy(buf)
    if fires:
        assert (got == SENTINEL).all()
    else:
        p.check_rows(got)
        same_sets(got, ref)
