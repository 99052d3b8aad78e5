"""Byte layouts of the indexer key cache and the fp8_ds_mla MLA cache (DESIGN.md 4 and 9).

The oracles compute byte offsets with plain index arithmetic on the flat
``uint8`` buffer, quantize with ml_dtypes, and pack scales with ``struct``
(little-endian float32); nothing from cpsparse.reference is used to predict
what cpsparse writes or reads.
"""

import math
import struct

import ml_dtypes
import numpy as np
import pytest

import cpsparse
from cpsparse import IndexerKCache, MLAKVCache

F8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
FLT_MIN = np.float32(2.0 ** -126)


# ---- independent oracles -----------------------------------------------------

def e4m3_oracle(x):
    """uint8 e4m3fn codes: ml_dtypes RNE, saturated to +-448 (clip first)."""
    x = np.asarray(x, dtype=np.float32)
    return np.clip(x, np.float32(-448.0), np.float32(448.0)).astype(F8).view(np.uint8)


def key_oracle(k, scale_fmt="ue8m0", eps=1e-4):
    """Indexer keys: one group per key (block = D). codes uint8 [N, D], scales float32 [N]."""
    k32 = np.asarray(k).astype(np.float32)
    codes = np.empty(k32.shape, np.uint8)
    scales = np.empty(k32.shape[0], np.float32)
    for i, row in enumerate(k32):
        amax = np.float32(max([abs(float(v)) for v in row], default=0.0))
        s = np.float32(max(amax, np.float32(eps))) / np.float32(448.0)
        if scale_fmt == "ue8m0":
            m, e = math.frexp(float(s))
            s = np.float32(float(s) if m == 0.5 else math.ldexp(1.0, e))
        scales[i] = s
        codes[i] = e4m3_oracle(row / s)
    return codes, scales


def f32_bytes(values):
    values = np.atleast_1d(np.asarray(values, dtype=np.float32))
    return struct.pack("<%df" % values.size, *[float(v) for v in values])


def mla_record_oracle(kv_c_row, k_pe_row):
    """One fp8_ds_mla token record (bytes) and its dequantized float32 row."""
    v = np.asarray(kv_c_row).astype(np.float32)
    codes, scales, deq = [], [], []
    for g in range(v.size // 128):
        grp = v[128 * g:128 * (g + 1)]
        amax = np.float32(max(abs(float(t)) for t in grp))
        s = max(amax / np.float32(448.0), FLT_MIN)   # float32 division, FLT_MIN floor
        c = e4m3_oracle(grp / s)
        codes.append(c)
        scales.append(s)
        deq.append((c.view(F8).astype(np.float64) * float(s)).astype(np.float32))
    rope = np.asarray(k_pe_row).astype(np.float32).astype(BF16)
    rope_bits = rope.view(np.uint16)
    record = (b"".join(c.tobytes() for c in codes) + f32_bytes(scales)
              + struct.pack("<%dH" % rope_bits.size, *[int(b) for b in rope_bits]))
    row = np.concatenate(deq + [rope.astype(np.float32)])
    return record, row


def rows_with_varied_groups(rng, n, width, block=128, lo=-10, hi=10):
    x = rng.standard_normal((n, width // block, block))
    x *= 2.0 ** rng.uniform(lo, hi, size=(n, width // block, 1))
    return x.reshape(n, width).astype(np.float32)


def pattern(rng, shape):
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


# ---- IndexerKCache: construction and layout ---------------------------------------

@pytest.mark.parametrize("nb,bs,d", [(4, 64, 128), (3, 16, 32), (0, 64, 128)])
def test_indexer_cache_shape(nb, bs, d):
    cache = IndexerKCache(num_blocks=nb, block_size=bs, head_dim=d)
    assert cache.data.dtype == np.uint8
    assert cache.data.shape == (nb, bs * (d + 4))
    assert cache.num_blocks == nb and cache.num_slots == nb * bs
    assert cache.page_bytes == bs * (d + 4)
    assert isinstance(cache.data, np.ndarray) and not cache.data.any()


@pytest.mark.parametrize("nb,bs,d", [(5, 64, 128), (6, 16, 32)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16])
def test_indexer_insert_byte_layout(nb, bs, d, dtype):
    rng = np.random.default_rng(100 + bs)
    data = pattern(rng, (nb, bs * (d + 4)))
    before = data.copy()
    cache = IndexerKCache.wrap(data, block_size=bs, head_dim=d)
    n = 3 * bs
    k = rows_with_varied_groups(rng, n, d, block=d, lo=-16, hi=6).astype(dtype)
    k[2] = 0                                    # an all-zero key: scale from eps
    slots = rng.choice(nb * bs, size=n, replace=False).astype(np.int32)
    slots[rng.choice(n, size=n // 4, replace=False)] = -1
    cache.insert(k, slots)
    codes, scales = key_oracle(k)

    flat = data.reshape(-1)
    page = bs * (d + 4)
    touched = np.zeros(flat.size, bool)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, bs)
        c0 = b * page + o * d                      # DESIGN 4: codes at b*page + o*D
        s0 = b * page + bs * d + 4 * o             # scale at b*page + 64*D + 4*o (bs=64)
        assert np.array_equal(flat[c0:c0 + d], codes[i]), (i, slot)
        assert flat[s0:s0 + 4].tobytes() == f32_bytes(scales[i]), (i, slot)
        touched[c0:c0 + d] = True
        touched[s0:s0 + 4] = True
    assert touched.sum() == (n - n // 4) * (d + 4)
    # slot -1 and every other slot: bytes untouched
    assert np.array_equal(flat[~touched], before.reshape(-1)[~touched])
    # the all-zero key really got the eps-derived scale (2^-22 for 1e-4)
    if slots[2] >= 0:
        b, o = divmod(int(slots[2]), bs)
        s0 = b * page + bs * d + 4 * o
        assert struct.unpack("<f", flat[s0:s0 + 4].tobytes())[0] == 2.0 ** -22


def test_indexer_insert_literal_offsets_default_geometry():
    """DESIGN 4 literally: page = 64*132 bytes, codes at b*page + o*128, scale at
    b*page + 64*128 + 4*o."""
    cache = IndexerKCache(num_blocks=3, block_size=64, head_dim=128)
    k = np.zeros((1, 128), np.float32)
    k[0, 0], k[0, 127] = 1.0, -448.0 * 2.0 ** -3   # amax 56 -> s = 56/448 = 2^-3 exactly
    cache.insert(k, np.array([2 * 64 + 5], np.int32))
    flat = cache.data.reshape(-1)
    base = 2 * 64 * 132
    codes = flat[base + 5 * 128: base + 6 * 128]
    assert codes[0] == 0x50            # 1 / 2^-3 = 8 = 2^3: biased exponent 10, mantissa 0
    assert codes[127] == 0xFE          # -448
    assert not codes[1:127].any()
    assert flat[base + 64 * 128 + 20: base + 64 * 128 + 24].tobytes() == f32_bytes(0.125)
    assert np.count_nonzero(flat) == 2 + np.count_nonzero(np.frombuffer(f32_bytes(0.125),
                                                                          np.uint8))


def test_indexer_insert_scale_fmt_none_and_duplicates():
    rng = np.random.default_rng(101)
    cache = IndexerKCache(num_blocks=2, block_size=16, head_dim=32, scale_fmt=None)
    k = rows_with_varied_groups(rng, 3, 32, block=32)
    cache.insert(k, np.array([7, 20, 7], np.int32))   # slot 7 twice: the last wins
    codes, scales = key_oracle(k, scale_fmt=None)
    assert not np.all(np.frexp(scales.astype(np.float64))[0] == 0.5)  # really not pow2
    cv, sv = cache.codes_view(), cache.scales_view()
    assert np.array_equal(cv[0, 7], codes[2]) and sv[0, 7] == scales[2]
    assert np.array_equal(cv[1, 4], codes[1]) and sv[1, 4] == scales[1]


def test_indexer_insert_empty_and_all_skipped():
    rng = np.random.default_rng(102)
    data = pattern(rng, (2, 16 * 36))
    before = data.copy()
    cache = IndexerKCache.wrap(data, block_size=16, head_dim=32)
    cache.insert(np.zeros((0, 32), np.float32), np.zeros(0, np.int32))
    cache.insert(np.ones((3, 32), np.float32), np.full(3, -1, np.int32))
    assert np.array_equal(data, before)


def _ragged_batch(rng, lens, nb, bs, pad_cols=1):
    """Block table with shuffled, non-contiguous pages; unused columns hold junk."""
    need = [-(-n // bs) for n in lens]
    perm = rng.permutation(nb)
    assert sum(need) <= nb
    width = max(need + [0]) + pad_cols
    table = rng.integers(-5, 10 * nb, size=(len(lens), width)).astype(np.int32)
    used = 0
    for r, m in enumerate(need):
        table[r, :m] = perm[used:used + m]
        used += m
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return table, cu


@pytest.mark.parametrize("nb,bs,d", [(20, 16, 32), (12, 64, 128)])
def test_indexer_gather_ragged_shuffled_pages(nb, bs, d):
    rng = np.random.default_rng(103 + bs)
    lens = [0, 2 * bs + 5, 1, 0, 3 * bs, bs, 7] if bs == 16 else [0, 70, 1, 0, 130, 64]
    table, cu = _ragged_batch(rng, lens, nb, bs)
    total = int(cu[-1])
    k = rows_with_varied_groups(rng, total, d, block=d)
    # slot of packed row n (request r, position p), by hand
    slots = np.empty(total, np.int32)
    for r in range(len(lens)):
        for p in range(lens[r]):
            slots[cu[r] + p] = table[r, p // bs] * bs + p % bs
    order = rng.permutation(total)                  # insert in a shuffled order
    cache = IndexerKCache(num_blocks=nb, block_size=bs, head_dim=d)
    cache.insert(k[order], slots[order])
    codes, scales = cache.gather(table, cu)
    want_codes, want_scales = key_oracle(k)
    assert codes.shape == (total, d) and codes.dtype == np.uint8
    assert scales.shape == (total,) and scales.dtype == np.float32
    assert np.array_equal(codes, want_codes)
    assert np.array_equal(scales.view(np.uint32), want_scales.view(np.uint32))
    # dequantized keys are close to the originals (sanity on the whole pipeline)
    deq = codes.view(F8).astype(np.float64) * scales[:, None]
    assert np.all(np.abs(deq - k) <= 2.0 ** -3 * np.abs(k).max(axis=1, keepdims=True))


def test_indexer_gather_reads_bytes_written_by_hand():
    """wrap() an existing array whose pages were filled with index arithmetic."""
    rng = np.random.default_rng(104)
    nb, bs, d = 7, 16, 32
    page = bs * (d + 4)
    data = pattern(rng, (nb, page))
    flat = data.reshape(-1)
    lens = [5, 0, 2 * bs + 3]
    table, cu = _ragged_batch(rng, lens, nb, bs)
    total = int(cu[-1])
    want_codes = pattern(rng, (total, d))
    want_scales = rng.standard_normal(total).astype(np.float32) * 1e-3
    for r in range(len(lens)):
        for p in range(lens[r]):
            n = cu[r] + p
            b, o = int(table[r, p // bs]), p % bs
            flat[b * page + o * d: b * page + (o + 1) * d] = want_codes[n]
            flat[b * page + bs * d + 4 * o: b * page + bs * d + 4 * o + 4] = \
                np.frombuffer(f32_bytes(want_scales[n]), np.uint8)
    cache = IndexerKCache.wrap(data, block_size=bs, head_dim=d)
    assert cache.data is data
    assert cache.num_blocks == nb and cache.num_slots == nb * bs
    codes, scales = cache.gather(table, cu)
    assert np.array_equal(codes, want_codes)
    assert np.array_equal(scales, want_scales)
    # writes through the wrapper land in the caller's array
    cache.insert(np.ones((1, d), np.float32), np.array([0], np.int32))
    # amax 1: s = 1/448 -> ue8m0 2^-8, so every code is e4m3(256) = 0x78
    assert flat[:d].tolist() == [0x78] * d
    assert flat[bs * d: bs * d + 4].tobytes() == f32_bytes(2.0 ** -8)


@pytest.mark.parametrize("lens", [[0, 0, 0], [], [0, 3, 0]])
def test_indexer_gather_empty_requests(lens):
    rng = np.random.default_rng(105)
    cache = IndexerKCache(num_blocks=4, block_size=16, head_dim=32)
    k = rows_with_varied_groups(rng, 64, 32, block=32)
    cache.insert(k, np.arange(64, dtype=np.int32))
    table = np.array([[2, 0]] * len(lens), np.int32).reshape(len(lens), 2)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    codes, scales = cache.gather(table, cu)
    total = int(cu[-1])
    assert codes.shape == (total, 32) and scales.shape == (total,)
    if total:
        want_codes, want_scales = key_oracle(k[32:35])     # page 2, positions 0..2
        assert np.array_equal(codes, want_codes)
        assert np.array_equal(scales, want_scales)


def test_indexer_views_agree_with_data_and_alias_it():
    rng = np.random.default_rng(106)
    nb, bs, d = 3, 16, 32
    page = bs * (d + 4)
    cache = IndexerKCache(num_blocks=nb, block_size=bs, head_dim=d)
    cache.data[...] = pattern(rng, cache.data.shape)
    flat = cache.data.reshape(-1)
    cv, sv = cache.codes_view(), cache.scales_view()
    assert cv.shape == (nb, bs, d) and cv.dtype == np.uint8
    assert sv.shape == (nb, bs) and sv.dtype == np.float32
    for b in range(nb):
        for o in range(bs):
            assert np.array_equal(cv[b, o], flat[b * page + o * d: b * page + (o + 1) * d])
            s0 = b * page + bs * d + 4 * o
            assert sv[b, o].tobytes() == flat[s0:s0 + 4].tobytes()
    assert np.shares_memory(cv, cache.data) and np.shares_memory(sv, cache.data)
    cv[1, 2, :] = 0x11
    sv[2, 5] = 1.5
    assert np.all(flat[page + 2 * d: page + 3 * d] == 0x11)
    assert flat[2 * page + bs * d + 20: 2 * page + bs * d + 24].tobytes() == f32_bytes(1.5)


def test_indexer_insert_quantized_exact_bytes():
    rng = np.random.default_rng(107)
    nb, bs, d = 4, 16, 32
    page = bs * (d + 4)
    data = pattern(rng, (nb, page))
    before = data.copy()
    cache = IndexerKCache.wrap(data, block_size=bs, head_dim=d)
    n = 10
    codes = pattern(rng, (n, d))                       # any bytes, NaN codes included
    scales = (rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 30, n)).astype(np.float32)
    slots = rng.choice(nb * bs, n, replace=False).astype(np.int32)
    slots[3] = -1
    cache.insert_quantized(codes, scales, slots)
    flat, old = data.reshape(-1), before.reshape(-1)
    touched = np.zeros(flat.size, bool)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, bs)
        c0, s0 = b * page + o * d, b * page + bs * d + 4 * o
        assert np.array_equal(flat[c0:c0 + d], codes[i])
        assert flat[s0:s0 + 4].tobytes() == f32_bytes(scales[i])
        touched[c0:c0 + d] = touched[s0:s0 + 4] = True
    assert np.array_equal(flat[~touched], old[~touched])
    table = np.array([np.arange(nb)], np.int32)
    got_codes, got_scales = cache.gather(table, np.array([0, nb * bs], np.int32))
    valid = slots >= 0
    assert np.array_equal(got_codes[slots[valid]], codes[valid])
    assert np.array_equal(got_scales[slots[valid]], scales[valid])


def test_indexer_docstring_example():
    cache = cpsparse.IndexerKCache(num_blocks=4, block_size=64, head_dim=128)
    k = np.random.default_rng(0).standard_normal((3, 128)).astype(np.float32)
    cache.insert(k, np.array([5, -1, 130], dtype=np.int32))
    codes, scales = cache.gather(np.array([[0, 1, 2]], np.int32), np.array([0, 131], np.int32))
    want_codes, want_scales = key_oracle(k)
    assert np.array_equal(codes[5], want_codes[0]) and np.array_equal(codes[130], want_codes[2])
    assert scales[5] == want_scales[0] and scales[130] == want_scales[2]
    untouched = np.setdiff1d(np.arange(131), [5, 130])
    assert not codes[untouched].any() and not scales[untouched].any()


# ---- MLAKVCache (fp8_ds_mla) ----------------------------------------------------------

@pytest.mark.parametrize("lora,rope,token_bytes", [(512, 64, 656), (128, 64, 260),
                                                   (256, 32, 328)])
def test_mla_cache_shape(lora, rope, token_bytes):
    assert token_bytes == lora + 4 * (lora // 128) + 2 * rope
    cache = MLAKVCache(num_blocks=3, block_size=16, kv_lora_rank=lora, rope_dim=rope)
    assert cache.data.shape == (3, 16, token_bytes) and cache.data.dtype == np.uint8
    assert cache.token_bytes == token_bytes
    assert cache.num_slots == 48 and cache.head_dim == lora + rope
    assert cache.records().shape == (48, token_bytes)
    assert np.shares_memory(cache.records(), cache.data)


def test_mla_default_is_656_bytes():
    cache = MLAKVCache(num_blocks=2, block_size=64)
    assert cache.data.shape == (2, 64, 656)


def _mla_inputs(rng, n, lora, rope):
    kv_c = rows_with_varied_groups(rng, n, lora, lo=-12, hi=12)
    kv_c[0, :128] = 0.0                                  # all-zero group: scale FLT_MIN
    kv_c[1, :128] *= np.float32(1e-30)                   # amax / 448 < FLT_MIN
    if lora >= 256:
        kv_c[1, 128:256] = 0.0
        kv_c[1, 130] = np.float32(448.0) * FLT_MIN       # amax / 448 == FLT_MIN exactly
    kv_c[2, 5] = 1.0                                     # amax 1 -> scale 1/448 (not pow2)
    kv_c[2, :128] = np.clip(kv_c[2, :128], -1, 1)
    k_pe = rng.standard_normal((n, rope)).astype(np.float32)
    # bf16 ties: low 16 bits exactly 0x8000 with odd and even high halves
    ties = (rng.integers(0x3000, 0x4700, size=rope, dtype=np.uint32) << 16) | 0x8000
    k_pe[3] = ties.view(np.float32)
    return kv_c, k_pe


@pytest.mark.parametrize("lora,rope", [(512, 64), (128, 64)])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16])
def test_mla_insert_byte_layout(lora, rope, dtype):
    rng = np.random.default_rng(200 + lora)
    nb, bs = 4, 16
    tb = lora + 4 * (lora // 128) + 2 * rope
    data = pattern(rng, (nb, bs, tb))
    before = data.copy()
    cache = MLAKVCache.wrap(data, kv_lora_rank=lora, rope_dim=rope)
    assert cache.data is data and cache.block_size == bs
    n = 20
    kv_c, k_pe = _mla_inputs(rng, n, lora, rope)
    if dtype is not np.float32:
        # the subnormal-group cases only make sense in float32
        kv_c, k_pe = kv_c.astype(dtype), k_pe.astype(dtype)
    slots = rng.choice(nb * bs, n, replace=False).astype(np.int32)
    slots[[4, 9]] = -1
    cache.insert(kv_c, k_pe, slots)
    touched = np.zeros((nb, bs), bool)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, bs)
        record, _ = mla_record_oracle(kv_c[i], k_pe[i])
        assert len(record) == tb
        got = data[b, o].tobytes()
        assert got[:lora] == record[:lora], ("codes", i)
        assert got[lora:lora + 4 * (lora // 128)] == record[lora:lora + 4 * (lora // 128)], \
            ("scales", i)
        assert got[lora + 4 * (lora // 128):] == record[lora + 4 * (lora // 128):], ("rope", i)
        touched[b, o] = True
    assert np.array_equal(data[~touched], before[~touched])


def test_mla_scale_floor_and_not_power_of_two():
    rng = np.random.default_rng(201)
    cache = MLAKVCache(num_blocks=1, block_size=4, kv_lora_rank=256, rope_dim=64)
    kv_c = np.zeros((3, 256), np.float32)
    kv_c[1, :128] = np.float32(1e-40)              # subnormal: amax/448 below FLT_MIN
    kv_c[2, :128] = rng.uniform(-1, 1, 128).astype(np.float32)
    kv_c[2, 7] = 1.0
    kv_c[2, 128:] = rng.uniform(-3, 3, 128).astype(np.float32)
    kv_c[2, 200] = -3.5
    cache.insert(kv_c, np.zeros((3, 64), np.float32), np.array([0, 1, 2], np.int32))
    scales = np.frombuffer(cache.data[0, :3, 256:264].tobytes(), "<f4").reshape(3, 2)
    assert scales[0].tolist() == [2.0 ** -126, 2.0 ** -126]
    assert scales[1].tolist() == [2.0 ** -126, 2.0 ** -126]
    assert scales[2, 0] == np.float32(1.0) / np.float32(448.0)
    assert scales[2, 1] == np.float32(3.5) / np.float32(448.0)  # = 2^-7, exact
    assert scales[2, 1] == 2.0 ** -7
    assert np.frexp(float(scales[2, 0]))[0] != 0.5              # 1/448 is not a power of two
    # code of the 1.0 entry is 448 (0x7E); code of the 1e-40 entry: 1e-40 / 2^-126
    assert cache.data[0, 2, 7] == 0x7E
    assert cache.data[0, 1, 0] == e4m3_oracle(np.float32(1e-40) / FLT_MIN)


@pytest.mark.parametrize("lora,rope", [(512, 64), (128, 64)])
def test_mla_gather_dequantizes(lora, rope):
    rng = np.random.default_rng(202 + lora)
    nb, bs = 3, 16
    cache = MLAKVCache(num_blocks=nb, block_size=bs, kv_lora_rank=lora, rope_dim=rope)
    n = 12
    kv_c, k_pe = _mla_inputs(rng, n, lora, rope)
    slots = rng.choice(nb * bs, n, replace=False).astype(np.int32)
    cache.insert(kv_c, k_pe, slots)
    pick = rng.permutation(n)
    pick = np.concatenate([pick, pick[:3]])          # duplicates are fine
    rows = cache.gather(slots[pick])
    assert rows.dtype == np.float32 and rows.shape == (pick.size, lora + rope)
    want = np.stack([mla_record_oracle(kv_c[i], k_pe[i])[1] for i in pick])
    assert np.array_equal(rows, want)
    # latent error bound: half an e4m3 ulp of each group's amax; rope is bf16
    for j, i in enumerate(pick):
        g = np.abs(kv_c[i].astype(np.float64)).reshape(-1, 128).max(axis=1).repeat(128)
        assert np.all(np.abs(rows[j, :lora] - kv_c[i]) <= 2.0 ** -4 * g * (1 + 1e-6)
                      + 2.0 ** -126)
        assert np.all(np.abs(rows[j, lora:] - k_pe[i]) <= 2.0 ** -8 * np.abs(k_pe[i]))


def test_mla_gather_decodes_arbitrary_bytes():
    """Decoding of records written by someone else (random bytes, NaN codes, any scale)."""
    rng = np.random.default_rng(203)
    lora, rope, nb, bs = 128, 64, 2, 8
    tb = lora + 4 + 2 * rope
    data = pattern(rng, (nb, bs, tb))
    # keep the scales finite and moderate in half of the records
    sane = (rng.uniform(0.5, 2, size=(nb, bs)) * 2.0 ** -8).astype(np.float32)
    data[:, : bs // 2, lora:lora + 4] = sane[:, : bs // 2, None].view(np.uint8).reshape(
        nb, bs // 2, 4)
    cache = MLAKVCache.wrap(data, kv_lora_rank=lora, rope_dim=rope)
    slots = np.arange(nb * bs, dtype=np.int32)[::-1].copy()
    rows = cache.gather(slots)
    recs = data.reshape(-1, tb)[slots]
    codes = recs[:, :lora].copy().view(F8).astype(np.float64)
    scale = np.frombuffer(recs[:, lora:lora + 4].tobytes(), "<f4").astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        latent = (codes * scale[:, None]).astype(np.float32)
    rope_bits = np.frombuffer(recs[:, lora + 4:].tobytes(), "<u2").reshape(-1, rope)
    rope_vals = rope_bits.view(BF16).astype(np.float32)
    np.testing.assert_array_equal(rows[:, :lora], latent)
    np.testing.assert_array_equal(rows[:, lora:], rope_vals)


def test_reference_mla_read_gives_zero_rows_outside_the_cache():
    """The reference read the kernels are checked against (checks off): a slot -1 or past
    the cache reads nothing and gives a zero row; the others decode their records."""
    from cpsparse.reference import cache as cache_ref
    rng = np.random.default_rng(204)
    lora, rope, nb, bs = 128, 64, 2, 4
    cache = MLAKVCache(nb, bs, lora, rope)
    cache.insert(rng.standard_normal((nb * bs, lora)).astype(np.float32),
                 rng.standard_normal((nb * bs, rope)).astype(np.float32),
                 np.arange(nb * bs, dtype=np.int32))
    slots = np.array([3, -1, nb * bs, nb * bs + 7, 0], np.int64)
    rows = cache_ref.mla_read(cache.data, slots, lora, rope)
    assert rows.shape == (5, lora + rope)
    np.testing.assert_array_equal(rows[1:4], 0)
    np.testing.assert_array_equal(rows[[0, 4]], cache.gather(np.array([3, 0], np.int32)))


def test_mla_docstring_example():
    cache = cpsparse.MLAKVCache(num_blocks=2, block_size=64)
    rng = np.random.default_rng(0)
    kv_c = rng.standard_normal((2, 512)).astype(np.float32)
    k_pe = rng.standard_normal((2, 64)).astype(np.float32)
    cache.insert(kv_c, k_pe, np.array([0, 70], np.int32))
    rows = cache.gather(np.array([70, 0], np.int32))
    assert rows.shape == (2, 576)
    assert np.array_equal(rows[0], mla_record_oracle(kv_c[1], k_pe[1])[1])
    assert np.array_equal(rows[1], mla_record_oracle(kv_c[0], k_pe[0])[1])
    assert cache.data[1, 6].tobytes() == mla_record_oracle(kv_c[1], k_pe[1])[0]
