"""The MLA layer driver and its construction-time gate (DESIGN section 8).

The field regression this guards against: a short-prefill skip that fired while
attention still read the top-k buffer gave degenerate output. So the buffer is
poisoned and the dense route is shown never to read it, by output equality,
by the layer's counters and by spies on the sparse-attention entry points.
"""

import dataclasses
import itertools

import numpy as np
import pytest

import cpsparse.mla as mla_mod
from cpsparse.attention import local_to_global_slots
from cpsparse.cache import IndexerKCache
from cpsparse.metadata import ForwardContext, build_batch, set_forward_context
from cpsparse.mla import DeepseekV32AttentionStack, DeepseekV32MLA, MLAConfig
from cpsparse.platform import StaticPlatform

CFG = MLAConfig.small()
SHARING = MLAConfig.small(index_topk_freq=2)      # odd layers share the top-k
BS, K = CFG.block_size, CFG.index_topk
NAME = "layers.0.attn"
CUDA, CPU = StaticPlatform(cuda=True), StaticPlatform(cuda=False)


# ---------------------------------------------------------------- helpers ----

def make_layer(platform=CPU, name=NAME, num_blocks=40, max_tokens=256, buf=None, **kw):
    layer = DeepseekV32MLA(CFG, name, platform=platform, **kw)
    layer.allocate_kv_cache(num_blocks, max_num_tokens=max_tokens, topk_indices_buffer=buf)
    return layer


def table_for(num_reqs, cols=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.permutation(num_reqs * cols).astype(np.int32).reshape(num_reqs, cols)


def batch(q, ctx, table, **kw):
    return build_batch(q, ctx, table, block_size=BS, index_topk=K, **kw)


def hidden(t, seed=1):
    return np.random.default_rng(seed).standard_normal((t, CFG.hidden_size)).astype(np.float32)


def poison(buf, seed=2):
    rng = np.random.default_rng(seed)
    garbage = rng.integers(-(1 << 30), 1 << 30, size=buf.shape).astype(np.int32)
    garbage[rng.random(buf.shape) < 0.3] = -1
    buf[...] = garbage
    return buf.copy()


def forced_sparse(meta, names=(NAME,)):
    """A forward context whose MLA metadata says use_dense_mha=False."""
    mla = dataclasses.replace(meta.mla, prefill=dataclasses.replace(meta.mla.prefill,
                                                                     use_dense_mha=False))
    return ForwardContext(batch=meta, attn_metadata={n: mla for n in names})


class Spy:
    """Records the calls of the sparse-attention entry points the layer uses."""

    def __init__(self, monkeypatch):
        self.slots_calls, self.sparse_calls = [], []
        real_l2g = mla_mod.local_to_global_slots_core
        real_sparse = mla_mod.sparse_mla_attention_core

        def l2g(xp, indices, *a, **k):
            self.slots_calls.append(np.array(indices))
            return real_l2g(xp, indices, *a, **k)

        def sparse(xp, q, source, indices, *a, **k):
            self.sparse_calls.append(np.array(indices))
            return real_sparse(xp, q, source, indices, *a, **k)

        monkeypatch.setattr(mla_mod, "local_to_global_slots_core", l2g)
        monkeypatch.setattr(mla_mod, "sparse_mla_attention_core", sparse)


# --------------------------------------------------------------- the gate ----

@pytest.mark.parametrize("is_mtp, skip_topk, use_pcp, cuda",
                         list(itertools.product([False, True], repeat=4)))
def test_gate_all_combinations(is_mtp, skip_topk, use_pcp, cuda):
    layer = DeepseekV32MLA(CFG, NAME, is_mtp_layer=is_mtp, skip_topk=skip_topk,
                           use_pcp=use_pcp, platform=StaticPlatform(cuda=cuda))
    enabled = (not is_mtp) and (not skip_topk) and (not use_pcp) and cuda
    assert layer.enable_short_prefill_scoring_skip is enabled
    assert layer._dense_mha_metadata_layer_name == (NAME if enabled else "")
    assert layer.skip_topk is False                 # the runtime flag starts False
    assert (layer.indexer is None) is skip_topk


class CountingPlatform:
    def __init__(self, cuda):
        self.cuda, self.calls = cuda, 0

    def is_cuda(self):
        self.calls += 1
        return self.cuda


@pytest.mark.parametrize("cuda", [True, False])
def test_gate_is_decided_once(cuda):
    platform = CountingPlatform(cuda)
    layer = make_layer(platform=platform, num_blocks=8, max_tokens=64)
    calls = platform.calls
    assert calls <= 1
    platform.cuda = not cuda                       # the platform changes its answer
    assert layer.enable_short_prefill_scoring_skip is cuda
    assert layer._dense_mha_metadata_layer_name == (NAME if cuda else "")
    meta = batch([30], [0], table_for(1))
    layer.forward(hidden(30), forward_context=ForwardContext.for_layers(meta, [NAME]))
    assert platform.calls == calls, "the forward pass must not consult the platform"
    assert layer._dense_mha_metadata_layer_name == (NAME if cuda else "")
    assert layer.indexer.stats.skipped == int(cuda)
    assert layer.indexer.stats.scored_calls == int(not cuda)


def test_gate_passes_the_name_to_the_indexer(monkeypatch):
    seen = []
    real = mla_mod.sparse_attn_indexer_core

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(mla_mod, "sparse_attn_indexer_core", spy)
    meta = batch([70], [0], table_for(1))
    for platform, use_pcp, want in ((CUDA, False, NAME), (CPU, False, ""), (CUDA, True, "")):
        layer = make_layer(platform=platform, use_pcp=use_pcp)
        layer.forward(hidden(70), forward_context=ForwardContext.for_layers(meta, [NAME]))
        assert seen[-1]["dense_mha_metadata_layer_name"] == want
        assert seen[-1]["use_pcp"] is use_pcp


# ------------------------------------------- the dense route and the buffer ---

SHORT = [([40], [0]), ([30, 20], [10, 0]), ([64], [0])]


@pytest.mark.parametrize("q, ctx", SHORT)
def test_dense_route_never_reads_poisoned_buffer(monkeypatch, q, ctx):
    table = table_for(len(q))
    meta = batch(q, ctx, table)
    assert meta.mla.prefill.use_dense_mha and meta.mla.num_decode_tokens == 0
    t, x = meta.num_tokens, hidden(sum(q))
    clean = make_layer(platform=CUDA)
    y_clean = clean.forward(x, forward_context=ForwardContext.for_layers(meta, [NAME]))

    spy = Spy(monkeypatch)
    layer = make_layer(platform=CUDA)
    before = poison(layer.topk_indices_buffer)
    y = layer.forward(x, forward_context=ForwardContext.for_layers(meta, [NAME]))
    np.testing.assert_array_equal(y, y_clean)
    assert np.isfinite(y).all()
    assert layer.attention_stats.buffer_rows_read == 0
    assert layer.attention_stats.dense_tokens == t and layer.attention_stats.sparse_tokens == 0
    assert layer.indexer.stats.skipped == 1 and layer.indexer.stats.scored_calls == 0
    assert spy.slots_calls == [] and spy.sparse_calls == []
    # the skipped indexer neither cleared nor wrote the buffer
    np.testing.assert_array_equal(layer.topk_indices_buffer, before)


@pytest.mark.parametrize("platform", [CUDA, CPU], ids=["gate_on", "gate_off"])
def test_key_step_caches_the_indexer_keys_and_the_indexer_call_skips_it(platform):
    """The layer writes the indexer keys in its key step (the seed's fused norm / RoPE
    / insert) and calls the indexer with skip_k_cache_insert: the cache holds the
    keys whether the short-prefill gate fires or not, and a gated call does nothing."""
    q, ctx = [30, 20], [10, 0]
    table = table_for(2)
    meta = batch(q, ctx, table)
    x = hidden(sum(q))
    layer = make_layer(platform=platform)
    c = layer.indexer_cache
    want = IndexerKCache(c.num_blocks, c.block_size, c.head_dim, scale_fmt=c.scale_fmt,
                         dtype=c.dtype)
    q_c, _, _, _ = layer._project(x, meta.positions)
    _, _, k = layer.indexer.queries_keys(np, x, q_c, meta.positions)
    want.insert(k, meta.slot_mapping)
    layer.forward(x, forward_context=ForwardContext.for_layers(meta, [NAME]))
    np.testing.assert_array_equal(layer.indexer_cache.data, want.data)
    assert np.count_nonzero(want.data) > 0
    assert layer.indexer.stats.inserted_keys == 0           # not by the indexer call
    assert layer.attention_stats.indexer_keys_inserted == sum(q)
    fires = platform is CUDA
    assert layer.indexer.stats.skipped == int(fires)
    assert layer.indexer.stats.scored_calls == int(not fires)


@pytest.mark.parametrize("q, ctx", SHORT)
def test_gate_disabled_scores_but_still_dense(monkeypatch, q, ctx):
    meta = batch(q, ctx, table_for(len(q)))
    t, x = meta.num_tokens, hidden(sum(q))
    enabled = make_layer(platform=CUDA)
    y_enabled = enabled.forward(x, forward_context=ForwardContext.for_layers(meta, [NAME]))
    spy = Spy(monkeypatch)
    for platform, kw in ((CPU, {}), (CUDA, {"use_pcp": True})):
        layer = make_layer(platform=platform, **kw)
        poison(layer.topk_indices_buffer)
        y = layer.forward(x, forward_context=ForwardContext.for_layers(meta, [NAME]))
        assert layer.indexer.stats.scored_calls == 1 and layer.indexer.stats.skipped == 0
        assert layer.attention_stats.buffer_rows_read == 0
        assert layer.attention_stats.dense_tokens == t
        np.testing.assert_allclose(y, y_enabled, rtol=1e-6, atol=0)
        # the indexer did write its rows: every window is <= K, so 0..len-1 then -1
        rows = layer.topk_indices_buffer[:t]
        pos = np.asarray(meta.positions)
        np.testing.assert_array_equal(
            rows, np.where(np.arange(K)[None] <= pos[:, None], np.arange(K)[None], -1))
    assert spy.sparse_calls == []


@pytest.mark.parametrize("q, ctx", [([40], [0]), ([30, 20], [10, 0]), ([1, 25], [40, 5]),
                                    ([64], [0])])
def test_dense_equals_sparse_when_every_key_is_selected(q, ctx):
    table = table_for(len(q), seed=3)
    meta = batch(q, ctx, table)
    assert meta.mla.prefill.use_dense_mha
    x_ctx = hidden(max(ctx) + 1, seed=4)
    x = hidden(sum(q), seed=5)

    outs = []
    for ctx_fn in (lambda m: ForwardContext.for_layers(m, [NAME]), forced_sparse):
        layer = make_layer(platform=CPU)
        # fill each request's context through the layer itself (prefill steps)
        for r, c in enumerate(ctx):
            if c:
                pre = batch([c], [0], table[r:r + 1])
                layer.forward(x_ctx[:c], forward_context=ForwardContext.for_layers(pre, [NAME]))
        layer.attention_stats.reset()
        outs.append((layer.forward(x, forward_context=ctx_fn(meta)), layer.attention_stats))
    (y_dense, s_dense), (y_sparse, s_sparse) = outs
    nd = meta.mla.num_decode_tokens
    assert s_dense.dense_tokens == meta.num_tokens - nd and s_dense.buffer_rows_read == nd
    assert s_sparse.dense_tokens == 0 and s_sparse.sparse_tokens == meta.num_tokens
    assert s_sparse.buffer_rows_read == meta.num_tokens
    scale = np.abs(y_dense).max()
    np.testing.assert_allclose(y_sparse, y_dense, rtol=1e-4, atol=1e-5 * scale)


def test_long_prefill_takes_sparse_route(monkeypatch):
    spy = Spy(monkeypatch)
    meta = batch([30, 50], [0, 20], table_for(2, seed=6))     # 70 > K
    assert not meta.mla.prefill.use_dense_mha
    layer = make_layer(platform=CUDA)                          # gate on, but no skip here
    poison(layer.topk_indices_buffer)
    y = layer.forward(hidden(80), forward_context=ForwardContext.for_layers(meta, [NAME]))
    s = layer.attention_stats
    assert layer.indexer.stats.skipped == 0 and layer.indexer.stats.scored_calls == 1
    assert s.sparse_tokens == 80 and s.dense_tokens == 0 and s.buffer_rows_read == 80
    assert np.isfinite(y).all()
    rows = layer.topk_indices_buffer[:80]
    np.testing.assert_array_equal(spy.slots_calls[-1], rows)
    want = local_to_global_slots(rows, meta.req_ids, meta.block_table, BS)
    np.testing.assert_array_equal(spy.sparse_calls[-1], want)


def test_decode_tokens_always_sparse(monkeypatch):
    table = table_for(3, seed=7)
    layer = make_layer(platform=CUDA)
    # contexts of 10 and 50 tokens, then decodes (short: all keys fit the top-k)
    for r, c in ((0, 10), (1, 50)):
        pre = batch([c], [0], table[r:r + 1])
        layer.forward(hidden(c, seed=r), forward_context=ForwardContext.for_layers(pre, [NAME]))
    spy = Spy(monkeypatch)
    layer.attention_stats.reset()
    layer.indexer.stats.reset()
    meta = batch([1, 1], [10, 50], table[:2])
    layer.forward(hidden(2, seed=8), forward_context=ForwardContext.for_layers(meta, [NAME]))
    assert meta.mla.prefill is None
    assert layer.indexer.stats.skipped == 0 and layer.indexer.stats.decode_rows == 2
    assert layer.attention_stats.sparse_tokens == 2 and layer.attention_stats.dense_tokens == 0
    np.testing.assert_array_equal(spy.slots_calls[-1][:, :11], [list(range(11)),
                                                                list(range(11))])
    # decodes + a short prefill: decodes sparse, prefill dense, no early return
    layer.attention_stats.reset()
    layer.indexer.stats.reset()
    meta = batch([1, 1, 20], [11, 51, 0], table)
    assert meta.mla.prefill.use_dense_mha and meta.mla.num_decode_tokens == 2
    layer.forward(hidden(22, seed=9), forward_context=ForwardContext.for_layers(meta, [NAME]))
    s = layer.attention_stats
    assert layer.indexer.stats.skipped == 0 and layer.indexer.stats.scored_calls == 1
    assert (s.sparse_tokens, s.dense_tokens, s.buffer_rows_read) == (2, 20, 2)


# ------------------------------------------------------------ index sharing ---

def stack_and_batch(platform, q, ctx_lens=None, seed=0):
    ctx_lens = ctx_lens or [0] * len(q)
    stack = DeepseekV32AttentionStack(SHARING, num_layers=2, num_blocks=40,
                                      max_num_tokens=256, platform=platform, seed=seed)
    meta = batch(q, ctx_lens, table_for(len(q), seed=10))
    return stack, meta, ForwardContext.for_layers(meta, stack.layer_names)


def test_index_sharing_reads_the_rows_the_scoring_layer_wrote(monkeypatch):
    stack, meta, ctx = stack_and_batch(CUDA, [50, 40])         # 50 + 40 tokens, 50 <= K...
    ctx = forced_sparse(meta, stack.layer_names)               # ... but route sparse
    scorer, sharer = stack.layers
    assert sharer.indexer is None and sharer.shares_topk
    assert sharer.topk_indices_buffer is scorer.topk_indices_buffer
    poison(stack.topk_indices_buffer)
    spy = Spy(monkeypatch)
    x = hidden(90, seed=11)
    out = stack.forward(x, forward_context=ctx)
    t = meta.num_tokens
    assert scorer.indexer.stats.scored_calls == 1
    assert scorer.attention_stats.buffer_rows_read == t
    assert sharer.attention_stats.buffer_rows_read == t
    rows = stack.topk_indices_buffer[:t].copy()
    assert len(spy.sparse_calls) == 2
    np.testing.assert_array_equal(spy.slots_calls[0], rows)
    np.testing.assert_array_equal(spy.slots_calls[1], rows)
    np.testing.assert_array_equal(spy.sparse_calls[1], spy.sparse_calls[0])

    # the sharing layer's output depends on those rows: other rows, other output
    x1 = x + scorer.forward(x, forward_context=ctx)
    y1 = sharer.forward(x1, forward_context=ctx)
    np.testing.assert_allclose(x1 + y1, out, rtol=1e-6, atol=1e-6)
    stack.topk_indices_buffer[:t] = -1
    stack.topk_indices_buffer[:t, 0] = 0                      # attend to position 0 only
    y_other = sharer.forward(x1, forward_context=ctx)
    assert not np.allclose(y_other, y1, rtol=1e-3, atol=1e-4)
    stack.topk_indices_buffer[:t] = rows
    np.testing.assert_array_equal(sharer.forward(x1, forward_context=ctx), y1)


def test_index_sharing_long_prefill_with_gate():
    stack, meta, ctx = stack_and_batch(CUDA, [70, 30])
    assert not meta.mla.prefill.use_dense_mha
    stack.forward(hidden(100, seed=12), forward_context=ctx)
    scorer, sharer = stack.layers
    assert scorer._dense_mha_metadata_layer_name == scorer.layer_name
    assert sharer._dense_mha_metadata_layer_name == ""
    assert scorer.indexer.stats.skipped == 0
    assert sharer.attention_stats.buffer_rows_read == 100


def test_index_sharing_short_prefill_skip_never_reads_buffer(monkeypatch):
    """The scorer skips; the sharing layer must go dense too, not read stale rows."""
    stack, meta, ctx = stack_and_batch(CUDA, [40, 20])
    ref_stack, _, _ = stack_and_batch(CUDA, [40, 20])
    x = hidden(60, seed=13)
    y_ref = ref_stack.forward(x, forward_context=ctx)
    before = poison(stack.topk_indices_buffer)
    spy = Spy(monkeypatch)
    y = stack.forward(x, forward_context=ctx)
    np.testing.assert_array_equal(y, y_ref)
    scorer, sharer = stack.layers
    assert scorer.indexer.stats.skipped == 1
    assert scorer.attention_stats.buffer_rows_read == 0
    assert sharer.attention_stats.buffer_rows_read == 0
    assert spy.sparse_calls == []
    np.testing.assert_array_equal(stack.topk_indices_buffer, before)


def test_stack_layers_and_names():
    stack = DeepseekV32AttentionStack(SHARING, num_layers=5, num_blocks=4,
                                      max_num_tokens=16, platform=CUDA)
    assert [layer.indexer is None for layer in stack.layers] == [False, True, False, True,
                                                                 False]
    assert stack.layer_names == [f"layers.{i}.attn" for i in range(5)]
    assert [layer.enable_short_prefill_scoring_skip for layer in stack.layers] == [
        True, False, True, False, True]


# -------------------------------------------------------------- validation ----

def test_forward_before_allocate_kv_cache():
    layer = DeepseekV32MLA(CFG, NAME, platform=CPU)
    meta = batch([10], [0], table_for(1))
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        layer.forward(hidden(10), forward_context=ForwardContext.for_layers(meta, [NAME]))


def test_forward_validation():
    layer = make_layer(num_blocks=20, max_tokens=32)
    meta = batch([10], [0], table_for(1, cols=5))
    ctx = ForwardContext.for_layers(meta, [NAME])
    with pytest.raises(ValueError, match="hidden_states"):
        layer.forward(np.zeros((10, CFG.hidden_size + 1), np.float32), forward_context=ctx)
    with pytest.raises(ValueError, match="hidden_states"):
        layer.forward(np.zeros((9, CFG.hidden_size), np.float32), forward_context=ctx)
    with pytest.raises(ValueError, match="hidden_states"):
        layer.forward(np.zeros((10, 2, CFG.hidden_size), np.float32), forward_context=ctx)
    with pytest.raises(TypeError, match="hidden_states"):
        layer.forward(np.zeros((10, CFG.hidden_size)).tolist(), forward_context=ctx)
    big = batch([40], [0], table_for(1, cols=5))
    with pytest.raises(ValueError, match="top-k buffer"):
        layer.forward(hidden(40), forward_context=ForwardContext.for_layers(big, [NAME]))
    with pytest.raises(RuntimeError, match="forward context"):
        layer.forward(hidden(10))
    with set_forward_context(ctx):                       # the current context works
        assert layer.forward(hidden(10)).shape == (10, CFG.hidden_size)


def test_allocate_and_construct_validation():
    layer = DeepseekV32MLA(CFG, NAME, platform=CPU)
    with pytest.raises(ValueError, match="max_num_tokens"):
        layer.allocate_kv_cache(8)
    with pytest.raises(ValueError, match="topk_indices_buffer"):
        layer.allocate_kv_cache(8, topk_indices_buffer=np.zeros((16, K + 1), np.int32))
    with pytest.raises(TypeError, match="config"):
        DeepseekV32MLA({"hidden_size": 256}, NAME, platform=CPU)
    with pytest.raises(ValueError, match="index_topk"):
        MLAConfig.small(index_topk=0)
    shared = np.full((16, K), -1, np.int32)
    layer.allocate_kv_cache(8, topk_indices_buffer=shared)
    assert layer.topk_indices_buffer is shared


@pytest.mark.gpu
def test_mixed_backends_refused():
    import cupy
    layer = make_layer(num_blocks=8, max_tokens=32)
    meta = batch([10], [0], table_for(1, cols=5))
    with pytest.raises(TypeError, match="[Mm]ixed"):
        layer.forward(cupy.asarray(hidden(10)),
                      forward_context=ForwardContext.for_layers(meta, [NAME]))


@pytest.mark.gpu
@pytest.mark.parametrize("q, ctx", [([40], [0]), ([30, 50], [0, 20])])
def test_cupy_layer_matches_numpy(q, ctx, cupy_kernels):
    import cupy
    table = table_for(len(q))
    x = hidden(sum(q))
    outs = []
    for xp in (np, cupy):
        layer = DeepseekV32MLA(CFG, NAME, platform=CUDA, xp=xp)
        layer.allocate_kv_cache(40, max_num_tokens=128)
        layer.topk_indices_buffer[...] = 777777           # poison: never read when dense
        meta = batch(q, ctx, xp.asarray(table))
        y = layer.forward(xp.asarray(x), forward_context=ForwardContext.for_layers(meta, [NAME]))
        outs.append((cupy.asnumpy(y) if xp is cupy else y, layer.indexer.stats.skipped,
                     layer.attention_stats.buffer_rows_read))
    (y_np, skip_np, read_np), (y_cp, skip_cp, read_cp) = outs
    assert (skip_np, read_np) == (skip_cp, read_cp)
    np.testing.assert_allclose(y_cp, y_np, rtol=1e-3, atol=1e-3 * np.abs(y_np).max())
