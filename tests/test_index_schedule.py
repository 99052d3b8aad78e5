"""GLM-5.x on the layer drivers: the index-sharing schedule (IndexCache) and the
indexer's RoPE layout as config values (MLAConfig)."""

import math

import numpy as np
import pytest
import scipy.linalg

from cpsparse.metadata import ForwardContext, build_batch
from cpsparse.mla import DeepseekV32AttentionStack, DeepseekV32MLA, MLAConfig
from cpsparse.platform import StaticPlatform

CPU = StaticPlatform(cuda=False)


# ---- the schedule ------------------------------------------------------------

def test_default_schedule_scores_every_layer():
    cfg = MLAConfig()
    assert all(cfg.layer_scores(i) for i in range(100))


@pytest.mark.parametrize("freq", [2, 3, 5])
def test_freq_with_offset_one_scores_every_nth_layer(freq):
    cfg = MLAConfig(index_topk_freq=freq)
    assert [i for i in range(30) if cfg.layer_scores(i)] == list(range(0, 30, freq))


def test_glm52_schedule_scores_21_of_78_layers():
    """GLM-5.2 (freq 4, offset 3): layers 0, 1, 2 (its dense layers), then every
    fourth from 6 (1, 2, 3, 7, 11, ..., 75 counted from 1)."""
    cfg = MLAConfig.glm5()
    scoring = [i for i in range(78) if cfg.layer_scores(i)]
    assert scoring == [0, 1, 2] + list(range(6, 78, 4))
    assert len(scoring) == 21


def test_pattern_overrides_freq():
    cfg = MLAConfig(index_topk_pattern="FFSSF", index_topk_freq=2)
    assert [cfg.layer_scores(i) for i in range(5)] == [True, True, False, False, True]
    with pytest.raises(ValueError, match="Invalid layer_id: index_topk_pattern has 5 layers"):
        cfg.layer_scores(5)


@pytest.mark.parametrize("fields,message", [
    (dict(index_topk_pattern="SF"), "Invalid MLAConfig.index_topk_pattern"),
    (dict(index_topk_pattern="FsS"), "Invalid MLAConfig.index_topk_pattern"),
    (dict(index_topk_pattern=""), "Invalid MLAConfig.index_topk_pattern"),
    (dict(index_topk_freq=0), "Invalid MLAConfig.index_topk_freq"),
    (dict(index_topk_freq=True), "Invalid MLAConfig.index_topk_freq"),
    (dict(index_skip_topk_offset=-1), "Invalid MLAConfig.index_skip_topk_offset"),
    (dict(index_topk_freq=2, index_skip_topk_offset=0), "layer 0 must score"),
])
def test_bad_schedules_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        MLAConfig(**fields)


def test_stack_builds_scoring_and_sharing_layers_from_the_schedule():
    cfg = MLAConfig.small(index_topk_freq=4, index_skip_topk_offset=3)
    stack = DeepseekV32AttentionStack(cfg, num_layers=8, num_blocks=2, max_num_tokens=8,
                                      platform=CPU)
    assert [layer.indexer is not None for layer in stack.layers] == \
        [True, True, True, False, False, False, True, False]
    assert all(layer.shares_topk == (layer.indexer is None) for layer in stack.layers)
    with pytest.raises(ValueError, match="index_topk_pattern 'FS' covers 2 layers, got 3"):
        DeepseekV32AttentionStack(MLAConfig.small(index_topk_pattern="FS"), num_layers=3,
                                  num_blocks=2, max_num_tokens=8)


def test_sharing_layers_read_the_last_scoring_layers_rows():
    """A pattern stack forward: the scoring layers call their indexer once each,
    and a sharing layer attends over the rows the scoring layer before it wrote."""
    cfg = MLAConfig.small(index_topk_pattern="FSFS")
    stack = DeepseekV32AttentionStack(cfg, num_layers=4, num_blocks=40, max_num_tokens=256,
                                      platform=CPU)
    table = np.arange(40, dtype=np.int32).reshape(2, 20)
    meta = build_batch([100, 90], [0, 0], table, block_size=cfg.block_size,
                       index_topk=cfg.index_topk)
    x = np.random.default_rng(0).standard_normal((190, cfg.hidden_size)).astype(np.float32)
    stack(x, forward_context=ForwardContext.for_layers(meta, stack.layer_names))
    calls = [None if layer.indexer is None else layer.indexer.stats.scored_calls
             for layer in stack.layers]
    assert calls == [1, None, 1, None]
    assert all(layer.attention_stats.buffer_rows_read > 0 for layer in stack.layers)


# ---- the indexer's RoPE layout -------------------------------------------------

def _oracle_keys(layer, x, positions, interleaved):
    """The indexer keys in float64 from the layer's weights, written independently:
    LayerNorm, RoPE as complex rotations (pairs (2i, 2i+1) or halves (i, i + R/2)),
    then the normalised Hadamard matrix of scipy."""
    c = layer.config
    ix = layer.indexer
    k = x.astype(np.float64) @ ix.wk.astype(np.float64)
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
    k = k * ix.k_norm_w + ix.k_norm_b
    r = c.qk_rope_head_dim
    freqs = c.rope_theta ** (-np.arange(0, r, 2) / r)
    rot = np.exp(1j * positions[:, None] * freqs[None, :])
    if interleaved:
        z = (k[:, 0:r:2] + 1j * k[:, 1:r:2]) * rot
        k[:, 0:r:2], k[:, 1:r:2] = z.real, z.imag
    else:
        z = (k[:, :r // 2] + 1j * k[:, r // 2:r]) * rot
        k[:, :r // 2], k[:, r // 2:r] = z.real, z.imag
    n = c.index_head_dim
    return k @ scipy.linalg.hadamard(n) / math.sqrt(n)


@pytest.mark.parametrize("interleaved", [False, True])
def test_indexer_keys_use_the_configured_rope_layout(interleaved):
    cfg = MLAConfig.small(indexer_rope_interleave=interleaved)
    layer = DeepseekV32MLA(cfg, "layers.0.attn", platform=CPU, seed=3)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((12, cfg.hidden_size)).astype(np.float32)
    q_c = rng.standard_normal((12, cfg.q_lora_rank)).astype(np.float32)
    positions = rng.integers(0, 5000, 12)
    _, _, keys = layer.indexer.queries_keys(np, x, q_c, positions)
    want = _oracle_keys(layer, x, positions, interleaved)
    other = _oracle_keys(layer, x, positions, not interleaved)
    scale = np.abs(want).max()
    assert np.abs(keys - want).max() < 1e-4 * scale
    assert np.abs(keys - other).max() > 0.05 * scale      # the layouts do differ here


def test_the_rope_layout_changes_the_topk_rows():
    """Same weights, same batch: the two layouts choose different keys."""
    rows = {}
    for interleaved in (False, True):
        cfg = MLAConfig.small(indexer_rope_interleave=interleaved)
        layer = DeepseekV32MLA(cfg, "layers.0.attn", platform=CPU, seed=5)
        layer.allocate_kv_cache(40, max_num_tokens=300)
        table = np.arange(40, dtype=np.int32).reshape(1, 40)
        meta = build_batch([300], [0], table, block_size=cfg.block_size,
                           index_topk=cfg.index_topk)
        x = np.random.default_rng(0).standard_normal((300, cfg.hidden_size)).astype(np.float32)
        layer.forward(x, forward_context=ForwardContext.for_layers(meta, [layer.layer_name]))
        rows[interleaved] = np.sort(layer.topk_indices_buffer[:300], axis=1)
    differ = (rows[False] != rows[True]).any(axis=1)
    assert differ[cfg.index_topk + 10:].mean() > 0.5      # rows with a real choice


# ---- the shapes the models run: top-k widths and MLA heads per rank ----------

@pytest.mark.parametrize("topk,heads", [(512, 16), (1024, 32)])
def test_layer_runs_every_topk_and_head_count(topk, heads):
    """A prefill just past index_topk takes the sparse route with the buffer as wide as
    index_topk, at DeepSeek-V4's top-k widths (512, 1024) and tensor-parallel head
    counts per rank (2048 and 64/128 heads: the v32 and glm5 demo runs)."""
    cfg = MLAConfig.small(index_topk=topk, num_heads=heads, block_size=64)
    layer = DeepseekV32MLA(cfg, "layers.0.attn", platform=CPU, seed=topk)
    tokens = topk + 40
    pages = -(-tokens // cfg.block_size)
    layer.allocate_kv_cache(pages, max_num_tokens=tokens)
    meta = build_batch([tokens], [0], np.arange(pages, dtype=np.int32)[None],
                       block_size=cfg.block_size, index_topk=topk)
    x = np.random.default_rng(0).standard_normal((tokens, cfg.hidden_size)).astype(np.float32)
    y = layer.forward(x, forward_context=ForwardContext.for_layers(meta, [layer.layer_name]))
    assert y.shape == (tokens, cfg.hidden_size) and np.isfinite(y).all()
    rows = layer.topk_indices_buffer
    assert rows.shape == (tokens, topk)
    assert (rows[topk:] >= 0).all()                        # the long rows hold k positions
    assert layer.attention_stats.sparse_tokens == tokens
