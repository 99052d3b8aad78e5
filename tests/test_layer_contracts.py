"""The layer path's contracts (production safety issue, items 4-6 and 9):

* a refused forward() leaves every cache page and buffer row byte-identical;
* metadata built for other caches (block_size, index_topk, page ids, int32 slot
  overflow) is refused, never silently misrouted; build_batch takes integers only;
* the MTP reuse cannot be bypassed by any public method;
* an MLA decode threshold that differs from the indexer's next_n runs through
  forward and gives the same attention as the routes it stands for;
* 2-D context_lens validation with rows of different lengths.
"""

import numpy as np
import pytest

import cpsparse
from cpsparse.metadata import ForwardContext, build_batch
from cpsparse.mla import DeepseekV32MLA, MLAConfig
from cpsparse.mtp import MTPDrafter
from cpsparse.platform import StaticPlatform

CFG = MLAConfig.small()
BS, K = CFG.block_size, CFG.index_topk
NAME = "layers.0.attn"
CUDA = StaticPlatform(cuda=True)


def layer_with_state(num_blocks=24, **kw):
    """A layer whose caches and buffer already hold a scored prefill."""
    layer = DeepseekV32MLA(CFG, NAME, platform=CUDA, **kw)
    layer.allocate_kv_cache(num_blocks, max_num_tokens=160)
    table = np.arange(num_blocks, dtype=np.int32).reshape(2, -1)
    meta = build_batch([K + 10, 30], [0, 0], table, block_size=BS, index_topk=K)
    layer.forward(hidden(meta.num_tokens, 0), forward_context=ctx(meta))
    return layer, table


def hidden(t, seed=1):
    return np.random.default_rng(seed).standard_normal((t, CFG.hidden_size)).astype(np.float32)


def ctx(meta, names=(NAME,)):
    return ForwardContext.for_layers(meta, list(names))


def snapshot(layer):
    return [a.copy() for a in (layer.mla_cache.data, layer.indexer_cache.data,
                               layer.topk_indices_buffer)]


def bad_forwards(table):
    """(what, hidden_states, forward context, error, message) of refused forwards."""
    good = build_batch([3, 20], [K + 10, 30], table, block_size=BS, index_topk=K)
    bad_pages = table.copy()
    bad_pages[1, 1] = 99
    wide = np.repeat(table, 2, axis=1)
    return [
        ("block_size", hidden(23), ctx(build_batch([3, 20], [K + 10, 30], wide,
                                                   block_size=BS // 2, index_topk=K)),
         ValueError, f"built with block_size={BS // 2}"),
        ("index_topk", hidden(23), ctx(build_batch([3, 20], [K + 10, 30], table,
                                                   block_size=BS, index_topk=2 * K)),
         ValueError, f"built with index_topk={2 * K}"),
        ("page id", hidden(23), ctx(build_batch([3, 20], [K + 10, 30], bad_pages,
                                                block_size=BS, index_topk=K)),
         ValueError, "uses page id 99"),
        ("hidden rows", hidden(22), ctx(good), ValueError, "Invalid shape of hidden_states"),
        ("hidden width", hidden(23)[:, :100], ctx(good), ValueError,
         "Invalid shape of hidden_states"),
        ("hidden dtype", hidden(23).astype(np.int32), ctx(good), TypeError,
         "Invalid dtype of hidden_states"),
        ("layer name", hidden(23), ctx(good, ["layers.9.attn"]), ValueError,
         "no MLA metadata for layer"),
        ("context type", hidden(23), good, TypeError, "Invalid forward_context"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_a_refused_forward_changes_nothing(case):
    layer, table = layer_with_state()
    what, x, context, exc, message = bad_forwards(table)[case]
    before = snapshot(layer)
    with pytest.raises(exc, match=message):
        layer.forward(x, forward_context=context)
    after = snapshot(layer)
    assert all(np.array_equal(a, b) for a, b in zip(before, after)), what


def test_build_batch_refuses_page_ids_that_wrap_int32_or_do_not_exist():
    table = np.array([[0, 1], [2, 3]], np.int32)
    with pytest.raises(ValueError, match="page id 33554432 in column 0.*fit int32"):
        build_batch([5, 5], [0, 0], np.array([[2 ** 25, 1], [2, 3]], np.int32),
                    block_size=64, index_topk=K)
    with pytest.raises(ValueError, match="page id -1"):
        build_batch([5, 5], [0, 0], np.array([[-1, 1], [2, 3]], np.int32), block_size=64)
    with pytest.raises(ValueError, match="request 1 uses page id 2 in column 0, expected 0 <= "
                                         "id < num_blocks=2"):
        build_batch([5, 5], [0, 0], table, block_size=64, num_blocks=2)
    build_batch([5, 5], [0, 0], table, block_size=64, num_blocks=3)
    # caches of more pages than int32 slots can address: the int32 bound still holds
    with pytest.raises(ValueError, match="page id 33554432 in column 0, expected its slots "
                                         "to fit int32"):
        build_batch([5], [0], np.array([[2 ** 25]], np.int32), block_size=64,
                    num_blocks=2 ** 26)
    # a page id only above the used columns is not read: fine
    build_batch([5], [0], np.array([[1, 2 ** 30]], np.int32), block_size=64, num_blocks=4)


@pytest.mark.parametrize("bad", [[5.9], ["5"], [True], 5.9, "5", [1.0]])
def test_build_batch_takes_integers_only(bad):
    with pytest.raises(TypeError, match="Invalid query_lens: expected"):
        build_batch(bad, [0], np.zeros((1, 2), np.int32), block_size=BS)
    with pytest.raises(TypeError, match="Invalid context_lens: expected"):
        build_batch([1], bad, np.zeros((1, 2), np.int32), block_size=BS)


def test_build_batch_takes_numpy_integer_lengths():
    meta = build_batch(np.array([2, 3], np.int64), (np.int32(1), 4),
                       np.zeros((2, 2), np.int32), block_size=BS)
    assert meta.query_lens.tolist() == [2, 3] and meta.context_lens.tolist() == [1, 4]


# ---- the MTP reuse protocol ---------------------------------------------------

def mtp_layer():
    layer = DeepseekV32MLA(CFG, NAME, is_mtp_layer=True, platform=CUDA)
    layer.allocate_kv_cache(24, max_num_tokens=160)
    return layer


def test_reuse_cannot_follow_a_call_that_skipped_scoring():
    """The field bypass: mark_reusable_topk_rows after an early return."""
    layer = DeepseekV32MLA(CFG, NAME, platform=CUDA)             # gate on: short prefills skip
    layer.allocate_kv_cache(24, max_num_tokens=160)
    table = np.arange(24, dtype=np.int32).reshape(2, -1)
    meta = build_batch([20], [0], table[:1], block_size=BS, index_topk=K)
    layer.forward(hidden(20), forward_context=ctx(meta))
    assert layer.indexer.stats.skipped == 1
    with pytest.raises(RuntimeError, match="did not score"):
        layer.mark_reusable_topk_rows(1)
    with pytest.raises(RuntimeError, match="before a step 0"):
        layer.set_skip_topk(True)
    with pytest.raises(RuntimeError, match="before a step 0"):
        layer.skip_topk = True                                   # the attribute is guarded too
    assert layer.skip_topk is False


def test_reuse_ends_with_the_next_scoring_call_and_with_set_skip_topk_false():
    layer = mtp_layer()
    table = np.arange(24, dtype=np.int32).reshape(2, -1)
    meta = build_batch([K + 10, 30], [0, 0], table, block_size=BS, index_topk=K)
    layer.forward(hidden(meta.num_tokens), forward_context=ctx(meta))
    with pytest.raises(RuntimeError, match="cannot reuse 500 rows"):
        layer.mark_reusable_topk_rows(500)
    with pytest.raises(RuntimeError, match="cannot reuse 0 rows"):
        layer.mark_reusable_topk_rows(0)
    layer.mark_reusable_topk_rows(2)
    layer.set_skip_topk(True)
    layer.set_skip_topk(False)
    with pytest.raises(RuntimeError, match="before a step 0"):
        layer.set_skip_topk(True)                                # the reuse has ended
    # a failed scoring call leaves nothing reusable
    bad = build_batch([K + 10, 30], [0, 0], table, block_size=BS, index_topk=K)
    layer.indexer_cache = cpsparse.IndexerKCache(2, BS, CFG.index_head_dim)   # too small
    with pytest.raises(ValueError, match="page id"):
        layer.forward(hidden(bad.num_tokens), forward_context=ctx(bad))
    layer.mark_reusable_topk_rows(2)     # the refused call changed nothing, rows still there


def test_a_failing_indexer_call_leaves_no_reusable_rows(monkeypatch):
    layer = mtp_layer()
    table = np.arange(24, dtype=np.int32).reshape(2, -1)
    meta = build_batch([K + 10, 30], [0, 0], table, block_size=BS, index_topk=K)
    layer.forward(hidden(meta.num_tokens), forward_context=ctx(meta))
    import cpsparse.mla as mla_mod

    def broken(*a, **k):
        raise RuntimeError("device failure")

    monkeypatch.setattr(mla_mod, "sparse_attn_indexer_core", broken)
    with pytest.raises(RuntimeError, match="device failure"):
        layer.forward(hidden(meta.num_tokens), forward_context=ctx(meta))
    with pytest.raises(RuntimeError, match="did not score"):
        layer.mark_reusable_topk_rows(2)


def test_drafter_round_still_reuses():
    layer = mtp_layer()
    table = np.arange(24, dtype=np.int32).reshape(2, -1)
    step0 = build_batch([K + 10, 30], [0, 0], table, block_size=BS, index_topk=K)

    def next_step(step, _):
        m = build_batch([1, 1], [K + 9 + step, 29 + step], table, block_size=BS, index_topk=K)
        return hidden(2, step), ctx(m)

    outs = MTPDrafter(layer, 3).run_round(hidden(step0.num_tokens), ctx(step0), next_step)
    assert len(outs) == 3 and layer.indexer.stats.scored_calls == 1
    assert layer.skip_topk is False


# ---- the MLA decode threshold differs from the indexer's next_n ---------------

def test_mla_decode_threshold_above_next_n_runs_through_forward():
    """A request of 2 new tokens: an indexer prefill (next_n 1) but an MLA decode
    (threshold 2). Its rows must be scored (the short-prefill skip must not fire: the
    MLA has decode tokens) and attended sparsely; that equals the dense causal route
    the same request takes when the MLA counts it as a prefill (every sequence here
    is no longer than index_topk, so the top-k rows hold every earlier position)."""
    table = np.arange(24, dtype=np.int32).reshape(2, -1)
    outs = {}
    for threshold in (2, 1):
        layer = DeepseekV32MLA(CFG, NAME, platform=CUDA, seed=3)
        layer.allocate_kv_cache(24, max_num_tokens=160)
        layer.topk_indices_buffer[...] = 7                       # poison: stale rows
        pre = build_batch([30, 20], [0, 0], table, block_size=BS, index_topk=K)
        layer.forward(hidden(50, 0), forward_context=ctx(pre))
        meta = build_batch([2, 12], [30, 20], table, block_size=BS, index_topk=K,
                           mla_decode_threshold=threshold)
        assert meta.num_decode_tokens == 0 and meta.mla.num_decode_tokens == (2 if threshold
                                                                                  == 2 else 0)
        assert meta.mla.prefill.use_dense_mha
        skipped = layer.indexer.stats.skipped
        outs[threshold] = layer.forward(hidden(14, 5), forward_context=ctx(meta))
        fired = layer.indexer.stats.skipped - skipped
        assert fired == (0 if threshold == 2 else 1)
        stats = layer.attention_stats
        if threshold == 2:
            assert stats.sparse_tokens >= 2
    np.testing.assert_allclose(outs[2], outs[1], rtol=2e-5, atol=2e-5)


# ---- 2-D context_lens validation -------------------------------------------------

def test_2d_context_lens_validation_uses_each_requests_longest_row():
    """Row j = 1 of request 0 is longer than row 0 and needs a third page."""
    rng = np.random.default_rng(0)
    cache = cpsparse.IndexerKCache(6, 64)
    q8, _ = cpsparse.quantize_fp8(rng.standard_normal((2, 2, 8, 128)).astype(np.float32))
    w = np.ones((4, 8), np.float32)
    lens = np.array([[100, 130], [60, 64]], np.int32)
    with pytest.raises(ValueError, match="request 0 has context length 130, which needs 3"):
        cpsparse.paged_mqa_logits(q8, cache, w, lens, np.array([[0, 1], [2, 3]], np.int32), 192)
    with pytest.raises(ValueError, match="request 1 uses page id 9"):
        cpsparse.paged_mqa_logits(q8, cache, w, np.array([[100, 130], [60, 70]], np.int32),
                                  np.array([[0, 1, 4], [2, 9, 0]], np.int32), 192)
    out = cpsparse.paged_mqa_logits(q8, cache, w, lens, np.array([[0, 1, 4], [2, 9, 0]],
                                                                 np.int32), 192)
    assert np.isfinite(out).sum(axis=1).tolist() == [100, 130, 60, 64]
    with pytest.raises(ValueError, match="max_context_len"):
        cpsparse.paged_mqa_logits(q8, cache, w, lens, np.array([[0, 1, 4], [2, 3, 0]],
                                                               np.int32), 129)
    with pytest.raises(ValueError, match="context_lens: expected values >= 0"):
        cpsparse.paged_mqa_logits(q8, cache, w, np.array([[100, 130], [-1, 64]], np.int32),
                                  np.array([[0, 1, 4], [2, 3, 0]], np.int32), 192)
    # and the decode top-k checks each row against the logits width
    logits = np.zeros((4, 129), np.float32)
    with pytest.raises(ValueError, match="ends at 130"):
        cpsparse.topk_per_row_decode(logits, lens, 2, 8)
    assert cpsparse.topk_per_row_decode(np.zeros((4, 130), np.float32), lens, 2, 8).shape == (4, 8)
