"""GPU: sparse MLA attention (fp8_ds_mla cache and dense bf16 workspace), dense causal
MLA and the slot mapping, against the float64 NumPy reference on host copies.

Most inputs are drawn exactly representable in bf16 (q, dense rows, fp8 scales with
a 4-bit mantissa so that code * scale is a bf16 value): the kernels' bf16 operands
then carry no input rounding and the check measures the kernel's own arithmetic
(fp32 accumulation, bf16 probabilities). ``test_sparse_fp8_arbitrary_inputs`` uses
plain float32 data through ``MLAKVCache.insert`` on full rows. Every case first checks
that the kernels cover it (``cpsparse.raw_kernels.attention.supports`` /
``supports_rows``), so the public op runs the CUDA kernel, not the reference fallback.
"""

import numpy as np
import pytest

import cpsparse
from cpsparse._backend import KernelFallbackWarning
from cpsparse.attention import (dense_mla_attention, local_to_global_slots, softmax_scale,
                                sparse_mla_attention)
from cpsparse.reference import attention as ref_attention
from cpsparse.reference import cache as cache_ref

pytestmark = pytest.mark.gpu

OUT_RTOL = 1e-2
LSE_ATOL = 1e-3
SCALE = softmax_scale(128, 64)
BLOCK = 64


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.fixture(scope="module")
def katt():
    from cpsparse.raw_kernels import attention
    return attention


def bf16_round(x):
    """float32 values rounded to the nearest bf16 (ties to even), kept as float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return u.view(np.float32)


def bf16_normal(rng, shape, std=1.0, dtype=np.float32):
    x = bf16_round(rng.standard_normal(shape).astype(np.float32) * std)
    x[np.abs(x) < 1e-3] = 0.0              # stay exact in float16 too
    return x.astype(dtype)


def exact_fp8_records(rng, n):
    """fp8_ds_mla records whose dequantized values are exact bf16 numbers."""
    codes = rng.integers(0, 256, (n, 512), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0                      # no NaN codes
    mant = rng.integers(0, 8, (n, 4))
    expo = rng.integers(-10, -6, (n, 4))
    scales = np.ldexp(1.0 + mant / 8.0, expo).astype(np.float32)
    rope = bf16_normal(rng, (n, 64)).view(np.uint32) >> 16
    return np.concatenate([codes, scales.view(np.uint8).reshape(n, 16),
                           rope.astype(np.uint16).view(np.uint8).reshape(n, 128)], axis=1)


def ragged_indices(rng, tokens, topk, num_slots):
    """Rows: full with repeats, ragged prefix, scattered -1, empty, one valid entry."""
    idx = rng.integers(0, num_slots, (tokens, topk)).astype(np.int32)
    for t in range(tokens):
        kind = t % 5
        if kind == 0:
            idx[t, 10:40] = idx[t, 3]                      # a slot listed 31 times
        elif kind == 1:
            idx[t, rng.integers(1, topk):] = -1
        elif kind == 2:
            idx[t, rng.random(topk) < 0.4] = -1
        elif kind == 3:
            idx[t] = -1                                    # no valid key at all
        else:
            keep = rng.integers(0, topk)
            idx[t, :] = -1
            idx[t, keep] = rng.integers(0, num_slots)
    return idx


def poison_pool(cp, nbytes=256 << 20):
    """Fill the memory pool with NaN so an unwritten output element shows up."""
    x = cp.full(nbytes // 4, np.nan, dtype=cp.float32)
    del x


def compare(got, exp, rtol=OUT_RTOL, atol=LSE_ATOL):
    """Error message, or None when (out, lse) match the reference."""
    out, lse = (a.get() for a in got)
    e_out, e_lse = exp
    if out.shape != e_out.shape or lse.shape != e_lse.shape:
        return f"shapes {out.shape}, {lse.shape} vs {e_out.shape}, {e_lse.shape}"
    if not np.isfinite(out).all():
        return f"{int((~np.isfinite(out)).sum())} non-finite outputs"
    err = np.linalg.norm(out - e_out) / max(np.linalg.norm(e_out), 1e-30)
    if err > rtol:
        return f"out relative error {err:.3g} > {rtol}"
    fin = np.isfinite(e_lse)
    if not np.array_equal(np.isfinite(lse), fin) or np.isnan(lse).any():
        return "lse finiteness differs from the reference (or NaN)"
    if not (lse[~fin] == -np.inf).all():
        return "empty rows must have lse = -inf"
    if not (out[~fin] == 0).all():
        return "empty rows must have out = 0"
    if fin.any():
        lerr = float(np.abs(lse[fin] - e_lse[fin]).max())
        if lerr > atol:
            return f"lse max abs error {lerr:.3g} > {atol}"
    return None


def covered(katt, q, rows, d_v=512, fp8=False):
    """Assert the kernels cover (q, rows, d_v): the public op then runs them."""
    assert katt.supports(q.shape, d_v), f"kernels do not cover q {q.shape}, d_v {d_v}"
    assert katt.supports_rows(rows, fp8), f"kernels do not read rows {rows.shape} (fp8={fp8})"


def check_kernel(cp, run, exp, **tol):
    """Run on a NaN-poisoned pool and compare (out, lse) with the reference."""
    poison_pool(cp)
    msg = compare(run(), exp, **tol)
    assert msg is None, msg


@pytest.mark.parametrize("heads,topk,tokens", [(16, 512, 5), (64, 2048, 5), (128, 2048, 5),
                                               (128, 512, 6), (96, 512, 5)])
def test_sparse_fp8_cache(cp, katt, heads, topk, tokens):
    rng = np.random.default_rng(heads * 7 + topk + tokens)
    num_blocks = 70
    records = exact_fp8_records(rng, num_blocks * BLOCK)
    host = cpsparse.MLAKVCache.wrap(records.reshape(num_blocks, BLOCK, -1))
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
    q = bf16_normal(rng, (tokens, heads, 576))
    idx = ragged_indices(rng, tokens, topk, host.num_slots)
    exp = sparse_mla_attention(q, host, idx, SCALE)
    q_d, idx_d = cp.asarray(q), cp.asarray(idx)
    covered(katt, q_d, dev.records(), fp8=True)
    check_kernel(cp, lambda: sparse_mla_attention(q_d, dev, idx_d, SCALE), exp)


@pytest.mark.parametrize("splits", [1, 3])
def test_sparse_fp8_masked_tiles(cp, katt, splits):
    """The fp8 decode schedule does not skip a tile with no valid key (its P is 0, the
    running max passes through): masked tiles first, between valid ones and last, a row
    whose only key is the last of its partial last tile, a row with no valid key, and
    every other tile masked; with one split and three (a split may then start, or be
    made only of, masked tiles)."""
    rng = np.random.default_rng(17 + splits)
    num_blocks, tokens, heads, topk = 70, 6, 128, 8 * 64 + 7      # 9 tiles, last partial
    records = exact_fp8_records(rng, num_blocks * BLOCK)
    host = cpsparse.MLAKVCache.wrap(records.reshape(num_blocks, BLOCK, -1))
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
    n = host.num_slots
    q = bf16_normal(rng, (tokens, heads, 576))
    idx = rng.integers(0, n, (tokens, topk)).astype(np.int32)
    idx[0, :192] = -1                                 # tiles 0-2
    idx[1, 128:320] = -1                              # tiles 2-4, between valid ones
    idx[2, 448:] = -1                                 # tiles 7-8
    idx[3, :-1] = -1                                  # one key, the very last
    idx[4, :] = -1                                    # none
    for t in range(0, 9, 2):
        idx[5, 64 * t:64 * t + 64] = -1               # tiles 0, 2, 4, 6, 8
    exp = sparse_mla_attention(q, host, idx, SCALE)
    q_d, idx_d = cp.asarray(q), cp.asarray(idx)
    covered(katt, q_d, dev.records(), fp8=True)
    check_kernel(cp, lambda: katt.sparse_mla_attention(cp, q_d, dev.records(), idx_d, SCALE, 512,
                                                       True, splits=splits), exp)


def test_sparse_fp8_arbitrary_inputs(cp, katt):
    """float32 q and latents through the cache's own quantizer; full rows of 2048 keys.

    Against the float64 reference on the bf16-rounded operands (what the tensor
    cores see: q, and code * scale rounded to bf16) the usual tolerances hold. Against
    the reference on the raw inputs, lse carries the bf16 rounding of both operands
    (about 2.5e-3 at most here, measured on the host with this data), so 5e-3.
    """
    rng = np.random.default_rng(11)
    num_blocks, tokens, heads = 80, 4, 128
    host = cpsparse.MLAKVCache(num_blocks, BLOCK)
    n = host.num_slots
    host.insert(rng.standard_normal((n, 512)).astype(np.float32),
                rng.standard_normal((n, 64)).astype(np.float32),
                np.arange(n, dtype=np.int32))
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
    q = rng.standard_normal((tokens, heads, 576)).astype(np.float32)
    idx = rng.integers(0, n, (tokens, 2048)).astype(np.int32)
    exp_raw = sparse_mla_attention(q, host, idx, SCALE)
    rows = cache_ref.mla_decode(host.records(), 512, 64).astype(np.float32)
    exp_bf16 = sparse_mla_attention(bf16_round(q), bf16_round(rows), idx, SCALE)
    q_d, idx_d = cp.asarray(q), cp.asarray(idx)

    def run():
        return sparse_mla_attention(q_d, dev, idx_d, SCALE)

    covered(katt, q_d, dev.records(), fp8=True)
    check_kernel(cp, run, exp_bf16)
    check_kernel(cp, run, exp_raw, atol=5e-3)


@pytest.mark.parametrize("heads,topk,dtype", [(16, 512, np.float16), (64, 2048, np.float32),
                                              (128, 2048, np.float16), (128, 512, np.float32),
                                              (40, 512, np.float16)])
def test_sparse_dense_workspace(cp, katt, heads, topk, dtype):
    rng = np.random.default_rng(heads + topk)
    tokens, rows = 5, 3000
    kv = bf16_normal(rng, (rows, 576), dtype=dtype)
    q = bf16_normal(rng, (tokens, heads, 576), dtype=dtype)
    idx = ragged_indices(rng, tokens, topk, rows)
    exp = sparse_mla_attention(q, kv, idx, SCALE)
    q_d, kv_d, idx_d = cp.asarray(q), cp.asarray(kv), cp.asarray(idx)
    covered(katt, q_d, kv_d)
    check_kernel(cp, lambda: sparse_mla_attention(q_d, kv_d, idx_d, SCALE), exp)


def test_sparse_bf16_masked_pairs(cp, katt):
    """The prefill kernel takes its tiles in pairs (one per math warpgroup) and skips a
    pair with no valid key: masked pairs at the start, in the middle and at the end,
    one masked tile of a pair, an odd tile count with a partial last tile, a row whose
    only keys are in the last partial tile, slots past the rows and negative ones."""
    rng = np.random.default_rng(11)
    tokens, heads, rows, topk = 8, 128, 900, 7 * 64 + 5         # 8 tiles: 4 pairs
    kv = bf16_normal(rng, (rows, 576))
    q = bf16_normal(rng, (tokens, heads, 576))
    idx = rng.integers(0, rows, (tokens, topk)).astype(np.int32)
    idx[0, 0:128] = -1                   # pair 0 masked
    idx[1, 128:256] = -1                 # pair 1 masked
    idx[2, 256:] = -1                    # pairs 2 and 3 masked
    idx[3, 64:128] = -1                  # tile 1 of pair 0 only
    idx[4, :448] = -1                    # only the partial last tile
    idx[5, :] = -1
    idx[5, 200] = rows - 1               # one key
    idx[6, ::3] = rows + 5               # out of range: masked, never read
    idx[7, 1::2] = -7
    exp = sparse_mla_attention(q, kv, np.where((idx >= 0) & (idx < rows), idx, -1), SCALE)
    q_d, kv_d, idx_d = cp.asarray(q), cp.asarray(kv), cp.asarray(idx)
    covered(katt, q_d, kv_d)
    poison_pool(cp)
    got = katt.sparse_mla_attention(cp, q_d, kv_d, idx_d, SCALE, 512, False, splits=1)
    msg = compare(got, exp)
    assert msg is None, msg


@pytest.mark.parametrize("scale", [0.0, -0.05])
def test_nonpositive_scale_with_masked_keys(cp, katt, scale, monkeypatch):
    """sm_scale <= 0 (legal if unusual) with masked keys: the dense rows run on the
    reference (the kernel masks before scaling; a warning says so), the fp8 cache in
    its kernel (it scales first); both match the reference."""
    rng = np.random.default_rng(12)
    host = cpsparse.MLAKVCache.wrap(exact_fp8_records(rng, 8 * BLOCK).reshape(8, BLOCK, -1))
    rows = bf16_normal(rng, (8 * BLOCK, 576))
    q = bf16_normal(rng, (4, 64, 576))
    idx = ragged_indices(rng, 4, 300, 8 * BLOCK)
    for src_h, src_d in ((rows, cp.asarray(rows)),
                         (host, cpsparse.MLAKVCache.wrap(cp.asarray(host.data)))):
        exp = sparse_mla_attention(q, src_h, idx, scale)
        q_d, idx_d = cp.asarray(q), cp.asarray(idx)
        if isinstance(src_h, np.ndarray):
            # the warning comes once per (op, shape): forget the earlier parameter's
            monkeypatch.setattr(cpsparse._backend, "_FALLBACKS_WARNED", set())
            with pytest.warns(KernelFallbackWarning):
                got = sparse_mla_attention(q_d, src_d, idx_d, scale)
        else:
            got = sparse_mla_attention(q_d, src_d, idx_d, scale)
        msg = compare(got, exp)
        assert msg is None, msg


def test_sparse_d_v_and_empty_topk(cp, katt):
    rng = np.random.default_rng(5)
    kv = bf16_normal(rng, (300, 576))
    q = bf16_normal(rng, (3, 16, 576))
    idx = ragged_indices(rng, 3, 100, 300)             # topk not a multiple of 64
    exp = sparse_mla_attention(q, kv, idx, 0.05, d_v=256)
    q_d, kv_d, idx_d = cp.asarray(q), cp.asarray(kv), cp.asarray(idx)
    covered(katt, q_d, kv_d, d_v=256)
    check_kernel(cp, lambda: sparse_mla_attention(q_d, kv_d, idx_d, 0.05, d_v=256), exp)
    out, lse = sparse_mla_attention(q_d, kv_d, cp.zeros((3, 0), cp.int32), 0.05)
    assert (out.get() == 0).all() and (lse.get() == -np.inf).all()


def test_dense_causal(cp, katt):
    rng = np.random.default_rng(3)
    q_lens, k_lens = [3, 70, 1, 5, 130], [3, 200, 150, 3, 130]   # request 3: q_len > k_len
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    heads = 64
    q = bf16_normal(rng, (cu_q[-1], heads, 576))
    kv = bf16_normal(rng, (cu_k[-1], 576), dtype=np.float16)
    exp = dense_mla_attention(q, kv, SCALE, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    args = (cp.asarray(q), cp.asarray(kv))
    cu = dict(cu_seqlens_q=cp.asarray(cu_q), cu_seqlens_k=cp.asarray(cu_k))
    covered(katt, args[0], args[1])
    check_kernel(cp, lambda: dense_mla_attention(*args, SCALE, **cu), exp)


def test_local_to_global_slots(cp):
    rng = np.random.default_rng(9)
    reqs, max_blocks, tokens, topk = 4, 9, 37, 300
    table = rng.permutation(reqs * max_blocks).reshape(reqs, max_blocks).astype(np.int32)
    idx = rng.integers(0, max_blocks * BLOCK, (tokens, topk)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.2] = -1
    req = rng.integers(0, reqs, tokens).astype(np.int32)
    exp = ref_attention.local_to_global_slots(idx, req, table, BLOCK)
    got = local_to_global_slots(cp.asarray(idx), cp.asarray(req), cp.asarray(table), BLOCK)
    assert got.dtype == cp.int32
    assert np.array_equal(got.get(), exp)


# ---- split-KV decoding ----------------------------------------------------------
# FlashMLA's own test tolerances (tests/test_flash_mla_*.py there), per element:
# out within 1e-3 or 2.01/128 relative, lse within 1e-6 or 8.01/65536 relative.
FLASHMLA_OUT = (1e-3, 2.01 / 128)
FLASHMLA_LSE = (1e-6, 8.01 / 65536)


def assert_flashmla_close(got, exp, what, out_tol=FLASHMLA_OUT, lse_tol=FLASHMLA_LSE):
    (out, lse), (e_out, e_lse) = (a.get() for a in got), exp
    for name, g, e, (atol, rtol) in (("out", out, e_out, out_tol),
                                     ("lse", lse, e_lse, lse_tol)):
        same_inf = (g == e) & ~np.isfinite(e)
        err = np.abs(g.astype(np.float64) - e)
        ok = same_inf | (err <= atol) | (err <= rtol * np.abs(e))
        assert ok.all(), (f"{what}: {name} outside FlashMLA's tolerance at "
                          f"{int((~ok).sum())} of {ok.size} elements, worst error "
                          f"{float(np.nanmax(np.where(ok, 0, err))):.3g}")


FLASHMLA_PREFILL_OUT = (8e-4, 3.01 / 128)
FLASHMLA_PREFILL_LSE = (1e-6, 2.01 / 65536)


@pytest.mark.parametrize("heads", [64, 128])
def test_prefill_within_flashmla_prefill_tolerance(cp, katt, heads):
    """The data and tolerances of FlashMLA's sparse-prefill test (q, kv ~ N(0, 1) / 10
    plus an offset, in bf16; sm_scale 0.5; distinct indices with invalid ones of every
    kind: -2**31, -1, s_kv, 2**31 - 1), per element, on the dense-rows kernel."""
    rng = np.random.default_rng(heads)
    tokens, s_kv, topk = 40, 4096, 2048
    off_q, off_kv = rng.random(2) - 0.5
    q = bf16_round((rng.standard_normal((tokens, heads, 576)) / 10 + off_q / 10)
                   .clip(-10, 10).astype(np.float32))
    kv = bf16_round((rng.standard_normal((s_kv, 576)) / 10 + off_kv / 10)
                    .clip(-10, 10).astype(np.float32))
    idx = np.stack([rng.permutation(s_kv)[:topk] for _ in range(tokens)]).astype(np.int32)
    bad = np.array([-2**31, -123456, -1, s_kv, 114514, 2**31 - 1], dtype=np.int32)
    hole = rng.random(idx.shape) < 0.1
    idx[hole] = rng.choice(bad, int(hole.sum()))
    idx[3] = -1                                          # a row with no valid key
    exp = sparse_mla_attention(q, kv, np.where((idx >= 0) & (idx < s_kv), idx, -1), 0.5)
    q_d, kv_d, idx_d = cp.asarray(q), cp.asarray(kv), cp.asarray(idx)
    covered(katt, q_d, kv_d)
    poison_pool(cp)
    got = katt.sparse_mla_attention(cp, q_d, kv_d, idx_d, 0.5, 512, False)
    assert_flashmla_close(got, exp, f"prefill H={heads}", FLASHMLA_PREFILL_OUT,
                          FLASHMLA_PREFILL_LSE)


def flashmla_like_q(rng, shape):
    """Queries as FlashMLA's sparse decoding test draws them: normal, clamped to [-1, 1]
    (tests/lib.py there), in bf16."""
    return bf16_round(np.clip(rng.standard_normal(shape), -1, 1).astype(np.float32))


def flashmla_like_cache(rng, num_blocks):
    """A cache filled as FlashMLA's test fills its own (latents normal / 10, clamped to
    [-1, 1], through the quantizer), and the rows the tensor cores see (code * scale
    and RoPE, in bf16)."""
    host = cpsparse.MLAKVCache(num_blocks, BLOCK)
    n = host.num_slots

    def draw(width):
        return np.clip(rng.standard_normal((n, width)) / 10, -1, 1).astype(np.float32)
    host.insert(draw(512), draw(64), np.arange(n, dtype=np.int32))
    rows = bf16_round(cache_ref.mla_decode(host.records(), 512, 64).astype(np.float32))
    return host, rows


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8_cache", "bf16_rows"])
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 16, 64])
def test_split_kv_matches_reference(cp, katt, fp8, splits):
    """Every split count gives the one-pass answer within FlashMLA's tolerances on the
    data of FlashMLA's own test: ragged rows (empty, one key, -1 holes, a slot repeated
    31 times, rows whose valid keys all fall in one split).

    (On wider data, normal q and latents, a few elements in 10^4 exceed 1e-3 where a
    row's output cancels to near zero, at splits=1 too: the bf16 probabilities of P V,
    as in FlashMLA; test_sparse_fp8_cache bounds that regime by the norm.)"""
    rng = np.random.default_rng(100 + splits + fp8)
    tokens, heads, topk = 6, 128, 2048
    host, rows_h = flashmla_like_cache(rng, 70)
    n = host.num_slots
    rows_d = cpsparse.MLAKVCache.wrap(cp.asarray(host.data)).records() if fp8 \
        else cp.asarray(rows_h)
    q = flashmla_like_q(rng, (tokens, heads, 576))
    idx = ragged_indices(rng, tokens, topk, n)
    idx[5, :] = -1
    idx[5, 1500:1510] = rng.integers(0, n, 10)          # valid keys in one split only
    exp = sparse_mla_attention(q, rows_h, idx, SCALE)
    q_d, idx_d = cp.asarray(q), cp.asarray(idx)
    covered(katt, q_d, rows_d, fp8=fp8)
    poison_pool(cp)
    got = katt.sparse_mla_attention(cp, q_d, rows_d, idx_d, SCALE, 512, fp8, splits=splits)
    assert_flashmla_close(got, exp, f"splits={splits}")
    assert (got[0].get()[3] == 0).all() and (got[1].get()[3] == -np.inf).all()


@pytest.mark.parametrize("d_v", [2, 130, 510])
def test_split_kv_narrow_values(cp, katt, d_v):
    """Value widths below 512 through the split-KV merge, whose threads own two 8-byte
    column pairs each (a width that is not a multiple of 4, or of the 256 pairs a CTA
    covers, leaves threads with one pair or none): the one-pass answer within FlashMLA's
    tolerances (a row's stores past d_v would land on the next row's first columns)."""
    rng = np.random.default_rng(200 + d_v)
    tokens, heads, topk = 3, 128, 1024
    host, rows_h = flashmla_like_cache(rng, 40)
    rows_d = cpsparse.MLAKVCache.wrap(cp.asarray(host.data)).records()
    q = flashmla_like_q(rng, (tokens, heads, 576))
    idx = ragged_indices(rng, tokens, topk, host.num_slots)
    exp = sparse_mla_attention(q, rows_h, idx, SCALE, d_v=d_v)
    q_d, idx_d = cp.asarray(q), cp.asarray(idx)
    for splits in (1, 5, 16):
        poison_pool(cp)
        got = katt.sparse_mla_attention(cp, q_d, rows_d, idx_d, SCALE, d_v, True,
                                        splits=splits)
        assert got[0].shape == (tokens, heads, d_v), got[0].shape
        assert_flashmla_close(got, exp, f"d_v={d_v} splits={splits}")


@pytest.mark.parametrize("splits", [3, 33, 64])
def test_split_kv_merge_kernels_agree(cp, katt, monkeypatch, splits):
    """The two merge kernels (few rows / many rows: one body, 16 or 8 splits' loads in
    flight) give the same bits, each forced on the same partials: ragged rows (empty
    ones: lse -inf, out 0), a NaN row, an attention sink with +-inf heads, a value width
    of 130 (threads with one column pair or none), splits past 32 (a lane's second
    weight) and past a chunk (a second round of loads)."""
    rng = np.random.default_rng(40 + splits)
    tokens, heads, topk = 3, 128, 64 * 64
    host, rows_h = flashmla_like_cache(rng, 40)
    rows_d = cpsparse.MLAKVCache.wrap(cp.asarray(host.data)).records()
    q = flashmla_like_q(rng, (tokens, heads, 576))
    q[2, 5, 9] = np.nan
    idx = ragged_indices(rng, tokens, topk, host.num_slots)
    idx[1, :] = -1
    idx[1, 64 * 40:64 * 40 + 7] = rng.integers(0, host.num_slots, 7)
    sink = rng.standard_normal(heads).astype(np.float32)
    sink[0], sink[1] = np.inf, -np.inf
    got = {}
    for name in ("cps_mla_combine_few_rows", "cps_mla_combine"):
        monkeypatch.setattr(katt, "combine_kernel_name", lambda rows, sms, n=name: n)
        monkeypatch.setattr(katt, "_PLANS", {})
        monkeypatch.setattr(katt, "_LAUNCHES", {})
        poison_pool(cp)
        out, lse = katt.sparse_mla_attention(cp, cp.asarray(q), rows_d, cp.asarray(idx),
                                             SCALE, 130, True, splits=splits,
                                             attn_sink=cp.asarray(sink))
        got[name] = (out.get(), lse.get())
    (o1, l1), (o2, l2) = got.values()
    assert np.isnan(o1[2, 5]).all() and np.isnan(l1[2, 5]), "the NaN row"
    assert np.isfinite(o1[0]).all() and np.isfinite(l1[0]).all()
    assert (o1.view(np.uint32) == o2.view(np.uint32)).all(), \
        f"out differs in {(o1.view(np.uint32) != o2.view(np.uint32)).sum()} elements"
    assert (l1.view(np.uint32) == l2.view(np.uint32)).all(), "lse differs"
    q[2, 5, 9] = 0.0                    # the reference of the other rows
    e_out, e_lse = sparse_mla_attention(q, rows_h, idx, SCALE, d_v=130, attn_sink=sink)
    o1[2, 5], l1[2, 5] = e_out[2, 5], e_lse[2, 5]
    assert_flashmla_close((cp.asarray(o1), cp.asarray(l1)), (e_out, e_lse),
                          f"splits={splits}")


def test_split_kv_nan_propagates(cp, katt):
    """A NaN query gives NaN rows with or without splits (never the empty marker)."""
    rng = np.random.default_rng(8)
    kv = bf16_normal(rng, (500, 576))
    q = bf16_normal(rng, (2, 64, 576))
    q[1, 3, 7] = np.nan
    idx = rng.integers(0, 500, (2, 1024)).astype(np.int32)
    for splits in (1, 4):
        out, lse = katt.sparse_mla_attention(cp, cp.asarray(q), cp.asarray(kv),
                                             cp.asarray(idx), SCALE, 512, False, splits=splits)
        out, lse = out.get(), lse.get()
        assert np.isnan(out[1, 3]).all() and np.isnan(lse[1, 3]), splits
        assert np.isfinite(out[0]).all() and np.isfinite(lse[0]).all(), splits


@pytest.mark.parametrize("tokens,heads", [(1, 128), (8, 128), (2, 64), (1, 16)])
def test_decode_shapes_use_split_kv(cp, katt, tokens, heads):
    """Small decode batches split (the shapes of mla_decode_B1/B8) and stay within
    FlashMLA's tolerances through the public op."""
    from cpsparse import raw_kernels
    sms = raw_kernels.device_facts().sms
    units = tokens * -(-heads // katt.HEADS_PER_CTA)
    assert katt.choose_splits(units, 2048 // 64, sms) > 1
    rng = np.random.default_rng(tokens * heads)
    host, rows_h = flashmla_like_cache(rng, 40)
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
    q = flashmla_like_q(rng, (tokens, heads, 576))
    idx = rng.integers(0, host.num_slots, (tokens, 2048)).astype(np.int32)
    exp = sparse_mla_attention(q, rows_h, idx, SCALE)
    poison_pool(cp)
    assert_flashmla_close(sparse_mla_attention(cp.asarray(q), dev, cp.asarray(idx), SCALE),
                          exp, f"T={tokens} H={heads}")


@pytest.mark.parametrize("heads", [64, 128])
def test_extras_match_reference(cp, katt, heads):
    """attn_sink, topk_length and an extra fp8_ds_mla cache (DeepSeek-V4's window)
    with its own indices and lengths: the kernels' result against the reference's."""
    rng = np.random.default_rng(heads)
    tokens, topk, window = 6, 512, 128
    main_rec = exact_fp8_records(rng, 40 * BLOCK)
    extra_rec = exact_fp8_records(rng, 4 * BLOCK)
    host = cpsparse.MLAKVCache.wrap(main_rec.reshape(40, BLOCK, -1))
    host_x = cpsparse.MLAKVCache.wrap(extra_rec.reshape(4, BLOCK, -1))
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
    dev_x = cpsparse.MLAKVCache.wrap(cp.asarray(host_x.data))
    q = bf16_normal(rng, (tokens, heads, 576))
    idx = ragged_indices(rng, tokens, topk, host.num_slots)
    e_idx = ragged_indices(rng, tokens, window, host_x.num_slots)
    lens = np.array([topk, 0, 100, 511, topk + 9, 1], np.int32)
    e_lens = np.array([window, 5, 0, 64, 1, 0], np.int32)
    sink = rng.standard_normal(heads).astype(np.float32)
    sink[0], sink[1] = np.inf, -np.inf
    kw = dict(attn_sink=sink, topk_length=lens, extra_topk_length=e_lens)
    exp = sparse_mla_attention(q, host, idx, SCALE, extra_kv_cache=host_x, extra_indices=e_idx,
                               **kw)
    dkw = {k: cp.asarray(v) for k, v in kw.items()}
    q_d = cp.asarray(q)
    covered(katt, q_d, dev.records(), fp8=True)
    check_kernel(cp, lambda: sparse_mla_attention(q_d, dev, cp.asarray(idx), SCALE,
                                                  extra_kv_cache=dev_x,
                                                  extra_indices=cp.asarray(e_idx), **dkw), exp)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8_cache", "bf16_rows"])
@pytest.mark.parametrize("splits", [1, 4])
def test_lengths_and_sink_in_the_kernel(cp, katt, fp8, splits):
    """topk_length and attn_sink read by the fp8 / dense-rows kernels (one key source:
    no composition): the epilogue or, split, cps_mla_combine applies the sink; lengths
    arrive as int64 and are clamped to [0, topk] (negative and too large ones with value
    checks off), and the public op routes a single source to the kernel."""
    rng = np.random.default_rng(30 + splits + 2 * fp8)
    tokens, heads, topk = 7, 128, 512
    if fp8:
        host = cpsparse.MLAKVCache.wrap(exact_fp8_records(rng, 40 * BLOCK).reshape(40, BLOCK, -1))
        dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
        src_h, src_d, rows_d, n = host, dev, dev.records(), host.num_slots
    else:
        src_h = bf16_normal(rng, (3000, 576))
        src_d = rows_d = cp.asarray(src_h)
        n = src_h.shape[0]
    q = bf16_normal(rng, (tokens, heads, 576))
    idx = ragged_indices(rng, tokens, topk, n)
    lens = np.array([topk, 0, 100, 511, topk + 9, 1, -3], np.int64)
    sink = rng.standard_normal(heads).astype(np.float32)
    sink[0], sink[1] = np.inf, -np.inf
    exp = sparse_mla_attention(q, src_h, idx, SCALE, attn_sink=sink,
                               topk_length=np.clip(lens, 0, topk))
    q_d, idx_d, sink_d = cp.asarray(q), cp.asarray(idx), cp.asarray(sink)
    covered(katt, q_d, rows_d, fp8=fp8)
    check_kernel(cp, lambda: katt.sparse_mla_attention(
        cp, q_d, rows_d, idx_d, SCALE, 512, fp8, splits=splits, lengths=cp.asarray(lens),
        attn_sink=sink_d), exp)
    ok = np.clip(lens, 0, topk)
    check_kernel(cp, lambda: sparse_mla_attention(q_d, src_d, idx_d, SCALE, attn_sink=sink_d,
                                                  topk_length=cp.asarray(ok)), exp)


def test_model1_cache_on_cupy_matches_numpy(cp, katt):
    """The MODEL1 layout on CuPy (array-generic code): the same bytes as on NumPy,
    FlashMLA's strided view wrapped, and V4-style attention over that view by the
    MODEL1 kernel (no fallback warning) matching the NumPy reference."""
    import warnings
    rng = np.random.default_rng(5)
    bs, nb = 64, 6
    k_nope = rng.standard_normal((nb * bs, 448)).astype(np.float32)
    k_pe = rng.standard_normal((nb * bs, 64)).astype(np.float32)
    slots = rng.permutation(nb * bs).astype(np.int32)
    host = cpsparse.MLAKVCache(nb, bs, layout="model1")
    host.insert(k_nope, k_pe, slots)
    page = host.data.shape[1]
    padded = cp.zeros((nb, page), cp.uint8)
    dev = cpsparse.MLAKVCache.wrap(padded[:, :bs * 584].reshape(nb, bs, 1, 584),
                                   layout="model1", block_size=bs)
    dev.insert(cp.asarray(k_nope), cp.asarray(k_pe), cp.asarray(slots))
    assert np.array_equal(padded.get(), host.data)
    q = bf16_round(rng.standard_normal((3, 16, 512)) * 0.05)
    idx = rng.integers(-1, nb * bs, (3, 512)).astype(np.int32)
    sink = rng.standard_normal(16).astype(np.float32)
    exp = sparse_mla_attention(q, host, idx, 0.044, attn_sink=sink)
    assert katt.supports_model1(q.shape, 512)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # a fallback would warn
        check_kernel(cp, lambda: sparse_mla_attention(cp.asarray(q), dev, cp.asarray(idx),
                                                      0.044, attn_sink=cp.asarray(sink)), exp)


# ---- the MODEL1 kernel (DeepSeek-V4) ----------------------------------------------
def model1_caches(cp, rng, num_blocks, block_size=BLOCK, std=1.0):
    """(host, device) MODEL1 caches with every slot filled through the quantizer. Its
    values (e4m3 code * power-of-two scale, bf16 RoPE) are exact bf16 numbers, so the
    rows the tensor cores see are the reference's."""
    host = cpsparse.MLAKVCache(num_blocks, block_size, layout="model1")
    n = host.num_slots
    host.insert((rng.standard_normal((n, 448)) * std).astype(np.float32),
                (rng.standard_normal((n, 64)) * std).astype(np.float32),
                np.arange(n, dtype=np.int32))
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data), layout="model1",
                                   block_size=block_size)
    return host, dev


def model1_q(rng, shape):
    return bf16_round(rng.standard_normal(shape).astype(np.float32) * 0.1)


M1_SCALE = 512 ** -0.5


@pytest.mark.parametrize("heads,topk,tokens", [(64, 512, 5), (128, 1024, 5), (128, 512, 70),
                                               (16, 2048, 3), (96, 100, 5), (32, 1024, 2)])
def test_model1_kernel_matches_reference(cp, katt, heads, topk, tokens):
    """Ragged rows (repeats, -1 holes, empty rows, one valid key), split-KV (few
    tokens) and one pass (70 x 128 heads), partial head groups, topk not a multiple
    of 64."""
    rng = np.random.default_rng(heads + topk + tokens)
    host, dev = model1_caches(cp, rng, 40)
    q = model1_q(rng, (tokens, heads, 512))
    idx = ragged_indices(rng, tokens, topk, host.num_slots)
    exp = sparse_mla_attention(q, host, idx, M1_SCALE)
    assert katt.supports_model1(q.shape, 512)
    q_d, idx_d = cp.asarray(q), cp.asarray(idx)
    check_kernel(cp, lambda: sparse_mla_attention(q_d, dev, idx_d, M1_SCALE), exp)
    exp = sparse_mla_attention(q, host, idx, M1_SCALE, d_v=256)
    check_kernel(cp, lambda: sparse_mla_attention(q_d, dev, idx_d, M1_SCALE, d_v=256), exp)


@pytest.mark.parametrize("splits", [1, 3, 16])
def test_model1_split_kv_within_flashmla_tolerance(cp, katt, splits):
    """Forced split counts give the one-pass answer within FlashMLA's tolerances
    (main + window lists: a split may hold tiles of both caches)."""
    rng = np.random.default_rng(40 + splits)
    host, dev = model1_caches(cp, rng, 40, std=0.1)
    host_w, dev_w = model1_caches(cp, rng, 4, block_size=32, std=0.1)
    tokens, heads = 4, 128
    q = flashmla_like_q(rng, (tokens, heads, 512))
    idx = rng.integers(0, host.num_slots, (tokens, 512)).astype(np.int32)
    e_idx = rng.integers(0, host_w.num_slots, (tokens, 128)).astype(np.int32)
    exp = sparse_mla_attention(q, host, idx, M1_SCALE, extra_kv_cache=host_w,
                               extra_indices=e_idx)
    poison_pool(cp)
    got = katt.sparse_mla_attention_model1(
        cp, cp.asarray(q), [(dev.data, 64, cp.asarray(idx), None),
                            (dev_w.data, 32, cp.asarray(e_idx), None)], M1_SCALE, 512,
        splits=splits)
    assert_flashmla_close(got, exp, f"splits={splits}")


@pytest.mark.parametrize("tokens,heads", [(6, 64), (6, 128), (80, 128)])
def test_model1_extras_fused_match_reference(cp, katt, tokens, heads):
    """attn_sink (+inf, -inf, finite), topk_length (0, partial, past topk) and a window
    cache of another block size with its own indices and lengths, in one kernel (split
    and one-pass shapes) against the reference's composition."""
    rng = np.random.default_rng(tokens * heads)
    host, dev = model1_caches(cp, rng, 40)
    host_w, dev_w = model1_caches(cp, rng, 5, block_size=32)
    topk, window = 1024, 128
    q = model1_q(rng, (tokens, heads, 512))
    idx = ragged_indices(rng, tokens, topk, host.num_slots)
    e_idx = ragged_indices(rng, tokens, window, host_w.num_slots)
    lens = rng.integers(0, topk + 50, tokens).astype(np.int32)
    lens[:3] = (0, topk + 9, 100)
    e_lens = rng.integers(0, window + 1, tokens).astype(np.int64)       # int64 too
    e_lens[:3] = (5, 0, window)
    sink = rng.standard_normal(heads).astype(np.float32)
    sink[0], sink[1] = np.inf, -np.inf
    kw = dict(attn_sink=sink, topk_length=lens, extra_topk_length=e_lens)
    exp = sparse_mla_attention(q, host, idx, M1_SCALE, extra_kv_cache=host_w,
                               extra_indices=e_idx, **kw)
    assert (exp[0][:, 0] == 0).all()                           # the +inf sink
    dkw = {k: cp.asarray(v) for k, v in kw.items()}
    q_d = cp.asarray(q)
    check_kernel(cp, lambda: sparse_mla_attention(q_d, dev, cp.asarray(idx), M1_SCALE,
                                                  extra_kv_cache=dev_w,
                                                  extra_indices=cp.asarray(e_idx), **dkw), exp)
    # without the window: the main list with its lengths and the sink only
    exp = sparse_mla_attention(q, host, idx, M1_SCALE, attn_sink=sink, topk_length=lens)
    check_kernel(cp, lambda: sparse_mla_attention(q_d, dev, cp.asarray(idx), M1_SCALE,
                                                  attn_sink=dkw["attn_sink"],
                                                  topk_length=dkw["topk_length"]), exp)


def test_model1_empty_main_list_with_a_window(cp, katt):
    """topk 0 in the main list (no buffer behind it), the window list alone: the
    window's softmax, and with no window either the empty marker."""
    rng = np.random.default_rng(31)
    host, dev = model1_caches(cp, rng, 4)
    host_w, dev_w = model1_caches(cp, rng, 3, block_size=48)
    q = model1_q(rng, (4, 64, 512))
    none = np.zeros((4, 0), np.int32)
    e_idx = ragged_indices(rng, 4, 96, host_w.num_slots)
    exp = sparse_mla_attention(q, host, none, M1_SCALE, extra_kv_cache=host_w,
                               extra_indices=e_idx)
    check_kernel(cp, lambda: sparse_mla_attention(cp.asarray(q), dev, cp.asarray(none),
                                                  M1_SCALE, extra_kv_cache=dev_w,
                                                  extra_indices=cp.asarray(e_idx)), exp)
    out, lse = sparse_mla_attention(cp.asarray(q), dev, cp.asarray(none), M1_SCALE)
    assert (out.get() == 0).all() and (lse.get() == -np.inf).all()


def test_model1_masked_slots_are_never_read(cp, katt):
    """NaN bytes in every slot no valid entry names (and past each list's length) never
    reach out or lse; a NaN query head gives NaN in that head only."""
    rng = np.random.default_rng(77)
    host, _ = model1_caches(cp, rng, 8)
    idx = rng.integers(0, host.num_slots, (3, 256)).astype(np.int32)
    lens = np.array([256, 100, 0], np.int32)
    used = np.zeros(host.num_slots, bool)
    for t in range(3):
        used[idx[t, :lens[t]]] = True
    rows, scales = cache_ref._model1_views(host.data, BLOCK)
    rows[~used.reshape(8, BLOCK)] = 0xFF
    scales[~used.reshape(8, BLOCK)] = 0xFF
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data), layout="model1")
    q = model1_q(rng, (3, 64, 512))
    exp = sparse_mla_attention(q, host, idx, M1_SCALE, topk_length=lens)
    assert np.isfinite(exp[0]).all()
    check_kernel(cp, lambda: sparse_mla_attention(cp.asarray(q), dev, cp.asarray(idx),
                                                  M1_SCALE, topk_length=cp.asarray(lens)), exp)
    q[1, 5, 3] = np.nan
    out, lse = (a.get() for a in sparse_mla_attention(
        cp.asarray(q), dev, cp.asarray(idx), M1_SCALE, topk_length=cp.asarray(lens)))
    assert np.isnan(out[1, 5]).all() and np.isnan(lse[1, 5])
    assert np.isfinite(out[1, :5]).all() and np.isfinite(out[0]).all()


@pytest.fixture
def attention_core_calls(count_core_calls):
    """Counts the CuPy calls of sparse_mla_attention that leave the memoized launch for
    the checked path (sparse_mla_attention_core), with the op's memo empty before and
    after."""
    from cpsparse import attention
    attention._SPARSE_CALLS.clear()
    yield count_core_calls(attention, "sparse_mla_attention_core")
    attention._SPARSE_CALLS.clear()


def _decode_batch(rng, tokens, heads, num_blocks=40):
    host, rows = flashmla_like_cache(rng, num_blocks)
    q = flashmla_like_q(rng, (tokens, heads, 576))
    idx = ragged_indices(rng, tokens, 2048, host.num_slots)
    return host, rows, q, idx


@pytest.mark.parametrize("form", ["split", "one_pass", "raw_4d", "indices_3d", "fp16_q"])
def test_memoized_launch_in_production_mode(cp, katt, attention_core_calls, form):
    """Value checks off, a call whose layouts the memo holds is the fp8 kernel's prepared
    launch (raw_kernels.attention.call_launch: the core is not entered) and gives the bits
    the checked path gives, on fresh queries and indices in the same layouts: split-KV
    (B=1, H=128: the combine too) and one pass (70 tokens), the cache as FlashMLA's raw
    [num_blocks, block_size, 1, 656] array, FlashMLA's [T, 1, topk] indices, float16
    queries."""
    rng = np.random.default_rng(len(form))
    tokens = 70 if form == "one_pass" else 1 if form == "split" else 3
    host, rows, _, _ = _decode_batch(rng, tokens, 128)
    units = tokens * -(-128 // katt.HEADS_PER_CTA)
    from cpsparse import raw_kernels
    splits = katt.choose_splits(units, 2048 // 64, raw_kernels.device_facts().sms)
    assert (splits > 1) == (form != "one_pass"), splits
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
    arg = dev.data.reshape(host.num_blocks, BLOCK, 1, 656) if form == "raw_4d" else dev
    qdtype = np.float16 if form == "fp16_q" else np.float32
    previous = cpsparse.set_device_value_checks(False)
    try:
        for call in range(3):
            q = cp.asarray(flashmla_like_q(rng, (tokens, 128, 576)).astype(qdtype))
            idx = cp.asarray(ragged_indices(rng, tokens, 2048, host.num_slots))
            if form == "indices_3d":
                idx = idx.reshape(tokens, 1, 2048)
            poison_pool(cp)
            got = sparse_mla_attention(q, arg, idx, SCALE)
            cpsparse.set_device_value_checks(True)
            want = sparse_mla_attention(q, dev, idx.reshape(tokens, 2048), SCALE)
            cpsparse.set_device_value_checks(False)
            for g, w, what in zip(got, want, ("out", "lse")):
                assert g.shape == w.shape and g.dtype == w.dtype, (form, what)
                assert cp.array_equal(g, w).item(), f"{form}: call {call}, {what}"
        exp = sparse_mla_attention(q.get().astype(np.float32), rows,
                                   idx.get().reshape(tokens, 2048), SCALE)
        assert_flashmla_close(got, exp, form)
    finally:
        cpsparse.set_device_value_checks(previous)
    assert len(attention_core_calls) == 1 + 3     # the first (checked) call, the `want`s


@pytest.mark.parametrize("case", ["int64_indices", "float64_q", "misaligned_q", "checks_on",
                                  "kernels_off", "other_device"])
def test_memoized_launch_steps_aside(cp, attention_core_calls, prepared_elsewhere, case):
    """The memoized launch is the whole call only where it is the same work: int64 indices
    and float64 queries (converted first), queries at an address off 16 bytes (the layouts
    do not say it: copied first), value checks back on, kernels switched off after the
    memo was filled, another current device than the launch was prepared on: these take
    the checked path, and still answer right."""
    from cpsparse import attention
    rng = np.random.default_rng(11)
    host, rows, q, idx = _decode_batch(rng, 2, 128)
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
    qd = cp.asarray(q.astype(np.float64) if case == "float64_q" else q)
    if case == "misaligned_q":
        flat = cp.zeros(q.size + 1, cp.float32)
        qd = flat[1:].reshape(q.shape)
        qd[...] = cp.asarray(q)
    idx_d = cp.asarray(idx.astype(np.int64) if case == "int64_indices" else idx)
    previous = cpsparse.set_device_value_checks(False)
    try:
        if case == "misaligned_q":                # the memo filled by aligned queries
            sparse_mla_attention(cp.asarray(q), dev, idx_d, SCALE)
        else:
            sparse_mla_attention(qd, dev, idx_d, SCALE)
        fills = len(attention_core_calls)
        if case == "checks_on":
            cpsparse.set_device_value_checks(True)
        elif case == "other_device":
            prepared_elsewhere(attention._SPARSE_CALLS)
        kernels = cpsparse.set_kernels_enabled(case != "kernels_off")
        try:
            got = sparse_mla_attention(qd, dev, idx_d, SCALE)
        finally:
            cpsparse.set_kernels_enabled(kernels)
    finally:
        cpsparse.set_device_value_checks(previous)
    assert len(attention_core_calls) == fills + 1, case
    assert_flashmla_close(got, sparse_mla_attention(q, rows, idx, SCALE), case)


# ---- bfloat16 arrays (CuPy >= 14) and 16-bit outputs --------------------------------
@pytest.fixture(scope="module")
def bf16(cp):
    """ml_dtypes' bfloat16, or a skip where this CuPy has no bfloat16 arrays (< 14)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    try:
        cp.empty(1, dtype=ml_dtypes.bfloat16)
    except Exception as e:                       # noqa: BLE001 - any refusal means "no"
        pytest.skip(f"CuPy {cp.__version__} has no bfloat16 arrays: {e}")
    return np.dtype(ml_dtypes.bfloat16)


def _bits(a):
    a = a.get() if hasattr(a, "get") else a
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def assert_same_bits(got, want, what):
    """Bit-identical arrays, every NaN counted as one NaN (the kernel and the host may
    write different NaN payloads)."""
    got = got.get() if hasattr(got, "get") else got
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    nan = np.isnan(want.astype(np.float32))
    assert (np.isnan(got.astype(np.float32)) == nan).all(), f"{what}: NaN positions differ"
    diff = (_bits(got) != _bits(want)) & ~nan
    assert not diff.any(), f"{what}: {int(diff.sum())} of {diff.size} elements differ"


def _attention_cases(cp, rng):
    """(name, call(q, **kw)) of every kernel route over the same bf16-exact queries: the
    fp8 cache (one pass and split), dense rows, MODEL1 (split), dense causal."""
    host, rows_h = flashmla_like_cache(rng, 40)
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
    m1_host, m1_dev = model1_caches(cp, rng, 12)
    rows_d = cp.asarray(bf16_normal(rng, (500, 576), 0.5))
    idx_fp8 = cp.asarray(ragged_indices(rng, 140, 2048, host.num_slots))
    idx_rows = cp.asarray(ragged_indices(rng, 6, 512, 500))
    idx_m1 = cp.asarray(ragged_indices(rng, 70, 512, m1_host.num_slots))
    sink = cp.asarray(rng.standard_normal(128).astype(np.float32))
    return [
        ("fp8 one pass", (140, 128, 576),
         lambda q, **kw: sparse_mla_attention(q, dev, idx_fp8, SCALE, **kw)),
        ("fp8 split, sink", (2, 128, 576),
         lambda q, **kw: sparse_mla_attention(q, dev, idx_fp8[:2], SCALE, attn_sink=sink,
                                              **kw)),
        ("dense rows", (6, 64, 576),
         lambda q, **kw: sparse_mla_attention(q, rows_d, idx_rows, SCALE, **kw)),
        ("model1 split", (5, 128, 512),
         lambda q, **kw: sparse_mla_attention(q, m1_dev, idx_m1[:5], M1_SCALE, **kw)),
        ("model1 one pass", (70, 128, 512),
         lambda q, **kw: sparse_mla_attention(q, m1_dev, idx_m1, M1_SCALE, **kw)),
        ("dense causal", (7, 64, 576),
         lambda q, **kw: dense_mla_attention(q, rows_d[:300], SCALE, **kw)),
    ]


def test_bfloat16_queries_are_read_as_they_are(cp, katt, bf16):
    """A CuPy bfloat16 q (CuPy >= 14: ml_dtypes' dtype) gives every kernel route the
    bits of the same values in float32 and float16 (the kernels round those to bf16,
    exact here): read as 2-byte bf16, never as float32 (which read twice its bytes)."""
    rng = np.random.default_rng(61)
    for name, shape, call in _attention_cases(cp, rng):
        q32 = cp.asarray(bf16_normal(rng, shape, 0.1))
        want = [a.get() for a in call(q32)]
        for q in (q32.astype(bf16), q32.astype(cp.float16)):
            poison_pool(cp)
            out, lse = call(q)
            assert_same_bits(out, want[0], f"{name}: out of a {q.dtype} q")
            assert_same_bits(lse, want[1], f"{name}: lse of a {q.dtype} q")


def test_bfloat16_dense_rows_are_read_as_they_are(cp, katt, bf16):
    """Dense bfloat16 rows (sparse and causal routes) give the bits of the same rows in
    float32; the rows are only viewed (to_bf16 returns their own memory)."""
    rng = np.random.default_rng(62)
    rows32 = cp.asarray(bf16_normal(rng, (400, 576), 0.5))
    rows16 = rows32.astype(bf16)
    assert katt.to_bf16(cp, rows16).data.ptr == rows16.data.ptr
    q = cp.asarray(bf16_normal(rng, (6, 64, 576), 0.1))
    idx = cp.asarray(ragged_indices(rng, 6, 512, 400))
    for got, want in [(sparse_mla_attention(q, rows16, idx, SCALE),
                       sparse_mla_attention(q, rows32, idx, SCALE)),
                      (dense_mla_attention(q, rows16[:200], SCALE),
                       dense_mla_attention(q, rows32[:200], SCALE))]:
        for g, w in zip(got, want):
            assert_same_bits(g, w.get(), "bf16 rows")


@pytest.mark.parametrize("out_name", ["bfloat16", "float16"])
def test_16bit_out_is_the_float32_out_rounded(cp, katt, bf16, out_name):
    """out_dtype bfloat16 / float16 on every kernel route (the fp8 kernel's epilogue one
    pass and through the split-KV merge, the dense-rows and MODEL1 kernels, dense
    causal): the float32 out rounded to nearest even, bit for bit (NaN rows too), lse
    float32 and unchanged; in a NaN-poisoned pool, so an unwritten element shows up."""
    out_dtype = bf16 if out_name == "bfloat16" else np.dtype(np.float16)
    rng = np.random.default_rng(63)
    for name, shape, call in _attention_cases(cp, rng):
        q = bf16_normal(rng, shape, 0.1)
        q[0, 3, 7] = np.nan                       # a NaN row through both writers
        q = cp.asarray(q)
        out32, lse32 = (a.get() for a in call(q))
        poison_pool(cp)
        out, lse = call(q, out_dtype=out_name)
        assert_same_bits(out, out32.astype(out_dtype), f"{name}: {out_name} out")
        assert_same_bits(lse, lse32, f"{name}: lse with a {out_name} out")
        assert np.isnan(out.get()[0, 3].astype(np.float32)).all(), name


@pytest.mark.parametrize("d_v", [2, 130, 256, 260, 500, 510])
def test_16bit_out_value_widths_and_partial_head_groups(cp, katt, bf16, d_v):
    """A 16-bit out of any even d_v (d_v % 4 == 2: rows not 8-byte aligned, one column
    pair a store) and 96 heads (the second head group half empty: its rows past the
    heads are never written, the shuffles still run) in one pass (the fp8 epilogue, the
    dense-rows epilogue) and split (the merge): the float32 out rounded, bit for bit."""
    rng = np.random.default_rng(66 + d_v)
    host, _ = flashmla_like_cache(rng, 40)
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
    rows_d = cp.asarray(bf16_normal(rng, (300, 576), 0.5))
    for tokens in (140, 2):                                 # one pass, split
        q = cp.asarray(bf16_normal(rng, (tokens, 96, 576), 0.1))
        idx = cp.asarray(ragged_indices(rng, tokens, 512, 300))
        for name, call in [("fp8", lambda **kw: sparse_mla_attention(q, dev, idx, SCALE,
                                                                     d_v=d_v, **kw)),
                           ("rows", lambda **kw: sparse_mla_attention(q, rows_d, idx, SCALE,
                                                                      d_v=d_v, **kw))]:
            out32 = call()[0].get()
            for out_name in ("bfloat16", "float16"):
                poison_pool(cp)
                out = call(out_dtype=out_name)[0]
                assert_same_bits(out, out32.astype(out.dtype),
                                 f"{name} T={tokens} d_v={d_v} {out_name}")


def test_16bit_out_in_the_prepared_call(cp, katt, bf16, attention_core_calls):
    """The call memo's prepared launch (production mode) keys the out dtype: float32,
    then bfloat16, then float32 again on the same layouts, each its own dtype and bits."""
    rng = np.random.default_rng(64)
    host, _ = flashmla_like_cache(rng, 40)
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
    q = cp.asarray(bf16_normal(rng, (3, 128, 576), 0.1)).astype(bf16)
    idx = cp.asarray(rng.integers(0, host.num_slots, (3, 2048)).astype(np.int32))
    previous = cpsparse.set_device_value_checks(False)
    try:
        results = [sparse_mla_attention(q, dev, idx, SCALE, out_dtype=dt)[0]
                   for dt in (None, "bfloat16", None, bf16, "bfloat16")]
    finally:
        cpsparse.set_device_value_checks(previous)
    assert [r.dtype for r in results] == [np.float32, bf16, np.float32, bf16, bf16]
    want = results[0].get().astype(bf16)
    for r in results[1:]:
        assert_same_bits(r.get().astype(bf16), want, "prepared out")
    # the first call of each out dtype took the checked path (None and bf16 are two
    # memo entries; the dtype object and its name are two keys), the rest the launch
    assert len(attention_core_calls) == 3


def test_torch_bfloat16_through_dlpack(cp, katt, bf16):
    """A torch bfloat16 query handed over by DLPack (zero-copy, CuPy >= 14) and a
    bfloat16 out handed back: FlashMLA's dtypes on both sides."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(65)
    host, _ = flashmla_like_cache(rng, 40)
    dev = cpsparse.MLAKVCache.wrap(cp.asarray(host.data))
    q32 = cp.asarray(bf16_normal(rng, (4, 128, 576), 0.1))
    tq = torch.from_dlpack(q32).to(torch.bfloat16)
    try:
        q = cp.from_dlpack(tq)
    except Exception as e:                       # noqa: BLE001
        pytest.skip(f"CuPy {cp.__version__} does not import bfloat16 by DLPack: {e}")
    assert q.dtype == bf16 and q.data.ptr == tq.data_ptr()
    idx = cp.asarray(rng.integers(0, host.num_slots, (4, 2048)).astype(np.int32))
    out, lse = sparse_mla_attention(q, dev, idx, SCALE, out_dtype="bfloat16")
    want = sparse_mla_attention(q32, dev, idx, SCALE)
    assert_same_bits(out, want[0].get().astype(bf16), "out")
    t_out = torch.from_dlpack(out)
    assert t_out.dtype == torch.bfloat16 and t_out.data_ptr() == out.data.ptr
