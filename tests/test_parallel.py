"""Decode context parallelism through a process group (issue 22): ranks simulated by
threads on the CPU, each holding its own shard of the paged caches, against the
unsharded ops. The same code runs over NCCL (tests/test_gpu_parallel.py)."""

import threading

import numpy as np
import pytest

import cpsparse
from cpsparse import parallel as P
from cpsparse.reference import context_parallel as dcp
from test_context_parallel import _rows

LAYOUTS = [(1, 1), (2, 1), (3, 1), (4, 1), (2, 4), (3, 5), (8, 2)]


def test_all_gather_stacks_the_ranks_in_order():
    got = P.ThreadGroup.run(4, lambda g: g.all_gather(np.full((2, 3), g.rank, np.int32)))
    for out in got:
        assert out.shape == (4, 2, 3)
        assert (out == np.arange(4)[:, None, None]).all()


def test_all_gather_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="Invalid all_gather: rank 1 gave"):
        P.ThreadGroup.run(2, lambda g: g.all_gather(np.zeros(g.rank + 1)))


def test_a_failing_rank_fails_the_run_without_deadlock():
    def fn(g):
        if g.rank == 2:
            raise KeyError("rank 2 failed")
        return g.all_gather(np.zeros(1))
    with pytest.raises(KeyError, match="rank 2 failed"):
        P.ThreadGroup.run(3, fn, timeout=5)
    assert threading.active_count() < 50


def test_group_without_all_gather_is_refused():
    with pytest.raises(TypeError, match="Invalid group"):
        P.dcp_merge_attention(object(), np.zeros((1, 1, 2), np.float32),
                              np.zeros((1, 1), np.float32))


@pytest.mark.parametrize("world,interleave", LAYOUTS)
def test_local_indices_invert_the_shard_layout(world, interleave):
    pos = np.array([[-1, 0, 1, 2, 3, 17, 63, 64, 100, 999]], np.int32)
    owners = np.zeros(pos.shape, np.int64)
    for r in range(world):
        loc = P.dcp_local_indices(pos, r, world, interleave=interleave)
        assert loc.dtype == np.int32
        held = loc >= 0
        owners += held
        assert np.array_equal(dcp.dcp_to_global(loc[held], r, world, interleave), pos[held])
    assert np.array_equal(owners, (pos >= 0).astype(np.int64))   # each position once
    with pytest.raises(TypeError, match="integer"):
        P.dcp_local_indices(pos.astype(np.float32), 0, world)
    with pytest.raises(ValueError, match="rank < world"):     # no rank holds anything
        P.dcp_local_indices(pos, world, world)


@pytest.mark.parametrize("world,interleave", LAYOUTS)
@pytest.mark.parametrize("k", [1, 8, 32])
def test_dcp_topk_equals_the_unsharded_top_k(world, interleave, k):
    rng = np.random.default_rng(world * 31 + interleave * 7 + k)
    m, n = 10, 90
    logits = _rows(rng, m, n)          # exact ties, -inf, NaN
    lens = np.array([0, 1, k, k + 1, 2 * k, 33, 64, 89, 90, 5])
    # a row's logits past its length are garbage a shard may still hold
    want = cpsparse.topk_per_row(logits, np.zeros(m, np.int32), lens.astype(np.int32), k)

    def rank(g):
        mine = np.ascontiguousarray(P.shard_rows(logits, g.rank, g.world, interleave=interleave))
        local_lens = dcp.dcp_local_lens(lens, g.rank, g.world, interleave)
        return P.dcp_topk_per_row(g, mine, local_lens, lens, k, interleave=interleave)

    for got in P.ThreadGroup.run(world, rank):
        assert got.dtype == np.int32
        assert np.array_equal(got, want)


def test_dcp_topk_with_a_rank_holding_no_key():
    logits = np.array([[1.0, 5.0, 3.0]], np.float32)
    lens = np.array([3])

    def rank(g):      # 4 ranks, 3 tokens: rank 3 holds nothing (an empty shard)
        mine = np.ascontiguousarray(P.shard_rows(logits, g.rank, g.world))
        return P.dcp_topk_per_row(g, mine, dcp.dcp_local_lens(lens, g.rank, g.world),
                                  lens, 2)
    # a row of 3 > k = 2 keys: the two largest, largest first
    for got in P.ThreadGroup.run(4, rank):
        assert got.tolist() == [[1, 2]]


def test_dcp_topk_can_fail():
    """Without the merge (a rank's local top-k mapped back), rows differ: the check
    above would notice a merge that dropped the other ranks' candidates."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 64)).astype(np.float32)
    lens = np.full(4, 64)
    want = cpsparse.topk_per_row(logits, np.zeros(4, np.int32), lens.astype(np.int32), 8)
    mine = np.ascontiguousarray(P.shard_rows(logits, 0, 2))
    local = cpsparse.topk_per_row(mine, np.zeros(4, np.int32), np.full(4, 32, np.int32), 8)
    assert not np.array_equal(dcp.dcp_to_global(local, 0, 2), want)


def decode_step_case(xp, world, interleave, run=P.ThreadGroup.run, group=None):
    """One DCP decode step (3 requests, fp8 caches of 16-token pages): the unsharded
    top-k rows and attention, and what every rank got. ``xp`` is numpy or cupy;
    ``run`` runs the ranks (threads here; NCCL processes pass ``group`` instead)."""
    rng = np.random.default_rng(world * 10 + interleave)
    bs, k, heads = 16, 24, 4
    lens = np.array([5, 40, 77])
    b = lens.size
    latent = [(rng.standard_normal((n, 512)).astype(np.float32),
               rng.standard_normal((n, 64)).astype(np.float32)) for n in lens]
    logits = rng.standard_normal((b, int(lens.max()))).astype(np.float32)
    q = (rng.standard_normal((b, heads, 576)) * 0.2).astype(np.float32)
    scale = 0.06
    ids = np.arange(b, dtype=np.int32)

    def paged(tokens_per_req, seed):
        """A cache holding each request's tokens on its own shuffled pages."""
        pages = [-(-int(n) // bs) for n in tokens_per_req]
        order = np.random.default_rng(seed).permutation(sum(pages)).astype(np.int32)
        table = np.full((b, max(max(pages), 1)), -1, np.int32)
        at = 0
        for r, p in enumerate(pages):
            table[r, :p] = order[at:at + p]
            at += p
        return cpsparse.MLAKVCache(max(sum(pages), 1), bs, 512, 64, xp=xp), xp.asarray(table)

    def fill(cache, table, pick):
        for r, (kv_c, k_pe) in enumerate(latent):
            glob = pick(r)
            pos = xp.asarray(np.arange(glob.size, dtype=np.int32)[None])
            slots = cpsparse.local_to_global_slots(pos, xp.asarray(ids[r:r + 1]), table, bs)
            cache.insert(xp.asarray(kv_c[glob]), xp.asarray(k_pe[glob]), slots[0])

    whole, table = paged(lens, 0)
    fill(whole, table, lambda r: np.arange(lens[r]))
    want_rows = cpsparse.topk_per_row(xp.asarray(logits), xp.zeros(b, dtype=xp.int32),
                                      xp.asarray(lens.astype(np.int32)), k)
    want_slots = cpsparse.local_to_global_slots(want_rows, xp.asarray(ids), table, bs)
    want = cpsparse.sparse_mla_attention(xp.asarray(q), whole, want_slots, scale)

    def rank(g):
        local_lens = dcp.dcp_local_lens(lens, g.rank, g.world, interleave)
        cache, ltable = paged(local_lens, 100 + g.rank)
        fill(cache, ltable,
             lambda r: dcp.dcp_to_global(np.arange(local_lens[r]), g.rank, g.world, interleave))
        width = max(1, int(local_lens.max()))
        glob = dcp.dcp_to_global(np.arange(width), g.rank, g.world, interleave)
        mine = np.full((b, width), -np.inf, np.float32)
        ok = glob < logits.shape[1]
        mine[:, ok] = logits[:, glob[ok]]
        rows = P.dcp_topk_per_row(g, xp.asarray(mine), xp.asarray(local_lens),
                                  xp.asarray(lens), k, interleave=interleave)
        loc = P.dcp_local_indices(rows, g.rank, g.world, interleave=interleave)
        slots = cpsparse.local_to_global_slots(loc, xp.asarray(ids), ltable, bs)
        out, lse = cpsparse.sparse_mla_attention(xp.asarray(q), cache, slots, scale)
        return rows, P.dcp_merge_attention(g, out, lse)

    got = [rank(group)] if group is not None else run(world, rank)
    return want_rows, want, got


def check_decode_step(xp, want_rows, want, got):
    to_np = (lambda a: a.get()) if xp is not np else np.asarray
    want_rows = to_np(want_rows)
    for rows, (out, lse) in got:
        rows = to_np(rows)
        # a set per row (DESIGN 6: any order; the GPU kernels' order is their own),
        # valid entries first and -1 after
        assert np.array_equal(np.sort(rows, axis=1), np.sort(want_rows, axis=1))
        valid = rows >= 0
        assert (valid[:, :-1] >= valid[:, 1:]).all()
        assert out.dtype == np.float32 and lse.dtype == np.float32
        if xp is np:
            # float32 partials and their merge: the rounding is all that differs
            np.testing.assert_allclose(out, want[0], rtol=2e-5, atol=2e-6)
            np.testing.assert_allclose(lse, want[1], rtol=1e-6, atol=1e-6)
        else:
            # the kernel rounds P to bf16 against each rank's own running max, so a
            # merge of shards and the whole row differ by twice FlashMLA's tolerances
            np.testing.assert_allclose(to_np(out), to_np(want[0]), rtol=4.02 / 128, atol=2e-3)
            np.testing.assert_allclose(to_np(lse), to_np(want[1]), rtol=16.02 / 65536,
                                       atol=2e-6)


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (3, 1), (4, 2)])
def test_dcp_decode_step_equals_one_rank(world, interleave):
    """Each rank holds its shard of every request on its own pages; the global top-k
    of the step and the attention over it match the unsharded cache and ops."""
    check_decode_step(np, *decode_step_case(np, world, interleave))


def _pcp_positions(total, rank, world, layout):
    """The prompt tokens rank ``rank`` holds: contiguous chunks, or vLLM's head-tail
    split (2 * world chunks; rank r takes chunks r and 2 * world - 1 - r, which balances
    the causal work)."""
    if layout == "contiguous":
        edges = np.linspace(0, total, world + 1).astype(int)
        return np.arange(edges[rank], edges[rank + 1])
    edges = np.linspace(0, total, 2 * world + 1).astype(int)
    a, b = rank, 2 * world - 1 - rank
    return np.concatenate([np.arange(edges[a], edges[a + 1]), np.arange(edges[b], edges[b + 1])])


def test_pcp_all_gather_refuses_a_bad_cover():
    def rank(g):       # both ranks claim token 0, nobody token 1
        return P.pcp_all_gather(g, np.zeros((1, 2)), np.array([0]), 2)
    with pytest.raises(ValueError, match=r"cover \[0, 2\) exactly once"):
        P.ThreadGroup.run(2, rank)
    with pytest.raises(ValueError, match="Invalid shape of positions"):
        P.ThreadGroup.run(1, lambda g: P.pcp_all_gather(g, np.zeros((2, 2)), np.array([0]), 2))


@pytest.mark.parametrize("layout", ["contiguous", "head_tail"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pcp_prefill_top_k_equals_one_rank(world, layout):
    """A 150-token prompt split across ranks: each rank quantizes its own tokens' indexer
    keys, the codes and scales are gathered in prompt order, and every rank's causal
    top-k rows for its queries equal the single-rank rows."""
    rng = np.random.default_rng(world * 3 + len(layout))
    total, heads, k = 150, 8, 32
    keys = rng.standard_normal((total, 128)).astype(np.float32)
    q = rng.standard_normal((total, heads, 128)).astype(np.float32)
    weights = rng.standard_normal((total, heads)).astype(np.float32)

    def indexer_rows(q_rows, pos, k_codes, k_scales):
        q8, qs = cpsparse.quantize_fp8(q_rows)
        w = cpsparse.fold_weights(weights[pos], qs)
        ks = np.zeros(pos.size, np.int32)
        ke = (pos + 1).astype(np.int32)
        logits = cpsparse.mqa_logits(q8, k_codes, k_scales[:, 0], w, ks, ke)
        return cpsparse.topk_per_row(logits, ks, ke, k)

    k8, ksc = cpsparse.quantize_fp8(keys)
    want = indexer_rows(q, np.arange(total), k8, ksc)

    def rank(g):
        pos = _pcp_positions(total, g.rank, g.world, layout)
        mine8, mine_sc = cpsparse.quantize_fp8(keys[pos])   # per token: same bytes
        all8 = P.pcp_all_gather(g, mine8, pos, total)
        all_sc = P.pcp_all_gather(g, mine_sc, pos, total)
        assert np.array_equal(all8, k8) and np.array_equal(all_sc, ksc)
        return pos, indexer_rows(q[pos], pos, all8, all_sc)

    covered = np.zeros(total, bool)
    for pos, rows in P.ThreadGroup.run(world, rank):
        assert np.array_equal(rows, want[pos])
        covered[pos] = True
    assert covered.all()


@pytest.fixture
def exact_projections(monkeypatch):
    """The layer's projections accumulated in float64 (rounded to float32): a token's do
    not depend on the other tokens of the call, as float32 BLAS's do in the last bits
    (its kernels change with the row count), so PCP ranks, each projecting only its own
    tokens, can be held to one rank's top-k rows exactly."""
    from cpsparse import mla

    def matmul64(xp, a, b):
        if xp is not np:
            return xp.matmul(a, b)
        return np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(np.float32)
    monkeypatch.setattr(mla, "_matmul", matmul64)


def pcp_layer_case(world, steps, xp=np):
    """Run the prefill ``steps`` [(q_lens, ctx_lens)] through one layer on one rank and
    through ``world`` PCP ranks (head-tail shares); returns both sides per step, as
    NumPy arrays (the layers run on ``xp``)."""
    from cpsparse.metadata import ForwardContext, build_batch
    from cpsparse.mla import DeepseekV32MLA, MLAConfig
    from cpsparse.platform import StaticPlatform

    cfg = MLAConfig.small()
    name = "layers.0.attn"
    table = np.random.default_rng(7).permutation(40).astype(np.int32).reshape(2, 20)
    metas = [build_batch(q, c, xp.asarray(table), block_size=cfg.block_size,
                         index_topk=cfg.index_topk) for q, c in steps]
    host = (lambda a: a.get()) if xp is not np else np.asarray
    xs = [np.random.default_rng(10 + i).standard_normal((m.num_tokens, cfg.hidden_size))
          .astype(np.float32) for i, m in enumerate(metas)]

    def layer(**kw):
        lay = DeepseekV32MLA(cfg, name, platform=StaticPlatform(cuda=False), seed=3, xp=xp,
                             **kw)
        lay.allocate_kv_cache(40, max_num_tokens=256)
        return lay

    one = layer()
    want = []
    for m, x in zip(metas, xs):
        y = one.forward(xp.asarray(x), forward_context=ForwardContext.for_layers(m, [name]))
        want.append((host(y), host(one.topk_indices_buffer[:m.num_tokens])))

    def rank(g):
        lay = layer(use_pcp=True, pcp_group=g)
        got = []
        for m, x in zip(metas, xs):
            own = _pcp_positions(m.num_tokens, g.rank, g.world, "head_tail")
            y = lay.forward(xp.asarray(x[own]),
                            forward_context=ForwardContext.for_layers(m, [name]),
                            pcp_tokens=own)
            got.append((own, host(y), host(lay.topk_indices_buffer[xp.asarray(own)]),
                        lay.attention_stats))
        return got

    return metas, want, P.ThreadGroup.run(world, rank)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_pcp_layer_equals_one_rank_on_the_sparse_route(world, exact_projections):
    """A prompt prefilled in two steps (the second longer than index_topk: the sparse
    route), each step's tokens split across ranks: every rank's top-k rows and outputs
    for its tokens are one rank's."""
    metas, want, ranks = pcp_layer_case(world, [([50, 30], [0, 0]), ([40, 60], [50, 30])])
    assert not metas[1].mla.prefill.use_dense_mha
    for got in ranks:
        for step, ((own, y, rows, stats), (y_want, rows_want)) in enumerate(zip(got, want)):
            if step == 1:                       # the sparse step: rows scored by this rank
                assert np.array_equal(rows, rows_want[own])
            np.testing.assert_allclose(y, y_want[own], rtol=1e-4,
                                       atol=1e-5 * np.abs(y_want).max())
        assert got[1][3].sparse_tokens >= got[1][0].size


@pytest.mark.parametrize("world", [2, 3])
def test_pcp_layer_equals_one_rank_on_the_dense_route(world, exact_projections):
    """Prompts no longer than index_topk: one rank takes the dense route (no skip on a
    PCP layer: the gate is off); the ranks attend their tokens' causal keys."""
    metas, want, ranks = pcp_layer_case(world, [([40, 23], [0, 0])])
    assert metas[0].mla.prefill.use_dense_mha
    for got in ranks:
        own, y, _, stats = got[0]
        np.testing.assert_allclose(y, want[0][0][own], rtol=1e-4,
                                   atol=1e-5 * np.abs(want[0][0]).max())
        assert stats.dense_tokens == own.size and stats.buffer_rows_read == 0


def test_pcp_layer_refusals():
    from cpsparse.metadata import ForwardContext, build_batch
    from cpsparse.mla import DeepseekV32MLA, MLAConfig
    from cpsparse.platform import StaticPlatform
    cfg = MLAConfig.small()
    with pytest.raises(ValueError, match="needs use_pcp=True"):
        DeepseekV32MLA(cfg, "l", pcp_group=object())
    table = np.arange(20, dtype=np.int32)[None]
    meta = build_batch([1], [30], table, block_size=cfg.block_size, index_topk=cfg.index_topk)
    ctx = ForwardContext.for_layers(meta, ["l"])

    def rank(g):
        lay = DeepseekV32MLA(cfg, "l", use_pcp=True, pcp_group=g,
                             platform=StaticPlatform(cuda=False))
        lay.allocate_kv_cache(20, max_num_tokens=8)
        x = np.zeros((1, cfg.hidden_size), np.float32)
        with pytest.raises(ValueError, match="pcp_tokens"):
            lay.forward(x, forward_context=ctx)
        with pytest.raises(ValueError, match="prefill-only"):
            lay.forward(x, forward_context=ctx, pcp_tokens=np.array([0]))
        return True
    assert P.ThreadGroup.run(1, rank) == [True]


@pytest.mark.parametrize("world", [2, 3])
def test_pcp_stack_with_index_sharing_equals_one_rank(world, exact_projections):
    """A stack of three layers (layer 1 shares layer 0's rows) under PCP: each rank's
    rows of the stack's output are one rank's; the sharing layer reads the rows its
    rank's scoring layer wrote."""
    from cpsparse.metadata import ForwardContext, build_batch
    from cpsparse.mla import DeepseekV32AttentionStack, MLAConfig
    from cpsparse.platform import StaticPlatform
    cfg = MLAConfig.small(index_topk_freq=2)
    table = np.random.default_rng(1).permutation(40).astype(np.int32).reshape(2, 20)
    meta = build_batch([70, 45], [0, 0], table, block_size=cfg.block_size,
                       index_topk=cfg.index_topk)
    assert not meta.mla.prefill.use_dense_mha
    x = np.random.default_rng(2).standard_normal((meta.num_tokens, cfg.hidden_size)) \
        .astype(np.float32)

    def stack(**kw):
        return DeepseekV32AttentionStack(cfg, 3, num_blocks=40, max_num_tokens=128,
                                         platform=StaticPlatform(cuda=False), seed=5, **kw)
    one = stack()
    ctx = ForwardContext.for_layers(meta, one.layer_names)
    want = one.forward(x, forward_context=ctx)
    assert one.layers[1].indexer is None

    def rank(g):
        s = stack(use_pcp=True, pcp_group=g)
        own = _pcp_positions(meta.num_tokens, g.rank, g.world, "head_tail")
        return own, s.forward(x[own], forward_context=ctx, pcp_tokens=own)
    for own, y in P.ThreadGroup.run(world, rank):
        np.testing.assert_allclose(y, want[own], rtol=1e-4, atol=1e-5 * np.abs(want).max())
