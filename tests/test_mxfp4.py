"""The MXFP4 indexer key cache (DeepGEMM's FP4 pages on Hopper): the codec and the
page bytes written independently, the logits over MXFP4 keys against the
unquantized float64 scores (DeepGEMM's calc_diff < 0.02), the top-k recall against
FP8 keys, and the layer selecting the cache from MLAConfig."""

import ml_dtypes
import numpy as np
import pytest

import cpsparse
from cpsparse.indexer import mqa_logits, paged_mqa_logits, topk_per_row
from cpsparse.metadata import ForwardContext, build_batch
from cpsparse.mla import DeepseekV32MLA, MLAConfig
from cpsparse.platform import StaticPlatform
from cpsparse.reference import fp4

D, BS = 128, 16


def calc_diff(x, y):
    """DeepGEMM's metric: 1 - 2 x.y / (x.x + y.y)."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    return 1 - 2 * (x * y).sum() / ((x * x).sum() + (y * y).sum())


def test_e2m1_codes_match_ml_dtypes_and_tie_toward_zero():
    grid = np.array([0, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7, 100, -0.25,
                     -0.3, -2.6, -0.0, np.nan], np.float32)
    codes = fp4.e2m1_encode(grid)
    vals = fp4.e2m1_decode(codes)
    assert list(vals[:12]) == [0, 0, 0.5, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0, 6.0]
    assert list(vals[12:16]) == [0, -0.5, -3.0, 0] and codes[15] == 0 and codes[12] == 0
    # the 16 codes decode as ml_dtypes' float4_e2m1fn does
    table = np.arange(16, dtype=np.uint8)
    want = np.array([ml_dtypes.float4_e2m1fn(float(v)) for v in fp4.e2m1_decode(table)],
                    np.float64)
    np.testing.assert_array_equal(fp4.e2m1_decode(table), want)


def _expected_page_bytes(k, slots, num_blocks):
    """DeepGEMM's per_token_cast_to_fp4 (ue8m0, gran 32, packed) and its page layout,
    written from its definition: codes then one int32 of 4 exponent bytes a key."""
    page = BS * (D // 2 + 4)
    pages = np.zeros((num_blocks, page), np.uint8)
    for x, s in zip(k, slots):
        if s < 0:
            continue
        blk, off = divmod(int(s), BS)
        packed = np.zeros(D // 2, np.uint8)
        for g in range(D // 32):
            grp = x[32 * g:32 * (g + 1)]
            sf = np.float32(max(float(np.abs(grp).max()), 1e-4)) / np.float32(6)
            bits = np.float32(sf).view(np.uint32)
            e = int((bits >> 23) & 0xFF) + int((bits & 0x7FFFFF) != 0)   # ceil to 2**e
            pages[blk, BS * D // 2 + 4 * off + g] = e
            scaled = grp * np.float32(2.0 ** (127 - e))
            codes = np.array([sum(abs(v) > m for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5))
                              | ((v < 0 and any(abs(v) > m for m in (0.25,))) << 3)
                              for v in scaled], np.uint8)
            packed[16 * g:16 * (g + 1)] = codes[0::2] | (codes[1::2] << 4)
        pages[blk, off * D // 2:(off + 1) * D // 2] = packed
    return pages


def test_insert_writes_deepgemm_pages():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((7, D)).astype(np.float32) * 2
    k[3, :32] = 0                                          # a zero group: the 1e-4 floor
    slots = np.array([0, 5, 17, 31, -1, 40, 20], np.int32)
    cache = cpsparse.IndexerKCache(3, BS, D, dtype="mxfp4")
    cache.insert(k, slots)
    assert cache.data.shape == (3, BS * 68) and cache.page_bytes == BS * 68
    np.testing.assert_array_equal(cache.data, _expected_page_bytes(k, slots, 3))
    peer = cpsparse.IndexerKCache.wrap(cache.data.reshape(3, BS, 1, 68), BS, D,
                                       dtype="mxfp4")
    table = np.array([[0, 1, 2]], np.int32)
    a = cache.gather(table, np.array([0, 48], np.int32))
    b = peer.gather(table, np.array([0, 48], np.int32))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_insert_pads_scale_words_with_127_and_ignores_nan():
    """D = 64: two scale bytes a key, padded to a 4-byte word with 127 (2**0) as DeepGEMM
    packs them; a NaN in a group does not set its scale (it is ignored, as by the FP8
    quantizer): the group's byte is that of the group with the NaN at 0."""
    d = 64
    rng = np.random.default_rng(1)
    k = (rng.standard_normal((3, d)) * 3).astype(np.float32)
    k[1, 40] = np.nan
    cache = cpsparse.IndexerKCache(1, BS, d, dtype="mxfp4")
    cache.insert(k, np.array([0, 1, 2], np.int32))
    words = cache.data[0, BS * d // 2:].reshape(BS, 4)[:3]
    assert (words[:, 2:] == 127).all()
    clean = k.copy()
    clean[1, 40] = 0
    _, want = fp4.quantize(clean)
    np.testing.assert_array_equal(words[:, :2], want)


def _scores(q, k, w):
    """float64 sum_h w * relu(q . k) of unquantized q [M, H, D], k [N, D]."""
    return (np.maximum(np.einsum("mhd,nd->mhn", q, k), 0) * w[:, :, None]).sum(axis=1)


@pytest.mark.parametrize("keys", ["normal", "trained"])
def test_logits_accuracy_and_recall(keys):
    """Against the float64 scores of the unquantized queries and keys: calc_diff < 0.02
    (DeepGEMM's FP4 test bound); top-k recall of MXFP4 against FP8 keys reported by
    the assertion bounds. "trained": keys with a few large outlier channels and a
    shared offset (the shape of real post-LayerNorm indexer keys), queries correlated
    with some keys."""
    rng = np.random.default_rng(1 if keys == "normal" else 2)
    m, n, h, k_top = 16, 4096, 8, 256
    kf = rng.standard_normal((n, D)).astype(np.float32)
    if keys == "trained":
        kf = kf * np.exp(rng.standard_normal(D) * 0.5).astype(np.float32) + \
            rng.standard_normal(D).astype(np.float32) * 0.5
        kf[:, rng.choice(D, 4, replace=False)] *= 6
    qf = rng.standard_normal((m, h, D)).astype(np.float32)
    qf += 0.5 * kf[rng.integers(0, n, m)][:, None, :]
    w = rng.random((m, h)).astype(np.float32)
    exact = _scores(qf.astype(np.float64), kf.astype(np.float64), w.astype(np.float64))
    q8, qs = cpsparse.quantize_fp8(qf, eps=1e-10)
    wq = w * qs[..., 0]
    ks, ke = np.zeros(m, np.int32), np.full(m, n, np.int32)
    k8, k8s = cpsparse.quantize_fp8(kf)
    packed, sb = fp4.quantize(kf)
    fp8_logits = mqa_logits(q8, k8, k8s[:, 0], wq, ks, ke)
    fp4_logits = mqa_logits(q8, packed, sb, wq, ks, ke)
    assert calc_diff(fp4_logits, exact) < 0.02
    assert calc_diff(fp8_logits, exact) < calc_diff(fp4_logits, exact)
    top8 = topk_per_row(fp8_logits, ks, ke, k_top)
    top4 = topk_per_row(fp4_logits, ks, ke, k_top)
    recall = np.mean([len(set(a) & set(b)) / k_top for a, b in zip(top8, top4)])
    assert recall > 0.75, recall


def test_paged_and_prefill_agree_on_mxfp4_keys():
    rng = np.random.default_rng(3)
    cache = cpsparse.IndexerKCache(4, BS, D, dtype="mxfp4")
    n = 4 * BS
    cache.insert(rng.standard_normal((n, D)).astype(np.float32), np.arange(n, dtype=np.int32))
    q8, qs = cpsparse.quantize_fp8(rng.standard_normal((2, 1, 8, D)).astype(np.float32),
                                   eps=1e-10)
    w = rng.random((2, 8)).astype(np.float32)
    table = np.array([[0, 1], [3, 2]], np.int32)
    lens = np.array([30, 17], np.int32)
    paged = paged_mqa_logits(q8, cache, w, lens, table, 32)
    for b in range(2):
        codes, sb = cache.gather(table[b:b + 1], np.array([0, lens[b]], np.int32))
        want = mqa_logits(q8[b], codes, sb, w[b:b + 1], np.zeros(1, np.int32),
                          lens[b:b + 1])
        np.testing.assert_array_equal(paged[b, :lens[b]], want[0])
        assert np.all(paged[b, lens[b]:] == -np.inf)
    with pytest.raises(ValueError, match=r"Invalid shape of k_codes: expected \[N, D / 2\]"):
        mqa_logits(q8[0], np.zeros((5, D), np.uint8), np.zeros((5, 4), np.uint8), w[:1],
                   np.zeros(1, np.int32), np.ones(1, np.int32))
    with pytest.raises(ValueError, match="Invalid cache for insert_quantized"):
        cache.insert_quantized(np.zeros((1, D), np.uint8), np.ones(1, np.float32),
                               np.zeros(1, np.int32))


def test_layer_uses_the_configured_key_format():
    cfg = MLAConfig.small(index_cache_dtype="mxfp4")
    layer = DeepseekV32MLA(cfg, "layers.0.attn", platform=StaticPlatform(cuda=False), seed=4)
    layer.allocate_kv_cache(40, max_num_tokens=300)
    assert layer.indexer_cache.dtype == "mxfp4"
    assert layer.indexer_cache.page_bytes == cfg.block_size * (cfg.index_head_dim // 2 + 4)
    table = np.arange(40, dtype=np.int32).reshape(1, 40)
    meta = build_batch([300], [0], table, block_size=cfg.block_size, index_topk=cfg.index_topk)
    x = np.random.default_rng(0).standard_normal((300, cfg.hidden_size)).astype(np.float32)
    layer.forward(x, forward_context=ForwardContext.for_layers(meta, [layer.layer_name]))
    assert layer.indexer.stats.scored_calls == 1
    rows = layer.topk_indices_buffer[:300]
    assert (rows[cfg.index_topk:] >= 0).all()              # long rows: k real positions
    with pytest.raises(ValueError, match="Invalid MLAConfig.index_cache_dtype"):
        MLAConfig(index_cache_dtype="fp4")


def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode): byte n of the result is byte (nibble n of sel) & 7 of
    {a, b}, or, where that nibble's bit 3 is set, the selected byte's msb replicated."""
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for n in range(4):
        nib = (sel >> (4 * n)) & 0xF
        byte = pool[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * n)
    return out


@pytest.mark.parametrize("d", range(-5, 1))
def test_kernel_expansion_bytes_are_the_negated_codes(d):
    """The MXFP4 decode kernels' register expansion (indexer.cu: cps_e2m1_table's integer
    table and cps_e2m1x8_to_neg_e4m3), written out bit by bit: every e2m1 code in every
    nibble of a word becomes the e4m3 byte of -(code value * 2**d), which the wgmma
    scales by -1 back to the key (a sign flip: exact). The GPU tests hold the kernels to
    the reference; this holds the bit trick to its comment, on the CPU."""
    drop = (-d) << 3
    lo = (0x3C383000 - drop * 0x01010100) & 0xFFFFFFFF
    hi = (0x4C484440 - drop * 0x01010101) & 0xFFFFFFFF
    k40 = 0x40404040
    rng = np.random.default_rng(7)
    words = [int(w) for w in rng.integers(0, 2**32, size=64, dtype=np.uint64)]
    words += [sum(c << (4 * i) for i in range(8)) for c in range(16)]   # a code everywhere
    for c in words:
        ch = c >> 16
        lo4 = (_prmt(lo, hi, c & 0x7777) + (_prmt(k40, k40, c & 0xFFFF) << 1)) & 0xFFFFFFFF
        hi4 = (_prmt(lo, hi, ch & 0x7777) + (_prmt(k40, k40, ch) << 1)) & 0xFFFFFFFF
        got = np.frombuffer(np.array([lo4, hi4], "<u4").tobytes(), ml_dtypes.float8_e4m3fn)
        codes = np.array([(c >> (4 * i)) & 0xF for i in range(8)], np.uint8)
        want = -fp4.e2m1_decode(codes).astype(np.float64) * 2.0 ** d
        np.testing.assert_array_equal(got.astype(np.float64), want, err_msg=f"word {c:#010x}")
