"""DeepSeek-V4's MODEL1 MLA cache: the byte layout written independently (ml_dtypes
encoders, the layout as DESIGN and FlashMLA's quantizer state it), exact round
trips, wrapping FlashMLA's strided view, and sparse attention over it with a
sliding-window extra cache and a sink."""

import math

import ml_dtypes
import numpy as np
import pytest

import cpsparse
from cpsparse import MLAKVCache, Model1KVCache
from cpsparse.attention import sparse_mla_attention
from test_attention_extras import oracle

BS = 16
PAGE = -(-BS * 584 // 576) * 576            # 9792: 16 tokens of 584 bytes, rounded to 576


def _data(rng, n):
    return (rng.standard_normal((n, 448)).astype(np.float32) * 3,
            rng.standard_normal((n, 64)).astype(np.float32))


def expected_bytes(k_nope, k_pe, slots, num_blocks):
    """The pages, written token by token from the layout's definition."""
    pages = np.zeros((num_blocks, PAGE), np.uint8)
    for x, r, s in zip(k_nope, k_pe, slots):
        if s < 0:
            continue
        page, t = divmod(int(s), BS)
        row = pages[page, t * 576:(t + 1) * 576]
        scale_bytes = pages[page, BS * 576 + t * 8: BS * 576 + t * 8 + 8]
        for j in range(7):
            tile = x[j * 64:(j + 1) * 64]
            s_inv = max(float(np.float32(np.abs(tile).max() / np.float32(448))), 1e-4)
            e = math.ceil(math.log2(s_inv))
            scale_bytes[j] = e + 127
            codes = (tile.astype(np.float64) / 2.0 ** e).astype(np.float32).astype(
                ml_dtypes.float8_e4m3fn)
            row[j * 64:(j + 1) * 64] = codes.view(np.uint8)
        row[448:] = r.astype(ml_dtypes.bfloat16).view(np.uint8)
    return pages


def test_page_bytes():
    assert cpsparse.reference.cache.model1_page_bytes(64) == 37440
    assert MLAKVCache(3, BS, layout="model1").data.shape == (3, PAGE)


def test_insert_writes_the_documented_bytes():
    rng = np.random.default_rng(0)
    k_nope, k_pe = _data(rng, 6)
    k_nope[2, 64:128] = 0                                  # a zero tile: the 1e-4 floor
    slots = np.array([0, 17, 15, -1, 40, 33], np.int32)
    cache = MLAKVCache(3, BS, layout="model1")
    cache.insert(k_nope, k_pe, slots)
    np.testing.assert_array_equal(cache.data, expected_bytes(k_nope, k_pe, slots, 3))


def test_exact_values_round_trip():
    """Codes whose tile maximum is 448 * 2**e decode back exactly."""
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (4, 448), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0                      # no NaN
    vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    vals = vals.reshape(4, 7, 64)
    vals[:, :, 0] = 448.0                                  # each tile's amax is 448 * 2**e
    expo = rng.integers(-12, 4, (4, 7))
    k_nope = (vals * 2.0 ** expo[..., None]).reshape(4, 448).astype(np.float32)
    k_pe = rng.standard_normal((4, 64)).astype(ml_dtypes.bfloat16).astype(np.float32)
    cache = MLAKVCache(1, BS, layout="model1")
    cache.insert(k_nope, k_pe, np.arange(4, dtype=np.int32))
    rows = cache.gather(np.arange(4, dtype=np.int32))
    np.testing.assert_array_equal(rows, np.concatenate([k_nope, k_pe], axis=1))


def test_wrap_flashmla_view_reads_and_writes_the_peer_bytes():
    rng = np.random.default_rng(2)
    k_nope, k_pe = _data(rng, 5)
    slots = np.array([3, 20, 47, 0, 16], np.int32)
    padded = np.zeros((3, PAGE), np.uint8)                 # FlashMLA's allocation
    view = padded[:, :BS * 584].reshape(3, BS, 1, 584)     # ... and the view it passes
    peer = MLAKVCache.wrap(view, layout="model1", block_size=BS)
    assert isinstance(peer, Model1KVCache) and peer.num_slots == 3 * BS
    peer.insert(k_nope, k_pe, slots)                      # writes into the peer's pages
    np.testing.assert_array_equal(padded, expected_bytes(k_nope, k_pe, slots, 3))
    own = Model1KVCache.wrap(padded, block_size=BS)
    f8 = Model1KVCache.wrap(padded.view(ml_dtypes.float8_e4m3fn), block_size=BS)
    for c in (own, f8):
        np.testing.assert_array_equal(c.gather(slots), peer.gather(slots))
    with pytest.raises(ValueError, match="Invalid layout of data: expected FlashMLA's MODEL1"):
        Model1KVCache.wrap(np.zeros((3, BS * 584), np.uint8).reshape(3, BS, 1, 584),
                           block_size=BS)
    with pytest.raises(ValueError, match=r"Invalid shape of data: expected \[num_blocks, "
                                         r"page_bytes\] \(page_bytes = 9792"):
        Model1KVCache.wrap(np.zeros((3, 9000), np.uint8), block_size=BS)


def test_layout_arguments_are_checked():
    with pytest.raises(ValueError, match="Invalid layout: expected one of"):
        MLAKVCache(2, BS, layout="model2")
    with pytest.raises(ValueError, match="of the model1 layout: expected 448 / 64"):
        MLAKVCache(2, BS, 512, 64, layout="model1")
    with pytest.raises(ValueError, match=r"Invalid shape of kv_c: expected \[N, kv_lora_rank\]"):
        MLAKVCache(2, BS, layout="model1").insert(np.zeros((1, 512), np.float32),
                                                  np.zeros((1, 64), np.float32),
                                                  np.zeros(1, np.int32))


def test_v4_decode_over_model1_with_a_window_cache_and_a_sink():
    """DeepSeek-V4-style decode: top-k slots of the MODEL1 cache, a 128-token window
    of a second MODEL1 cache, a sink per head, d_qk = d_v = 512."""
    rng = np.random.default_rng(3)
    main = MLAKVCache(8, BS, layout="model1")
    window = MLAKVCache(8, BS, layout="model1")
    for c in (main, window):
        c.insert(*_data(rng, c.num_slots), np.arange(c.num_slots, dtype=np.int32))
    tokens, heads = 4, 8
    q = (rng.standard_normal((tokens, heads, 512)) * 0.05).astype(np.float32)
    idx = rng.integers(-1, main.num_slots, (tokens, 64)).astype(np.int32)
    w_idx = np.stack([np.arange(128) for _ in range(tokens)]).astype(np.int32)
    lens = np.array([64, 10, 0, 33], np.int32)
    w_lens = np.array([128, 128, 5, 0], np.int32)
    sink = rng.standard_normal(heads).astype(np.float32)
    out, lse = sparse_mla_attention(q, main, idx, 0.0442, topk_length=lens,
                                    extra_kv_cache=window, extra_indices=w_idx,
                                    extra_topk_length=w_lens, attn_sink=sink)
    assert out.shape == (tokens, heads, 512)
    want = oracle(q, [(main, idx, lens), (window, w_idx, w_lens)], 0.0442, 512, sink)
    np.testing.assert_allclose(out, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, want[1], rtol=1e-6)
