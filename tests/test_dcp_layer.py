"""The MLA layer under decode context parallelism (simulated ranks on the CPU).

Every rank holds its shard of every request's caches on its own pages; a DCP decode
step (cpsparse.parallel.dcp_decode_view + DeepseekV32MLA(dcp_group=)) must give the
top-k rows and the output of one layer holding everything, step after step, from an
empty cache past index_topk, with next_n = 2 steps and index sharing.
"""

import numpy as np
import pytest

from cpsparse.metadata import ForwardContext, build_batch
from cpsparse.mla import DeepseekV32AttentionStack, DeepseekV32MLA, MLAConfig, init_weights
from cpsparse.parallel import ThreadGroup, dcp_decode_view
from cpsparse.platform import StaticPlatform
from cpsparse.reference import context_parallel as dcp

CFG = MLAConfig.small()
CPU = StaticPlatform(cuda=False)
NAME = "layers.0.attn"
REQS, COLS = 3, 12            # 3 requests of up to COLS * block_size tokens


def rank_tables(world, interleave, seed=5):
    """Each rank's block table: its pages of every request, shuffled ids."""
    tables = []
    for rank in range(world):
        rng = np.random.default_rng(seed + rank)
        tables.append(rng.permutation(REQS * COLS).astype(np.int32).reshape(REQS, COLS))
    return tables


def steps(next_n, ragged=False):
    """(query_lens) of each step: single tokens past index_topk, then next_n-sized
    steps when next_n > 1. ``ragged``: requests drift apart from the start (request 2
    grows twice as fast, next_n-sized steps early), so steps mix tokens whose window a
    rank holds no key of with tokens it holds many of."""
    if ragged:
        plan = [[2, 1, 1]] * 10 + [[1, 1, 2]] * 30 + [[1, 2, 2]] * 20 + [[2, 1, 1]] * 6
    else:
        plan = [[1, 1, 1]] * (CFG.index_topk + 8)
        if next_n > 1:
            plan += [[2, 1, 2], [1, 2, 2], [2, 2, 1]]
    return plan


def hidden(t, step, xp=np):
    rng = np.random.default_rng(1000 + step)
    return xp.asarray(rng.standard_normal((t, CFG.hidden_size)).astype(np.float32))


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def run_one_rank(plan, next_n, weights, xp=np):
    """(output, top-k rows) of every step of one layer holding every key (host)."""
    layer = DeepseekV32MLA(CFG, NAME, platform=CPU, weights=weights, xp=xp)
    layer.allocate_kv_cache(REQS * COLS, max_num_tokens=8)
    table = xp.asarray(np.arange(REQS * COLS, dtype=np.int32).reshape(REQS, COLS))
    ctx = np.zeros(REQS, np.int64)
    outs = []
    for i, q in enumerate(plan):
        meta = build_batch(q, ctx, table, next_n=next_n, block_size=CFG.block_size,
                           index_topk=CFG.index_topk)
        y = layer.forward(hidden(sum(q), i, xp),
                          forward_context=ForwardContext.for_layers(meta, [NAME]))
        outs.append((_host(y), _host(layer.topk_indices_buffer[:sum(q)])))
        ctx += q
    return outs


def dcp_layer_rank(plan, next_n, weights, group, interleave, xp=np):
    """(the steps' (output, rows) on the host, the layer) of rank ``group.rank``."""
    table = rank_tables(group.world, interleave)[group.rank]
    layer = DeepseekV32MLA(CFG, NAME, platform=CPU, weights=weights, dcp_group=group,
                           dcp_interleave=interleave, xp=xp)
    layer.allocate_kv_cache(REQS * COLS, max_num_tokens=8)
    ctx = np.zeros(REQS, np.int64)
    outs = []
    for i, q in enumerate(plan):
        view = dcp_decode_view(q, ctx, xp.asarray(table), group.rank, group.world,
                               interleave=interleave, block_size=CFG.block_size,
                               next_n=next_n)
        y = layer.forward(hidden(sum(q), i, xp), dcp_view=view)
        outs.append((_host(y), _host(layer.topk_indices_buffer[:sum(q)])))
        ctx += q
    return outs, layer


def run_dcp(plan, next_n, weights, world, interleave, xp=np):
    """[dcp_layer_rank of every simulated rank]."""
    return ThreadGroup.run(world, lambda g: dcp_layer_rank(plan, next_n, weights, g,
                                                           interleave, xp))


def check_dcp_steps(want, ranks, rtol=1e-4, atol=1e-5):
    """Every rank's rows (as sets) and outputs equal the one-rank layer's, step by step."""
    assert (want[-1][1] >= 0).all()           # the last steps' rows are past index_topk
    for r, (outs, _) in enumerate(ranks):
        assert len(outs) == len(want)
        for i, ((y, rows), (y1, rows1)) in enumerate(zip(outs, want)):
            # sets per row (DESIGN 6: any order), -1 padding while rows are short
            assert np.array_equal(np.sort(rows, axis=1), np.sort(rows1, axis=1)), (r, i)
            np.testing.assert_allclose(y, y1, rtol=rtol, atol=atol,
                                       err_msg=f"rank {r} step {i}")


@pytest.mark.parametrize("world,interleave,next_n,ragged", [
    (1, 1, 1, False), (2, 1, 1, False), (3, 1, 2, False), (2, 4, 2, False),
    (3, 32, 2, True),             # interleave past the page size: whole pages on one rank
    (2, 5, 2, True)])             # an interleave that does not divide the page size
def test_dcp_decode_steps_equal_one_rank(world, interleave, next_n, ragged):
    weights = init_weights(CFG, 3)
    plan = steps(next_n, ragged)
    want = run_one_rank(plan, next_n, weights)
    ranks = run_dcp(plan, next_n, weights, world, interleave)
    check_dcp_steps(want, ranks)
    for r, (_, layer) in enumerate(ranks):
        # this rank inserted its own tokens only, and the cache holds them
        ctx_end = np.sum(np.array(plan), axis=0)
        held = dcp.dcp_local_lens(ctx_end, r, world, interleave)
        assert layer.attention_stats.indexer_keys_inserted == held.sum()


def test_dcp_stack_with_index_sharing_equals_one_rank():
    """A 3-layer stack (layer 1 shares layer 0's rows) under DCP: the sharing layer
    reads the global rows and attends its own shard."""
    cfg = MLAConfig.small(index_topk_freq=2)
    plan = [[1, 1, 1]] * (cfg.index_topk + 4)

    def run(group, world):
        stack = DeepseekV32AttentionStack(cfg, 3, num_blocks=REQS * COLS, max_num_tokens=8,
                                          platform=CPU, seed=11, dcp_group=group)
        tables = rank_tables(world, 1) if group is not None else None
        table = np.arange(REQS * COLS, dtype=np.int32).reshape(REQS, COLS)
        ctx = np.zeros(REQS, np.int64)
        ys = []
        for i, q in enumerate(plan):
            x = hidden(sum(q), i)
            if group is None:
                meta = build_batch(q, ctx, table, block_size=cfg.block_size,
                                   index_topk=cfg.index_topk)
                ys.append(stack.forward(
                    x, forward_context=ForwardContext.for_layers(meta, stack.layer_names)))
            else:
                view = dcp_decode_view(q, ctx, tables[group.rank], group.rank, world,
                                       block_size=cfg.block_size)
                ys.append(stack.forward(x, dcp_view=view))
            ctx += q
        return ys, stack

    want, one = run(None, 1)
    assert [layer.shares_topk for layer in one.layers] == [False, True, False]
    for ys, stack in ThreadGroup.run(2, lambda g: run(g, 2)):
        for y, y1 in zip(ys, want):
            np.testing.assert_allclose(y, y1, rtol=1e-4, atol=1e-5)
        assert stack.layers[1].indexer is None


def test_dcp_view_and_layer_refusals():
    table = np.zeros((1, 2), np.int32)
    with pytest.raises(ValueError, match="rank"):
        dcp_decode_view([1], [3], table, 2, 2, block_size=16)
    with pytest.raises(ValueError, match="query_lens"):
        dcp_decode_view([3], [3], table, 0, 2, block_size=16, next_n=2)
    with pytest.raises(ValueError, match="local_block_table"):
        dcp_decode_view([1], [100], table, 0, 2, block_size=16)   # 51 local tokens, 2 pages
    g = ThreadGroup.run(1, lambda g: g)[0]
    with pytest.raises(ValueError, match="dcp_group"):
        DeepseekV32MLA(CFG, NAME, platform=CPU, dcp_group=g, use_pcp=True)
    with pytest.raises(ValueError, match="dcp_group"):
        DeepseekV32MLA(CFG, NAME, platform=CPU, dcp_group=g, is_mtp_layer=True)
    with pytest.raises(TypeError, match="all_gather"):
        DeepseekV32MLA(CFG, NAME, platform=CPU, dcp_group=object())
    layer = DeepseekV32MLA(CFG, NAME, platform=CPU, dcp_group=g, dcp_interleave=2)
    layer.allocate_kv_cache(4, max_num_tokens=8)
    view = dcp_decode_view([1], [3], table, 0, 1, block_size=CFG.block_size)
    with pytest.raises(ValueError, match="interleave"):
        layer.forward(hidden(1, 0), dcp_view=view)         # the view's interleave is 1
    with pytest.raises(TypeError, match="DcpDecodeView"):
        layer.forward(hidden(1, 0), dcp_view=None)
    big = dcp_decode_view([1], [3], np.full((1, 2), 9, np.int32), 0, 1, interleave=2,
                          block_size=CFG.block_size)
    before = layer.mla_cache.data.copy()
    with pytest.raises(ValueError, match="dcp_view.block_table"):
        layer.forward(hidden(1, 0), dcp_view=big)            # page 9 of a 4-page cache
    np.testing.assert_array_equal(layer.mla_cache.data, before)
    plain = DeepseekV32MLA(CFG, NAME, platform=CPU)
    plain.allocate_kv_cache(4, max_num_tokens=8)
    with pytest.raises(ValueError, match="no dcp_group"):
        plain.forward(hidden(1, 0), dcp_view=view)


def test_dcp_refusals_write_nothing():
    """Every refusal of a DCP forward comes before its first write: both caches and the
    top-k buffer stay as they were."""
    g = ThreadGroup.run(1, lambda g: g)[0]
    layer = DeepseekV32MLA(CFG, NAME, platform=CPU, dcp_group=g)
    layer.allocate_kv_cache(4, max_num_tokens=2)
    table = np.zeros((1, 2), np.int32)
    ok = dcp_decode_view([1], [3], table, 0, 1, block_size=CFG.block_size)
    layer.forward(hidden(1, 0), dcp_view=ok)                  # a valid step first
    state = lambda: (layer.mla_cache.data.copy(), layer.indexer_cache.data.copy(),  # noqa: E731
                     layer.topk_indices_buffer.copy())
    before = state()
    three = dcp_decode_view([1, 1, 1], [4, 4, 4], np.zeros((3, 2), np.int32), 0, 1,
                            block_size=CFG.block_size)
    cases = [
        (hidden(1, 1)[:, :7], ok, ValueError, "hidden_states"),
        (hidden(3, 1), three, ValueError, "top-k buffer"),     # 3 tokens, 2 buffer rows
    ]
    for x, view, err, match in cases:
        with pytest.raises(err, match=match):
            layer.forward(x, dcp_view=view)
    layer.set_skip_topk(True)               # accepted: the last call scored its rows
    with pytest.raises(ValueError, match="reuse"):
        layer.forward(hidden(1, 1), dcp_view=ok)
    layer.set_skip_topk(False)
    for a, b in zip(state(), before):
        np.testing.assert_array_equal(a, b)


def test_dcp_view_owns_its_table():
    """A view computed its slots from the table it was given; changing the caller's
    table afterwards changes neither (the layer checks the view's own copy)."""
    table = np.array([[9, 9]], np.int32)
    view = dcp_decode_view([1], [3], table, 0, 1, block_size=CFG.block_size)
    table[:] = 0
    assert view.block_table_host[0, 0] == 9 and int(view.block_table[0, 0]) == 9
    assert int(view.slot_mapping[0]) == 9 * CFG.block_size + 3
    g = ThreadGroup.run(1, lambda g: g)[0]
    layer = DeepseekV32MLA(CFG, NAME, platform=CPU, dcp_group=g)
    layer.allocate_kv_cache(4, max_num_tokens=2)
    with pytest.raises(ValueError, match="dcp_view.block_table"):
        layer.forward(hidden(1, 0), dcp_view=view)            # page 9 of 4: refused
    with pytest.raises(Exception):
        view.rank = 1                                          # frozen
