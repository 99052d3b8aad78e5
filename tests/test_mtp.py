"""MTP draft rounds (DESIGN section 10): step-0 top-k, compaction, reuse by steps 1+."""

import numpy as np
import pytest

import cpsparse.mla as mla_mod
from cpsparse.metadata import ForwardContext, build_batch
from cpsparse.mla import DeepseekV32MLA, MLAConfig
from cpsparse.mtp import MTPDrafter
from cpsparse.platform import StaticPlatform

CFG = MLAConfig.small()
BS, K = CFG.block_size, CFG.index_topk
NAME = "mtp.0"
CUDA = StaticPlatform(cuda=True)


# ---------------------------------------------------------------- helpers ----

def mtp_layer(platform=CUDA, seed=0):
    layer = DeepseekV32MLA(CFG, NAME, is_mtp_layer=True, platform=platform, seed=seed)
    layer.allocate_kv_cache(num_blocks=48, max_num_tokens=256)
    return layer


def table_for(num_reqs, cols=12, seed=0):
    rng = np.random.default_rng(seed)
    return rng.permutation(num_reqs * cols).astype(np.int32).reshape(num_reqs, cols)


def hidden(t, seed):
    return np.random.default_rng(seed).standard_normal((t, CFG.hidden_size)).astype(np.float32)


class Round:
    """A step-0 batch and a next_step callback that records what it saw."""

    def __init__(self, q0, ctx0, seed=0, next_n=1):
        self.q0, self.ctx0 = list(q0), list(ctx0)
        self.table = table_for(len(q0), seed=seed)
        self.batch0 = build_batch(self.q0, self.ctx0, self.table, next_n=next_n,
                                  block_size=BS, index_topk=K)
        self.ctx = ForwardContext.for_layers(self.batch0, [NAME])
        self.x0 = hidden(sum(q0), seed + 100)
        self.seen = []          # (step, skip_topk flag, buffer[:R] snapshot)
        self.layer = None

    def seq0(self):
        return [a + b for a, b in zip(self.q0, self.ctx0)]

    def step_batch(self, step):
        return build_batch([1] * len(self.q0), [s + step - 1 for s in self.seq0()], self.table,
                           block_size=BS, index_topk=K)

    def next_step(self, step, previous_output):
        r = len(self.q0)
        self.seen.append((step, self.layer.skip_topk,
                          self.layer.topk_indices_buffer[:r].copy(), previous_output.shape))
        meta = self.step_batch(step)
        return hidden(r, 1000 + step), ForwardContext.for_layers(meta, [NAME])

    def run(self, layer, num_steps):
        self.layer = layer
        return MTPDrafter(layer, num_steps).run_round(self.x0, self.ctx, self.next_step)


def step0_rows_by_twin(rnd):
    """The rows a plain forward of an identical layer writes for step 0's last tokens."""
    twin = mtp_layer()
    twin.forward(rnd.x0, forward_context=rnd.ctx)
    return twin.topk_indices_buffer[rnd.batch0.last_token_rows].copy()


class SparseSpy:
    def __init__(self, monkeypatch):
        self.calls = []
        real = mla_mod.local_to_global_slots_core

        def spy(xp, indices, req_ids, block_table, block_size=64):
            self.calls.append((np.array(indices), np.array(req_ids), np.array(block_table)))
            return real(xp, indices, req_ids, block_table, block_size)

        monkeypatch.setattr(mla_mod, "local_to_global_slots_core", spy)


# ------------------------------------------------------------------ rounds ----

@pytest.mark.parametrize("q0, ctx0", [
    ([70, 90], [0, 0]),              # long prefills: sparse step 0
    ([40, 30], [0, 10]),             # short prefills: dense step 0, rows still written
    ([1, 50, 80], [60, 0, 5]),       # a decode in step 0 too
])
def test_round_scores_once_and_reuses_compacted_rows(monkeypatch, q0, ctx0):
    rnd = Round(q0, ctx0, seed=len(q0))
    want_rows = step0_rows_by_twin(rnd)
    layer = mtp_layer()
    spy = SparseSpy(monkeypatch)
    outs = rnd.run(layer, num_steps=3)
    r = len(q0)

    assert [o.shape for o in outs] == [(sum(q0), CFG.hidden_size)] + [(r, CFG.hidden_size)] * 2
    assert all(np.isfinite(o).all() for o in outs)
    assert layer.indexer.stats.calls == 1                 # once per round
    assert layer.indexer.stats.skipped == 0               # MTP: never the early return
    assert layer.attention_stats.forwards == 3
    assert layer.skip_topk is False

    # steps 1 and 2 ran with reuse on, on the compacted step-0 rows
    assert [s[0] for s in rnd.seen] == [1, 2]
    assert all(s[1] is True for s in rnd.seen)
    for _, _, rows, _ in rnd.seen:
        np.testing.assert_array_equal(rows, want_rows)
    # ... and attention read exactly those rows for the steps' tokens
    nd0 = rnd.batch0.mla.num_decode_tokens
    dense0 = rnd.batch0.mla.prefill.use_dense_mha
    assert len(spy.calls) == int(nd0 > 0) + int(not dense0) + 2
    for indices, req_ids, table in spy.calls[-2:]:
        np.testing.assert_array_equal(indices, want_rows)
        np.testing.assert_array_equal(req_ids, np.arange(r))
        np.testing.assert_array_equal(table, rnd.table)
    step0_read = nd0 if dense0 else sum(q0)
    assert layer.attention_stats.buffer_rows_read == step0_read + 2 * r


def test_reused_rows_change_step_output():
    """A step after 0 attends over the buffer rows, not over fresh scoring."""
    rnd = Round([70, 90], [0, 0], seed=5)
    layer = mtp_layer()
    outs = rnd.run(layer, num_steps=2)
    meta1 = rnd.step_batch(1)
    x1 = hidden(2, 1001)
    # rerun step 1 by hand with the compacted rows, then with other rows
    rows = step0_rows_by_twin(rnd)
    layer.topk_indices_buffer[:2] = rows
    layer.mark_reusable_topk_rows(2)
    layer.set_skip_topk(True)
    try:
        calls = layer.indexer.stats.calls
        y_same = layer.forward(x1, forward_context=ForwardContext.for_layers(meta1, [NAME]))
        layer.topk_indices_buffer[:2] = -1
        layer.topk_indices_buffer[:2, 0] = 0
        y_other = layer.forward(x1, forward_context=ForwardContext.for_layers(meta1, [NAME]))
        assert layer.indexer.stats.calls == calls
    finally:
        layer.set_skip_topk(False)
    np.testing.assert_allclose(y_same, outs[1], rtol=1e-6, atol=1e-6)
    assert not np.allclose(y_other, outs[1], rtol=1e-3, atol=1e-4)


def test_second_round_scores_again():
    rnd = Round([70, 90], [0, 0], seed=6)
    layer = mtp_layer()
    rnd.run(layer, num_steps=3)
    # next round: step 0 re-runs the verified positions 70..72 and 90..92
    rnd2 = Round([3, 3], [70, 90], seed=6)
    assert np.array_equal(rnd2.table, rnd.table)
    want_rows = step0_rows_by_twin_after(rnd, rnd2)
    rnd2.run(layer, num_steps=2)
    assert layer.indexer.stats.calls == 2
    assert layer.skip_topk is False
    np.testing.assert_array_equal(rnd2.seen[0][2], want_rows)


def step0_rows_by_twin_after(first, second):
    """Rows a plain twin layer writes for ``second``'s step 0 after ``first``'s step 0."""
    twin = mtp_layer()
    twin.forward(first.x0, forward_context=first.ctx)
    twin.forward(second.x0, forward_context=second.ctx)
    return twin.topk_indices_buffer[second.batch0.last_token_rows].copy()


def test_num_steps_one_runs_only_step_zero():
    rnd = Round([70, 20], [0, 0], seed=8)
    layer = mtp_layer()

    def never(step, previous_output):
        raise AssertionError("next_step must not be called for num_steps=1")

    rnd.layer = layer
    outs = MTPDrafter(layer, 1).run_round(rnd.x0, rnd.ctx, never)
    assert len(outs) == 1 and outs[0].shape == (90, CFG.hidden_size)
    assert layer.indexer.stats.calls == 1
    assert layer.attention_stats.forwards == 1
    assert layer.skip_topk is False


# ----------------------------------------------------- skip_topk lifecycle ----

def test_set_skip_topk_before_step0_raises():
    layer = mtp_layer()
    with pytest.raises(RuntimeError, match="step 0"):
        layer.set_skip_topk(True)
    assert layer.skip_topk is False
    layer.set_skip_topk(False)                    # turning it off is always fine
    assert layer.skip_topk is False


def test_skip_topk_reset_when_next_step_raises():
    rnd = Round([70, 90], [0, 0], seed=9)
    layer = mtp_layer()
    rnd.layer = layer

    class Boom(Exception):
        pass

    def boom(step, previous_output):
        assert layer.skip_topk is True
        raise Boom()

    with pytest.raises(Boom):
        MTPDrafter(layer, 3).run_round(rnd.x0, rnd.ctx, boom)
    assert layer.skip_topk is False
    with pytest.raises(RuntimeError):             # the kept rows are gone too
        layer.set_skip_topk(True)


def test_skip_topk_reset_when_later_step_raises():
    rnd = Round([70, 90], [0, 0], seed=10)
    layer = mtp_layer()
    rnd.layer = layer

    def second_fails(step, previous_output):
        if step == 2:
            raise KeyError("step 2")
        return rnd.next_step(step, previous_output)

    with pytest.raises(KeyError):
        MTPDrafter(layer, 4).run_round(rnd.x0, rnd.ctx, second_fails)
    assert layer.skip_topk is False
    assert layer.indexer.stats.calls == 1


@pytest.mark.parametrize("bad", ["two_tokens", "fewer_reqs", "not_a_context"])
def test_skip_topk_reset_after_bad_step_batch(bad):
    rnd = Round([70, 90], [0, 0], seed=11)
    layer = mtp_layer()
    rnd.layer = layer

    def bad_step(step, previous_output):
        if bad == "two_tokens":
            meta = build_batch([2, 2], [70, 90], rnd.table, next_n=2, block_size=BS,
                               index_topk=K)
            return hidden(4, 1), ForwardContext.for_layers(meta, [NAME])
        if bad == "fewer_reqs":
            meta = build_batch([1], [70], rnd.table[:1], block_size=BS, index_topk=K)
            return hidden(1, 1), ForwardContext.for_layers(meta, [NAME])
        return hidden(2, 1), rnd.step_batch(step)          # a BatchMetadata, not a context

    with pytest.raises((ValueError, TypeError)):
        MTPDrafter(layer, 2).run_round(rnd.x0, rnd.ctx, bad_step)
    assert layer.skip_topk is False
    assert layer.attention_stats.forwards == 1            # the bad step never ran
    assert layer.indexer.stats.calls == 1


def test_reuse_needs_enough_kept_rows():
    rnd = Round([70, 90], [0, 0], seed=12)
    layer = mtp_layer()
    layer.forward(rnd.x0, forward_context=rnd.ctx)
    layer.mark_reusable_topk_rows(1)
    layer.set_skip_topk(True)
    try:
        with pytest.raises(RuntimeError, match="rows"):
            layer.forward(hidden(2, 3),
                          forward_context=ForwardContext.for_layers(rnd.step_batch(1), [NAME]))
    finally:
        layer.set_skip_topk(False)


# ---------------------------------------------------- drafter construction ----

def test_drafter_refuses_non_mtp_layer():
    layer = DeepseekV32MLA(CFG, "layers.0.attn", platform=CUDA)
    with pytest.raises(ValueError, match="MTP"):
        MTPDrafter(layer, 2)
    sharing = DeepseekV32MLA(CFG, NAME, is_mtp_layer=True, skip_topk=True, platform=CUDA)
    with pytest.raises(ValueError, match="indexer"):
        MTPDrafter(sharing, 2)


@pytest.mark.parametrize("num_steps", [0, -1, True, 2.0, "3"])
def test_drafter_refuses_bad_num_steps(num_steps):
    with pytest.raises(ValueError, match="num_steps"):
        MTPDrafter(mtp_layer(), num_steps)


@pytest.mark.parametrize("cuda", [True, False])
def test_mtp_layer_gate_is_off_even_on_cuda(cuda):
    layer = mtp_layer(platform=StaticPlatform(cuda=cuda))
    assert layer.enable_short_prefill_scoring_skip is False
    assert layer._dense_mha_metadata_layer_name == ""
    # a short prefill that a non-MTP layer on CUDA would skip is scored
    meta = build_batch([40], [0], table_for(1), block_size=BS, index_topk=K)
    layer.forward(hidden(40, 0), forward_context=ForwardContext.for_layers(meta, [NAME]))
    assert layer.indexer.stats.skipped == 0 and layer.indexer.stats.scored_calls == 1
    rows = layer.topk_indices_buffer[:40]
    np.testing.assert_array_equal(rows[39], np.where(np.arange(K) < 40, np.arange(K), -1))


def test_begin_topk_reuse_compacts_rows():
    layer = mtp_layer()
    meta = build_batch([1, 3, 4], [5, 0, 2], table_for(3), block_size=BS, index_topk=K)
    layer.forward(hidden(8, 0), forward_context=ForwardContext.for_layers(meta, [NAME]))
    buf = layer.topk_indices_buffer
    buf[:8] = np.arange(8)[:, None] * 100 + np.arange(K)[None]
    snapshot = buf.copy()
    assert layer.begin_topk_reuse(meta) == 3
    assert layer.skip_topk
    np.testing.assert_array_equal(buf[:3], snapshot[[0, 3, 7]])
    np.testing.assert_array_equal(buf[3:], snapshot[3:])
    layer.end_topk_reuse()
    assert not layer.skip_topk


def test_begin_topk_reuse_refuses_a_batch_the_indexer_did_not_score():
    layer = mtp_layer()
    meta = build_batch([1, 3, 4], [5, 0, 2], table_for(3), block_size=BS, index_topk=K)
    with pytest.raises(RuntimeError, match="did not score this step-0 batch"):
        layer.begin_topk_reuse(meta)                     # no call yet
    other = build_batch([2, 3], [5, 0], table_for(2), block_size=BS, index_topk=K)
    layer.forward(hidden(5, 0), forward_context=ForwardContext.for_layers(other, [NAME]))
    with pytest.raises(RuntimeError, match="did not score this step-0 batch"):
        layer.begin_topk_reuse(meta)                     # another batch was scored
    assert not layer.skip_topk


def test_compaction_refuses_a_request_without_step0_tokens():
    layer = mtp_layer()
    meta = build_batch([0, 5], [3, 0], table_for(2), block_size=BS, index_topk=K)
    with pytest.raises(ValueError, match="request 0 has no step-0 token"):
        layer.begin_topk_reuse(meta)


def test_rows_of_a_skipped_indexer_call_are_not_reusable():
    """A gated (non-MTP) layer whose indexer took the short-prefill early return wrote no
    rows: turning reuse on afterwards must raise instead of reading a stale buffer."""
    layer = DeepseekV32MLA(CFG, "layers.0", platform=CUDA)
    layer.allocate_kv_cache(num_blocks=48, max_num_tokens=256)
    meta = build_batch([20], [0], table_for(1), block_size=BS, index_topk=K)
    layer(hidden(20, 0), forward_context=ForwardContext.for_layers(meta, ["layers.0"]))
    assert layer.indexer.stats.skipped == 1
    with pytest.raises(RuntimeError, match="before a step 0"):
        layer.set_skip_topk(True)
    meta = build_batch([K + 10], [0], table_for(1, seed=1), block_size=BS, index_topk=K)
    layer(hidden(K + 10, 1), forward_context=ForwardContext.for_layers(meta, ["layers.0"]))
    layer.set_skip_topk(True)              # a scoring call makes its rows reusable
    assert layer.skip_topk
