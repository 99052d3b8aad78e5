"""Decode context parallelism simulated on the CPU: shards of one NumPy problem, merged,
equal to the unsharded reference (issue 22's merge math; the NCCL part needs GPUs)."""

import numpy as np
import pytest

from cpsparse.attention import sparse_mla_attention
from cpsparse.indexer import topk_per_row
from cpsparse.reference import context_parallel as dcp

LAYOUTS = [(1, 1), (2, 1), (3, 1), (4, 1), (2, 4), (4, 16), (3, 5)]


@pytest.mark.parametrize("world,interleave", LAYOUTS)
def test_shards_cover_every_token_once(world, interleave):
    lens = np.array([0, 1, 5, 63, 64, 65, 1000])
    for b, n in enumerate(lens):
        seen = []
        for r in range(world):
            local_n = int(dcp.dcp_local_lens(lens, r, world, interleave)[b])
            g = dcp.dcp_to_global(np.arange(local_n), r, world, interleave)
            assert (np.diff(g) > 0).all()                     # increasing on a rank
            seen.append(g)
        seen = np.concatenate(seen) if seen else np.zeros(0, np.int64)
        assert np.array_equal(np.sort(seen), np.arange(n)), (world, interleave, n)
    for r in range(world):                                # padding stays -1 on every rank
        assert dcp.dcp_to_global(np.array([-1, 0]), r, world, interleave)[0] == -1


def _rows(rng, m, n):
    """Logits with exact ties, -inf, NaN; rows of every length around k."""
    x = rng.integers(-6, 6, (m, n)).astype(np.float32) * 0.5       # many ties
    x[rng.random((m, n)) < 0.02] = -np.inf
    x[rng.random((m, n)) < 0.02] = np.nan
    x[1] = 3.0                                                      # one value only
    return x


def _shard_topk(logits, lens, k, world, interleave):
    """Each rank's local top-k (values, global positions) of rows [0, len)."""
    m = logits.shape[0]
    vals, poss = [], []
    for r in range(world):
        local_lens = dcp.dcp_local_lens(lens, r, world, interleave)
        width = max(1, int(local_lens.max()))
        glob = dcp.dcp_to_global(np.arange(width), r, world, interleave)
        local = np.full((m, width), -np.inf, np.float32)
        ok = glob < logits.shape[1]
        local[:, ok] = logits[:, glob[ok]]
        loc = topk_per_row(local, np.zeros(m, np.int32), local_lens.astype(np.int32), k)
        v = np.take_along_axis(local, np.maximum(loc, 0), axis=1)
        vals.append(v)
        poss.append(dcp.dcp_to_global(loc, r, world, interleave))
    return np.stack(vals), np.stack(poss)


@pytest.mark.parametrize("world,interleave", LAYOUTS)
@pytest.mark.parametrize("k", [1, 7, 32])
def test_merged_topk_equals_the_whole_row(world, interleave, k):
    rng = np.random.default_rng(world * 100 + interleave * 10 + k)
    m, n = 12, 97
    logits = _rows(rng, m, n)
    lens = np.array([0, 97, 1, k, k + 1, 5, 96, 50, 97, 2 * k, 33, 64])
    want = topk_per_row(logits, np.zeros(m, np.int32), lens.astype(np.int32), k)
    vals, poss = _shard_topk(logits, lens, k, world, interleave)
    got = dcp.merge_topk(vals, poss, lens, k)
    assert got.dtype == np.int32
    assert np.array_equal(got, want)


def test_merged_topk_can_fail():
    """Dropping one rank's candidates changes the answer (the check above can fail)."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 64)).astype(np.float32)
    lens = np.full(4, 64)
    vals, poss = _shard_topk(logits, lens, 8, 2, 1)
    poss[1] = -1
    want = topk_per_row(logits, np.zeros(4, np.int32), lens.astype(np.int32), 8)
    assert not np.array_equal(dcp.merge_topk(vals, poss, lens, 8), want)


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (4, 1), (3, 4)])
def test_merged_attention_equals_one_pass(world, interleave):
    rng = np.random.default_rng(world + interleave)
    tokens, heads, keys, topk = 6, 4, 300, 64
    kv = rng.standard_normal((keys, 576)).astype(np.float32) * 0.3
    q = rng.standard_normal((tokens, heads, 576)).astype(np.float32) * 0.3
    idx = rng.integers(0, keys, (tokens, topk)).astype(np.int32)
    idx[1, 20:] = -1
    idx[2] = -1                                            # no key at all
    idx[3, :] = -1
    idx[3, 5] = 7                                          # one key, on one rank
    q[4, 2, 3] = np.nan                                    # a NaN row
    want_out, want_lse = sparse_mla_attention(q, kv, idx, 0.07)
    owner = (np.arange(keys) // interleave) % world
    outs, lses = [], []
    for r in range(world):
        mine = np.where((idx >= 0) & (owner[np.maximum(idx, 0)] == r), idx, -1)
        o, l = sparse_mla_attention(q, kv, mine.astype(np.int32), 0.07)
        outs.append(o)
        lses.append(l)
    out, lse = dcp.merge_attention(np.stack(outs), np.stack(lses))
    fin = ~np.isnan(want_lse)
    # the public op returns float32 partials: their rounding is all that differs
    np.testing.assert_allclose(out[fin], want_out[fin], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-6)
    assert np.isnan(out[4, 2]).all() and np.isnan(lse[4, 2])
    assert (out[2] == 0).all() and (lse[2] == -np.inf).all()


def test_merged_attention_nan_on_one_rank_and_an_empty_ranks_out_ignored():
    """A NaN lse on one rank makes the row NaN (one pass over all keys would); a rank
    with no key of a row (lse -inf) is ignored whatever its out holds (NaN here)."""
    outs = np.array([[[[1.0, 2.0]], [[np.nan, np.nan]]],
                     [[[np.nan, 5.0]], [[3.0, 4.0]]]])          # [R=2, T=2, H=1, 2]
    lses = np.array([[[0.5], [-np.inf]],
                     [[np.nan], [0.25]]])                       # [R=2, T=2, H=1]
    out, lse = dcp.merge_attention(outs, lses)
    assert np.isnan(lse[0, 0]) and np.isnan(out[0, 0]).all()
    np.testing.assert_array_equal(out[1, 0], [3.0, 4.0])
    assert lse[1, 0] == 0.25


def test_merged_attention_weights_by_lse():
    """Two ranks, hand-made partials: out is the exp(lse)-weighted mean."""
    outs = np.array([[[[1.0, 0.0]]], [[[0.0, 1.0]]]])
    lses = np.array([[[np.log(1.0)]], [[np.log(3.0)]]])
    out, lse = dcp.merge_attention(outs, lses)
    np.testing.assert_allclose(out[0, 0], [0.25, 0.75])
    np.testing.assert_allclose(lse[0, 0], np.log(4.0))
