"""GPU: indexer scoring kernels (prefill mqa_logits, paged decode) vs the float64 reference.

Every case draws fresh random ragged batches, poisons the output with NaN before the
launch (so an element the kernel forgets to write fails), runs both tensor-core paths
(wgmma and mma.sync) and the public op, and checks: identical -inf mask, no NaN, and
||gpu - ref|| / ||ref|| <= 1e-3 over the finite entries (DESIGN.md section 11). The
launchers never fall back to the reference: every case first asserts that the kernels
cover it (``supports_prefill`` / ``paged_plan`` + ``supports_paged``).
"""

import numpy as np
import pytest

import cpsparse
from cpsparse._backend import KernelFallbackWarning
from cpsparse.reference import indexer as ref

pytestmark = pytest.mark.gpu

PATHS = ("wgmma", "mma")


@pytest.fixture
def cp():
    import cupy
    return cupy


@pytest.fixture
def kin():
    from cpsparse.raw_kernels import indexer
    return indexer


def _prefill(cp, kin, dev, path):
    """Launch the prefill kernel of ``path`` into a NaN-poisoned output."""
    q8, k8 = dev[0], dev[1]
    assert kin.supports_prefill(q8, k8), f"prefill kernel does not cover {q8.shape}"
    out = cp.full((q8.shape[0], k8.shape[0]), np.nan, dtype=cp.float32)
    kin.mqa_logits(cp, *dev, out=out, path=path)
    return out


def _paged(cp, kin, dq, dcache, dw, dctx, dtable, width, path=None, piece_tiles=None,
           out=None):
    """Launch the decode kernel of ``path`` (after checking its plan covers the shape)."""
    batch, next_n, heads, dim = dq.shape
    plan = kin.paged_plan(batch, next_n, heads, dim, width, dcache.block_size, path)[1]
    assert kin.supports_paged(dq, dcache.data, plan), \
        f"decode kernel does not cover {dq.shape}, width {width}, block {dcache.block_size}"
    if out is None:
        out = cp.full((batch * next_n, width), np.nan, dtype=cp.float32)
    kin.paged_mqa_logits(cp, dq, dcache, dw, dctx, dtable, width, out=out, path=path,
                         piece_tiles=piece_tiles)
    return out


def _check(gpu, expect, what):
    got = gpu.get() if hasattr(gpu, "get") else np.asarray(gpu)
    assert got.shape == expect.shape, what
    assert not np.isnan(got).any(), f"{what}: unwritten (NaN-poisoned) or NaN outputs"
    assert np.array_equal(np.isneginf(got), np.isneginf(expect)), f"{what}: -inf mask differs"
    fin = np.isfinite(expect)
    assert np.isfinite(got[fin]).all(), f"{what}: non-finite logits inside the windows"
    if fin.any():
        diff = np.linalg.norm(got[fin].astype(np.float64) - expect[fin])
        err = diff / max(np.linalg.norm(expect[fin].astype(np.float64)), 1e-30)
        assert err <= 1e-3, f"{what}: relative error {err:.3g}"


def _queries(rng, shape):
    """Quantized queries and folded head weights (the layer's real recipe)."""
    q = rng.standard_normal(shape).astype(np.float32)
    codes, scales = cpsparse.quantize_fp8(q, 128, eps=1e-10)
    heads = shape[-2]
    w = rng.standard_normal((int(np.prod(shape[:-2])), heads)).astype(np.float32)
    return codes, cpsparse.fold_weights(w, scales.reshape(w.shape), 128)


def _keys(rng, n):
    k = (rng.standard_normal((n, 128)) * rng.uniform(0.3, 3.0, (n, 1))).astype(np.float32)
    codes, scales = cpsparse.quantize_fp8(k, 128, eps=1e-4)
    return codes, scales.reshape(-1)


# ---- prefill -------------------------------------------------------------------

def _prefill_inputs(cp, rng, heads, n, ks, ke):
    """The float64 reference logits and the device inputs of len(ks) queries over n keys."""
    q8, w = _queries(rng, (len(ks), heads, 128))
    k8, sk = _keys(rng, n)
    expect = ref.mqa_logits(q8, k8, sk, w, ks, ke)
    return expect, [cp.asarray(a) for a in (q8, k8, sk, w, ks, ke)]


def _prefill_batch(rng, requests):
    """(ks, ke, n_keys) for packed requests [(context, query_len), ...] (causal)."""
    ks, ke, cu = [], [], 0
    for ctx, qlen in requests:
        i = np.arange(qlen)
        ks.append(np.full(qlen, cu))
        ke.append(cu + ctx + i + 1)
        cu += ctx + qlen
    return np.concatenate(ks).astype(np.int32), np.concatenate(ke).astype(np.int32), cu


@pytest.mark.parametrize("heads", [8, 24, 32, 64])
def test_mqa_logits_matches_reference(cp, kin, heads):
    rng = np.random.default_rng(100 + heads)
    requests = [(0, int(rng.integers(40, 90))), (int(rng.integers(100, 200)), 33),
                (int(rng.integers(1200, 1600)), 45), (63, 1), (5, 64), (0, 3)]
    if heads == 64:
        requests = requests[1:]
    ks, ke, n = _prefill_batch(rng, requests)
    # a few non-causal windows: empty, a single key, the last key, everything
    ks[3], ke[3] = 10, 10
    ks[5], ke[5] = n - 1, n
    ks[7], ke[7] = 0, n
    ks[9], ke[9] = 777, 778
    expect, dev = _prefill_inputs(cp, rng, heads, n, ks, ke)
    for path in PATHS:
        _check(_prefill(cp, kin, dev, path), expect, f"mqa_logits H={heads} path={path}")
    _check(cpsparse.indexer.mqa_logits(*dev), expect, f"public mqa_logits H={heads}")


def test_mqa_logits_tail_queries_long_keys(cp, kin):
    """Queries over a long key range (windows start far from 0, many tiles per CTA)."""
    rng = np.random.default_rng(7)
    n, m, heads = 9000, 40, 64
    ks = np.full(m, 1000, np.int32)
    ke = (n - m + 1 + np.arange(m)).astype(np.int32)
    expect, dev = _prefill_inputs(cp, rng, heads, n, ks, ke)
    for path in PATHS:
        _check(_prefill(cp, kin, dev, path), expect, f"tail queries path={path}")


@pytest.mark.parametrize("heads,ctas", [(64, 1), (64, 3), (8, 2), (40, 5)])
def test_mqa_logits_persistent_ctas_many_blocks(cp, kin, heads, ctas):
    """The persistent wgmma kernel with few CTAs: each runs through tens of query blocks,
    so both query slots and the key ring wrap many times (their barrier phases), with
    whole blocks of empty windows, single keys, full rows and causal runs between."""
    rng = np.random.default_rng(900 + heads + ctas)
    n = 1500
    m = 24 * (128 // kin._round8(heads)) + 7
    kind = rng.integers(0, 5, m)
    ks = rng.integers(0, n, m)
    ke = np.minimum(ks + rng.integers(1, 700, m), n)
    ks = np.where(kind == 1, 0, ks)
    ke = np.where(kind == 0, ks, np.where(kind == 1, n, ke))       # empty / full
    ke = np.where(kind == 2, ks + 1, ke)                           # a single key (ks < n)
    run = slice(m // 3, m // 3 + 40)                               # whole blocks empty
    ks[run], ke[run] = 5, 5
    ks, ke = ks.astype(np.int32), ke.astype(np.int32)
    expect, dev = _prefill_inputs(cp, rng, heads, n, ks, ke)
    out = cp.full((m, n), np.nan, dtype=cp.float32)
    kin.mqa_logits(cp, *dev, out=out, path="wgmma", ctas=ctas)
    _check(out, expect, f"persistent mqa_logits H={heads} ctas={ctas}")
    # the same logits with one CTA an SM, to the bit
    full = _prefill(cp, kin, dev, "wgmma")
    assert cp.array_equal(cp.nan_to_num(out, neginf=-1.0), cp.nan_to_num(full, neginf=-1.0))


@pytest.mark.parametrize("heads,n", [(60, 37), (64, 1), (64, 65), (128, 200), (16, 63)])
def test_mqa_logits_few_keys_and_padded_heads(cp, kin, heads, n):
    """Fewer keys than a tile, one key, a tile and one; heads padded to a multiple of 8
    (60 -> 64: the kernel built for 64 padded heads with 4 zero heads), one token a
    block (128 heads)."""
    rng = np.random.default_rng(1300 + heads + n)
    m = 37
    ks = rng.integers(0, n, m).astype(np.int32)
    ke = np.minimum(ks + rng.integers(0, n + 1, m), n).astype(np.int32)
    ks[0], ke[0] = 0, n
    expect, dev = _prefill_inputs(cp, rng, heads, n, ks, ke)
    for path in PATHS:
        _check(_prefill(cp, kin, dev, path), expect, f"H={heads} N={n} path={path}")


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_mqa_logits_scales_not_16_byte_aligned(cp, kin, offset):
    """The ws kernel reads the key scales by TMA, which takes only 16-byte aligned
    tensors: scales 4, 8 or 12 bytes past an aligned base (a slice of a longer array)
    go through an aligned copy, and the logits are the aligned call's to the bit."""
    rng = np.random.default_rng(1400 + offset)
    ks, ke, n = _prefill_batch(rng, [(300, 40), (0, 17), (500, 9)])
    expect, dev = _prefill_inputs(cp, rng, 64, n, ks, ke)
    aligned = _prefill(cp, kin, dev, "wgmma")
    longer = cp.full(n + 4, np.nan, dtype=cp.float32)
    longer[offset:offset + n] = dev[2]
    shifted = longer[offset:offset + n]
    assert shifted.data.ptr % 16 == 4 * offset
    got = _prefill(cp, kin, [dev[0], dev[1], shifted, *dev[3:]], "wgmma")
    _check(got, expect, f"scales offset by {offset}")
    assert cp.array_equal(cp.nan_to_num(got, neginf=-1.0), cp.nan_to_num(aligned, neginf=-1.0))


def test_mqa_logits_graph_capture_keeps_each_launchs_keys(cp, kin):
    """The ws prefill kernel takes its keys as tensor maps by value: two launches of one
    shape on two key arrays, captured in one CUDA graph, each replay their own keys (a map
    read from a host buffer at replay, or shared between the launches, would score one
    array twice)."""
    rng = np.random.default_rng(1500)
    ks, ke, n = _prefill_batch(rng, [(700, 30), (100, 20)])
    expect_a, dev_a = _prefill_inputs(cp, rng, 64, n, ks, ke)
    expect_b, dev_b = _prefill_inputs(cp, rng, 64, n, ks, ke)
    dev_b[0], dev_b[3] = dev_a[0], dev_a[3]                  # the same queries and weights
    q8, w = dev_a[0].get(), dev_a[3].get()
    expect_b = ref.mqa_logits(q8, dev_b[1].get(), dev_b[2].get(), w, ks, ke)
    out_a = cp.empty(expect_a.shape, dtype=cp.float32)
    out_b = cp.empty_like(out_a)
    kin.mqa_logits(cp, *dev_a, out=out_a)                       # warm: compile, prepare
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        kin.mqa_logits(cp, *dev_a, out=out_a)
        kin.mqa_logits(cp, *dev_b, out=out_b)
        graph = stream.end_capture()
        out_a.fill(np.nan)
        out_b.fill(np.nan)
        graph.launch()
    stream.synchronize()
    _check(out_a, expect_a, "graph replay, keys a")
    _check(out_b, expect_b, "graph replay, keys b")


# ---- paged decode --------------------------------------------------------------

def _paged_batch(rng, lens, next_n, heads, block_size=64, two_d=False):
    lens = np.asarray(lens, np.int64)
    need = -(-lens // block_size)
    num_blocks = int(need.sum()) + 7
    cache = cpsparse.IndexerKCache(num_blocks, block_size, 128)
    cache.data[:] = rng.integers(0, 256, cache.data.shape, dtype=np.uint8)   # garbage pages
    perm = rng.permutation(num_blocks)
    table = np.full((lens.size, int(need.max()) + 2), -1, np.int32)          # -1 past the end
    off = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[off:off + k]
        off += k
    for b, length in enumerate(lens):
        pos = np.arange(length)
        slots = (table[b, pos // block_size].astype(np.int64) * block_size
                 + pos % block_size).astype(np.int32)
        k8, sk = _keys(rng, int(length))
        cache.insert_quantized(k8, sk, slots)
    if two_d:
        ctx = np.maximum(lens[:, None] - rng.integers(0, 3, (lens.size, next_n)), 0)
        ctx[0, -1] = lens[0]
        ctx = ctx.astype(np.int32)
    else:
        ctx = lens.astype(np.int32)
    q8, w = _queries(rng, (lens.size, next_n, heads, 128))
    return cache, q8, w, ctx, table


LENS = [1, 63, 64, 65, 129, 700, 20000, 2]


@pytest.mark.parametrize("heads,next_n,two_d", [
    (8, 1, False), (8, 2, True), (8, 4, False),
    (32, 1, True), (32, 2, False), (32, 4, True),
    (64, 1, False), (64, 2, True), (64, 4, False),
    (60, 2, False), (64, 3, True),        # the _h64 kernels: 4 zero-padded heads, 2 chunks
])
def test_paged_mqa_logits_matches_reference(cp, kin, heads, next_n, two_d):
    rng = np.random.default_rng(1000 * heads + 10 * next_n + two_d)
    lens = list(rng.permutation(LENS))
    cache, q8, w, ctx, table = _paged_batch(rng, lens, next_n, heads, two_d=two_d)
    width = int(max(lens)) + 37
    expect = ref.paged_mqa_logits(q8, cache.data, 64, w, ctx, table, width)
    dcache = cpsparse.IndexerKCache.wrap(cp.asarray(cache.data), 64, 128)
    dq, dw, dctx, dtable = (cp.asarray(a) for a in (q8, w, ctx, table))
    # default plans of both paths, then other piece sizes
    for path, pt in (("wgmma", None), ("mma", None), ("wgmma", 7), ("wgmma", 1), ("mma", 7)):
        out = _paged(cp, kin, dq, dcache, dw, dctx, dtable, width, path=path, piece_tiles=pt)
        _check(out, expect, f"paged H={heads} next_n={next_n} 2d={two_d} path={path} "
                            f"piece_tiles={pt}")
    got = cpsparse.indexer.paged_mqa_logits(dq, dcache, dw, dctx, dtable, width)
    _check(got, expect, f"public paged H={heads} next_n={next_n}")


def _generic_paged(cp, kin, batch, next_n, heads, width, fp4):
    """(plan, kernel) of the decode kernel that takes the head count at run time."""
    from cpsparse import raw_kernels
    facts = raw_kernels.device_facts()
    plan = kin.decode_plan(batch, next_n, heads, width, 64, facts.sms, facts.smem_per_sm,
                           kin.DECODE_STAGES, fp4, False)
    name = kin.paged_kernel_name("wgmma", plan[0], plan[3], plan[4], fp4, fixed=False)
    return plan, kin._kernel(name, kin.PAGED_ARGS, kin.smem_bytes(plan[2] * plan[1], plan[4]))


def _paged_fixed_case(rng, heads, next_n, fp4, lens=(1, 63, 64, 65, 700, 9000, 2),
                      width=9029, missing=True):
    """Host inputs of the bit-identity tests: ragged lengths (2-D for fp8 next_n > 1), a
    missing page (-1 in the table: never read, -inf)."""
    lens = list(lens)
    if fp4:
        # every page of the rows' width present when that is small (pages past a context
        # never read), else the pages of the contexts only (-1 past them)
        cols = -(-width // 64)
        need = np.full(len(lens), cols) if len(lens) * cols <= 5000 else \
            -(-np.asarray(lens, np.int64) // 64)
        nb = int(need.sum()) + 3
        host = cpsparse.IndexerKCache(nb, 64, 128, dtype="mxfp4")
        k = rng.standard_normal((nb * 64, 128)).astype(np.float32)
        host.insert(k, np.arange(nb * 64, dtype=np.int32))
        perm = rng.permutation(nb).astype(np.int32)
        table = np.full((len(lens), cols), -1, np.int32)
        for b, off in enumerate(np.cumsum(need) - need):
            table[b, :need[b]] = perm[off:off + need[b]]
        ctx = np.asarray(lens, np.int32)
        q8, w = _queries(rng, (len(lens), next_n, heads, 128))
    else:
        host, q8, w, ctx, table = _paged_batch(rng, lens, next_n, heads, two_d=next_n > 1)
    if missing:
        table[5, 3] = -1
    return host, q8, w, ctx, table, width


@pytest.mark.parametrize("heads,next_n,fp4", [
    (64, 1, False), (64, 2, False), (60, 2, False), (60, 3, False), (64, 1, True),
    (64, 2, True), (60, 2, True),
])
def test_paged_fixed_head_kernels_write_the_generic_bits(cp, kin, heads, next_n, fp4):
    """The decode kernels the plan picks for 57-64 heads on the wgmma path (``_h64``, and the
    warp-specialized ``[fp4_]ws_h64n1`` / ``_h64n2``) write exactly the bits of the
    kernels that take the head count at run time: ragged and 2-D lengths, a missing page,
    the default pieces and pieces of one tile / one stage (every tile a row end)."""
    rng = np.random.default_rng(4000 + heads + 10 * next_n + fp4)
    host, q8, w, ctx, table, width = _paged_fixed_case(rng, heads, next_n, fp4)
    dcache = cpsparse.IndexerKCache.wrap(cp.asarray(host.data), 64, 128, dtype=host.dtype)
    dq, dw, dctx, dtable = (cp.asarray(a) for a in (q8, w, ctx, table))
    batch = table.shape[0]
    path, plan, fn = kin.paged_plan(batch, next_n, heads, 128, width, 64, fp4=fp4)
    ws = kin.uses_ws_decode(path, next_n, heads, 128, 64)
    assert fn.name == (kin.ws_kernel_name(next_n, fp4) if ws else
                       kin.paged_kernel_name(path, plan[0], 64, plan[4], fp4)), fn.name
    gplan, generic = _generic_paged(cp, kin, batch, next_n, heads, width, fp4)
    want = cp.full((batch * next_n, width), np.nan, dtype=cp.float32)
    kin.paged_mqa_logits(cp, dq, dcache, dw, dctx, dtable, width, out=want,
                         plan=(path, gplan, generic))
    want = want.get()
    assert not np.isnan(want).any(), "generic kernel: unwritten (NaN-poisoned) outputs"
    for pt in (None, 1):
        out = cp.full((batch * next_n, width), np.nan, dtype=cp.float32)
        kin.paged_mqa_logits(cp, dq, dcache, dw, dctx, dtable, width, out=out,
                             piece_tiles=pt, plan=(path, plan, fn))
        got = out.get()
        assert not np.isnan(got).any(), f"{fn.name} piece_tiles={pt}: unwritten outputs"
        assert np.array_equal(got, want), \
            f"H={heads} next_n={next_n} fp4={fp4} piece_tiles={pt}: {fn.name} differs"


@pytest.mark.parametrize("next_n,ctas,piece_tiles,fp4", [
    (2, 1, None, False), (2, 2, 4, False), (2, 3, 8, False), (2, 5, 1, False),
    (1, 1, None, False), (1, 3, 4, False), (2, 1, None, True), (2, 3, 8, True),
    (1, 2, 4, True),
])
def test_paged_ws_few_ctas_wrap_the_rings(cp, kin, next_n, ctas, piece_tiles, fp4):
    """The persistent warp-specialized decode kernels (fp8 and MXFP4 keys) on 1-5 CTAs:
    each runs many pieces, so its query slots and key ring wrap many times (mbarrier
    phases), pieces past a context only write -inf; bit-identical to the per-page kernel."""
    rng = np.random.default_rng(5000 + 10 * next_n + ctas + 100 * fp4)
    _ws_bits_of_lengths(cp, kin, rng, None, None, next_n, fp4, ctas, missing=True,
                        piece_tiles=piece_tiles, what=f"piece_tiles={piece_tiles}")


def _skewed_lens(rng):
    """One long context among many short ones (some empty): the batch the CTAs' shares
    balance (cps_wsd_share); round robin pieces would leave one CTA the long row."""
    return [20000] + list(rng.integers(0, 900, 40)) + [0, 1, 256, 257]


def _ws_bits_of_lengths(cp, kin, rng, lens, width, next_n, fp4, ctas=None, missing=False,
                        piece_tiles=None, what="", clean_logits=True):
    """The warp-specialized decode kernel on a batch of these lengths (None:
    _paged_fixed_case's) against the per-page kernel, bit for bit (NaN-poisoned
    outputs), and the per-page kernel's -inf mask against the reference's.
    ``clean_logits`` False: bit for bit inside each row's window; past it -inf up to the
    request's last visited 64-key tile, unwritten (NaN) from there on. Returns how many
    entries were left unwritten."""
    shape = {} if lens is None else dict(lens=lens, width=width)
    host, q8, w, ctx, table, width = _paged_fixed_case(rng, 64, next_n, fp4, missing=missing,
                                                       **shape)
    dcache = cpsparse.IndexerKCache.wrap(cp.asarray(host.data), 64, 128, dtype=host.dtype)
    dq, dw, dctx, dtable = (cp.asarray(a) for a in (q8, w, ctx, table))
    batch = table.shape[0]
    path, plan, fn = kin.paged_plan(batch, next_n, 64, 128, width, 64, fp4=fp4)
    assert plan[0] == "ws" and fn.name == kin.ws_kernel_name(next_n, fp4), (plan, fn.name)
    gplan, generic = _generic_paged(cp, kin, batch, next_n, 64, width, fp4)
    want = cp.full((batch * next_n, width), np.nan, dtype=cp.float32)
    kin.paged_mqa_logits(cp, dq, dcache, dw, dctx, dtable, width, out=want,
                         plan=(path, gplan, generic))
    want = want.get()
    assert not np.isnan(want).any(), "generic kernel: unwritten (NaN-poisoned) outputs"
    expect = ref.paged_mqa_logits(q8, host.data, 64, w, ctx, table, width, host.dtype)
    assert np.array_equal(np.isneginf(want), np.isneginf(expect))
    out = cp.full((batch * next_n, width), np.nan, dtype=cp.float32)
    kin.paged_mqa_logits(cp, dq, dcache, dw, dctx, dtable, width, out=out,
                         piece_tiles=piece_tiles, ctas=ctas, clean_logits=clean_logits)
    got = out.get()
    case = f"{what} next_n={next_n} fp4={fp4} ctas={ctas} clean_logits={clean_logits}"
    if clean_logits:
        assert not np.isnan(got).any(), f"{case}: unwritten (NaN-poisoned) outputs"
        assert np.array_equal(got, want), f"{case}: differs"
        return 0
    ends = np.minimum(cpsparse.paging.decode_row_ends(np.asarray(ctx), next_n), width)
    col = np.arange(width)[None, :]
    window = col < ends[:, None]
    # the keys a request's items visit: its longest row's end, up to whole 64-key tiles
    longest = np.repeat(ends.reshape(batch, next_n).max(axis=1), next_n)
    visited = col < np.minimum(-(-longest // 64) * 64, width)[:, None]
    assert np.array_equal(got[window], want[window]), f"{case}: differs inside the windows"
    assert np.isneginf(got[visited & ~window]).all(), \
        f"{case}: not -inf past a window inside the visited tiles"
    assert np.isnan(got[~visited]).all(), f"{case}: wrote past the visited tiles"
    return int((~visited).sum())


@pytest.mark.parametrize("case,next_n,fp4,ctas", [
    ("skewed", 1, False, None), ("skewed", 2, False, None), ("skewed", 1, True, None),
    ("skewed", 2, True, 7), ("skewed", 1, False, 3), ("empty", 1, False, None),
    ("empty", 2, True, 5), ("tiny", 2, False, None), ("tiny", 1, True, None),
    ("long_first", 1, False, 130),
])
def test_paged_ws_shares_of_mixed_lengths(cp, kin, case, next_n, fp4, ctas):
    """The warp-specialized decode CTAs split a batch by weight (every CTA's share from
    the lengths on the device): mixed lengths with empty rows, every row empty (every item
    only -inf: the math warpgroups see none), fewer stages than SMs (ws_grid), a share
    ending inside a request; bit-identical to the per-page kernel, and to the reference."""
    rng = np.random.default_rng(6000 + 10 * next_n + fp4 + len(case))
    lens, width = {"skewed": (_skewed_lens(rng), 20000 + 77), "empty": ([0] * 9, 3000),
                   "tiny": ([300, 5], 300),
                   "long_first": ([65536] + [300] * 20, 65536)}[case]
    _ws_bits_of_lengths(cp, kin, rng, lens, width, next_n, fp4, ctas, what=case)


@pytest.mark.parametrize("case,next_n,fp4", [
    ("full", 1, False), ("full", 2, True), ("first_empty", 1, False),
    ("first_empty", 2, False), ("first_empty", 1, True), ("short_of_width", 2, False),
    ("short_of_width", 1, True), ("two_a_thread_full", 1, False),
    ("two_a_thread_full", 2, True), ("two_a_thread_mixed", 1, False),
])
def test_paged_ws_guessed_first_items(cp, kin, case, next_n, fp4):
    """A batch of up to 256 requests: each CTA loads the page ids of the first item a
    uniform full batch would give it while the lengths load, and where its share starts
    there keeps them and issues that item's first stage (all four pages, past the
    windows too) and query block before the item's bounds. Every CTA guesses right
    (full, with a missing page among the guessed ids; two requests a producer thread past
    128); CTA 0 guesses right but its first item is only -inf (first_empty: the copies
    issued for it land before the next item's reuse their slots); it guesses right with
    fewer key stages than guessed (short_of_width: pages past the windows copied, never
    read); most guess wrong (two_a_thread_mixed). Bit-identical to the per-page kernel."""
    rng = np.random.default_rng(7000 + 10 * next_n + fp4 + len(case))
    lens, width, missing = {
        "full": ([4099] * 7, 4099, True),
        "first_empty": ([0] + [2048] * 6, 2048, True),
        "short_of_width": ([2000] * 4, 2100, False),
        "two_a_thread_full": ([700] * 200, 700, True),
        "two_a_thread_mixed": (list(rng.integers(0, 3001, 150)), 3000, False)}[case]
    _ws_bits_of_lengths(cp, kin, rng, lens, width, next_n, fp4, missing=missing, what=case)


@pytest.mark.parametrize("case,next_n,fp4,ctas", [
    ("last_stage", 1, False, None), ("last_stage", 2, True, None), ("last_stage", 1, True, 5),
    ("one_past_edge", 2, True, None), ("one_past_edge", 2, True, 3),
    ("one_past_edge", 2, False, None),
    ("more_ctas_than_stages", 1, False, 7), ("more_ctas_than_stages", 2, True, 9),
    ("full_one_cta", 2, False, 1), ("one_short", 1, False, None), ("one_short", 2, True, 4),
    ("past_guess", 1, False, None),
])
def test_paged_ws_full_batches_cut_from_the_launch(cp, kin, case, next_n, fp4, ctas):
    """Every request holding keys in all of its U stages (cps_wsd_share's one-barrier
    check): the CTAs' shares come from the launch alone, ceil(floor(c T / G) / 16). Ends
    anywhere in the last stage (last_stage; at next_n 2 only the second row reaching it:
    one_past_edge), more CTAs than stages (some shares empty, their guess past the batch),
    one CTA; a batch one request short of full takes the share's scan (one_short) and so
    does one past the guess's 256 requests (past_guess). (fp8 keys at next_n 2 have 2-D
    lengths, each row 0-2 short of its request's: one_past_edge there mixes full requests
    with ones that are not.) Bit-identical to the per-page kernel."""
    rng = np.random.default_rng(8000 + 10 * next_n + fp4 + len(case) + (ctas or 0))
    lens, width, missing = {
        "last_stage": (list(rng.integers(4099, 4201, 9)), 4200, True),
        "one_past_edge": ([2 * 256 + 1] * 6, 3 * 256, True),
        "more_ctas_than_stages": ([300] * 2, 300, False),
        "full_one_cta": ([1000] * 6, 1000, True),
        "one_short": ([4099] * 6 + [100], 4099, True),
        "past_guess": ([520] * 300, 520, True)}[case]
    _ws_bits_of_lengths(cp, kin, rng, lens, width, next_n, fp4, ctas, missing=missing,
                        what=case)


@pytest.mark.parametrize("case,next_n,fp4,ctas", [
    ("skewed", 1, False, None), ("skewed", 2, False, None), ("skewed", 2, True, 7),
    ("empty", 1, True, 5), ("full", 2, False, None), ("full", 1, True, 3),
    ("long_first", 2, False, 130),
])
def test_paged_ws_unclean_logits_leave_past_the_windows(cp, kin, case, next_n, fp4, ctas):
    """clean_logits=False (DeepGEMM's): the warp-specialized kernels write each row's
    window bit for bit as with clean_logits=True, -inf past it inside the tiles they
    visit, and nothing past those (NaN poison left): mixed lengths with empty rows,
    every row empty (nothing written at all), full rows (nothing to leave), one long
    request among short ones on 130 CTAs."""
    rng = np.random.default_rng(9000 + 10 * next_n + fp4 + len(case))
    lens, width = {"skewed": (_skewed_lens(rng), 20000 + 77), "empty": ([0] * 9, 3000),
                   "full": ([4099] * 7, 4099),
                   "long_first": ([65536] + [300] * 20, 65536)}[case]
    left = _ws_bits_of_lengths(cp, kin, rng, lens, width, next_n, fp4, ctas, what=case,
                               clean_logits=False)
    assert (left == 0) == (case == "full"), (case, left)


def test_paged_public_call_unclean_logits_feed_the_same_topk(cp):
    """The public call with clean_logits=False (its memoized launch too, the second
    call): the windows as with True, the same top-k sets (topk_per_row_decode reads
    only the windows; the kernel's order within a row is unspecified, and with no
    missing page no row ties at its k-th value), and a bool is required."""
    rng = np.random.default_rng(9100)
    host, q8, w, ctx, table, width = _paged_fixed_case(rng, 64, 2, False,
                                                       lens=_skewed_lens(rng), width=20077,
                                                       missing=False)
    dcache = cpsparse.IndexerKCache.wrap(cp.asarray(host.data), 64, 128, dtype=host.dtype)
    dq, dw, dctx, dtable = (cp.asarray(a) for a in (q8, w, ctx, table))
    clean = cpsparse.paged_mqa_logits(dq, dcache, dw, dctx, dtable, width)
    want = np.sort(cpsparse.topk_per_row_decode(clean, dctx, 2, 512).get(), axis=1)
    ends = cpsparse.paging.decode_row_ends(np.asarray(ctx), 2)
    window = np.arange(width)[None, :] < np.minimum(ends, width)[:, None]
    prev = cpsparse.set_device_value_checks(False)
    try:
        for _ in range(2):
            cp.get_default_memory_pool().free_all_blocks()
            junk = cp.full(clean.size + (1 << 20), np.nan, cp.float32)
            del junk                                      # the next output lands on NaN
            got = cpsparse.paged_mqa_logits(dq, dcache, dw, dctx, dtable, width,
                                            clean_logits=False)
            assert np.array_equal(got.get()[window], clean.get()[window])
            assert np.isnan(got.get()[~window]).any(), "clean_logits=False wrote -inf anyway"
            rows = cpsparse.topk_per_row_decode(got, dctx, 2, 512).get()
            assert np.array_equal(np.sort(rows, axis=1), want)
    finally:
        cpsparse.set_device_value_checks(prev)
    with pytest.raises(TypeError, match="Invalid clean_logits: expected a bool"):
        cpsparse.paged_mqa_logits(dq, dcache, dw, dctx, dtable, width, clean_logits=0)


# ---- DeepGEMM's bits ---------------------------------------------------------------

def _exact_codes(rng, shape):
    """e4m3 codes of +-1 and +-1.5 only: every product and every sum of them over D = 128
    is exact in float32, so only the epilogue's order of roundings decides the bits."""
    from benchmarks import probe_deepgemm_bits as probe
    return probe.E4M3_EXACT[rng.integers(0, 4, shape)]


def _pow2_scales(rng, n):
    return np.ldexp(1.0, rng.integers(-10, -5, n)).astype(np.float32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("heads", [64, 32])
def test_mqa_logits_write_deepgemms_bits(cp, kin, heads, path):
    """The prefill kernels sum a key's heads in the order nvcc compiled DeepGEMM's
    sm90 epilogue to (probe_deepgemm_bits.exact_code_logits), bit for bit: on exact codes
    the products cannot differ, so any unequal entry is the epilogue's. (On random codes
    the GPU machine's probe compares with DeepGEMM itself: 0 unequal on 2026-12-07.)"""
    from benchmarks import probe_deepgemm_bits as probe
    rng = np.random.default_rng(7100 + heads + (path == "mma"))
    ks, ke, n = _prefill_batch(rng, [(0, 50), (300, 40), (150, 33)])
    q8 = _exact_codes(rng, (len(ks), heads, 128))
    k8 = _exact_codes(rng, (n, 128))
    sk = _pow2_scales(rng, n)
    w = rng.standard_normal((len(ks), heads)).astype(np.float32)
    got = _prefill(cp, kin, [cp.asarray(a) for a in (q8, k8, sk, w, ks, ke)], path).get()
    inside = np.arange(n)[None, :] < ke[:, None]
    inside &= np.arange(n)[None, :] >= ks[:, None]
    want = np.where(inside, probe.exact_code_logits(q8, w, k8, sk), -np.inf)
    unequal = int((got != want).sum())
    assert unequal == 0, f"H={heads} {path}: {unequal} of {got.size} entries differ"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("heads,next_n", [(64, 1), (64, 2), (32, 2)])
def test_paged_mqa_logits_write_deepgemms_bits(cp, kin, heads, next_n, path):
    """The decode kernels (per page and, for 64 heads on wgmma, warp-specialized) write
    the bits of DeepGEMM's epilogue order on exact codes, over ragged and 2-D lengths and
    a missing page (its positions -inf, as the reference's)."""
    from benchmarks import probe_deepgemm_bits as probe
    rng = np.random.default_rng(7200 + heads + 10 * next_n + (path == "mma"))
    host, _, _, ctx, table = _paged_batch(rng, [1, 63, 64, 65, 700, 2000, 2], next_n, heads,
                                          two_d=next_n > 1)
    table[5, 3] = -1
    nb, bs, d = host.data.shape[0], 64, 128
    host.data[:, :bs * d] = _exact_codes(rng, (nb, bs * d))
    host.data[:, bs * d:] = _pow2_scales(rng, nb * bs).view(np.uint8).reshape(nb, -1)
    batch, width = table.shape[0], 2048
    q8 = _exact_codes(rng, (batch, next_n, heads, 128))
    w = rng.standard_normal((batch * next_n, heads)).astype(np.float32)
    dcache = cpsparse.IndexerKCache.wrap(cp.asarray(host.data), bs, d)
    got = _paged(cp, kin, cp.asarray(q8), dcache, cp.asarray(w), cp.asarray(ctx),
                 cp.asarray(table), width, path=path).get()
    mask = np.isneginf(ref.paged_mqa_logits(q8, host.data, 64, w, ctx, table, width))
    pos = np.arange(width)
    for b in range(batch):
        page = table[b, np.minimum(pos // bs, table.shape[1] - 1)].clip(0)
        keys = host.data[page[:, None], (pos % bs)[:, None] * d + np.arange(d)]
        scales = host.data[:, bs * d:].view(np.float32)[page, pos % bs]
        rows = slice(b * next_n, (b + 1) * next_n)
        want = np.where(mask[rows], -np.inf,
                        probe.exact_code_logits(q8[b], w[rows], keys, scales))
        unequal = int((got[rows] != want).sum())
        assert unequal == 0, \
            f"H={heads} next_n={next_n} {path}: request {b}, {unequal} entries differ"


@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_other_block_sizes(cp, kin, block_size):
    rng = np.random.default_rng(block_size)
    lens = [1, 15, 16, 17, 127, 128, 129, 3000]
    cache, q8, w, ctx, table = _paged_batch(rng, lens, 2, 32, block_size=block_size)
    width = 3001
    expect = ref.paged_mqa_logits(q8, cache.data, block_size, w, ctx, table, width)
    dcache = cpsparse.IndexerKCache.wrap(cp.asarray(cache.data), block_size, 128)
    args = [cp.asarray(a) for a in (q8, w, ctx, table)]
    for path in PATHS:
        out = _paged(cp, kin, args[0], dcache, args[1], args[2], args[3], width, path=path)
        _check(out, expect, f"paged block_size={block_size} path={path}")


def test_paged_graph_capture(cp, kin):
    """The decode launch does no host sync: it records into a CUDA graph and replays."""
    rng = np.random.default_rng(5)
    lens = [300, 64, 5000, 1]
    cache, q8, w, ctx, table = _paged_batch(rng, lens, 2, 64)
    width = 5000
    expect = ref.paged_mqa_logits(q8, cache.data, 64, w, ctx, table, width)
    dcache = cpsparse.IndexerKCache.wrap(cp.asarray(cache.data), 64, 128)
    dq, dw, dctx, dtable = (cp.asarray(a) for a in (q8, w, ctx, table))
    out = cp.empty(expect.shape, dtype=cp.float32)
    _paged(cp, kin, dq, dcache, dw, dctx, dtable, width, out=out)      # warm (compile), plan
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        kin.paged_mqa_logits(cp, dq, dcache, dw, dctx, dtable, width, out=out)
        graph = stream.end_capture()
        out.fill(np.nan)
        graph.launch()
    stream.synchronize()
    _check(out, expect, "graph replay")


@pytest.mark.parametrize("heads,next_n,block_size", [(64, 1, 64), (64, 2, 64), (32, 1, 128),
                                                    (64, 4, 64), (16, 2, 256), (20, 3, 64)])
def test_mxfp4_paged_kernel_matches_reference(cp, kin, heads, next_n, block_size):
    """The MXFP4 decode kernel (e2m1 expanded to e4m3 A fragments in registers, the fp8
    wgmma path) against the reference on the same pages: ragged contexts, a key whose
    groups' scales span 2**-20 (the folded exponents round the small group to 0), a third
    of the keys with groups 2**0 .. 2**-9 below their largest (the expansion's integer
    table down to 2**-5, its converted one below), a bad page id with value checks off
    (masked, never read), every plan variant."""
    rng = np.random.default_rng(heads + next_n + block_size)
    d, batch = 128, 3
    width = 6 * 1024
    pages_per = -(-width // block_size)
    nb = batch * pages_per + 2
    n = nb * block_size
    k = (rng.standard_normal((n, d)) * rng.uniform(0.3, 3.0, (n, 1))).astype(np.float32)
    spread = rng.random(n) < 1 / 3
    k[spread] *= np.repeat(2.0 ** -rng.integers(0, 10, (int(spread.sum()), 4)), 32, axis=1)
    k[5, 32:64] *= 2.0 ** -20
    host = cpsparse.IndexerKCache(nb, block_size, d, dtype="mxfp4")
    host.insert(k, np.arange(nb * block_size, dtype=np.int32))
    dev = cpsparse.IndexerKCache.wrap(cp.asarray(host.data), block_size, d, dtype="mxfp4")
    q8, w = _queries(rng, (batch, next_n, heads, d))
    table = rng.permutation(nb).astype(np.int32)[:batch * pages_per].reshape(batch, pages_per)
    table[1, 3] = nb + 7                                   # bad page id: masked
    lens = np.array([width, 2500, 65], np.int32)
    plan = kin.paged_plan(batch, next_n, heads, d, width, block_size, fp4=True)
    assert plan[1] is not None and "fp4" in plan[2].name
    # the reference core masks the bad page as the kernel must (the public NumPy call
    # would refuse it: value checks always run on host arrays)
    from cpsparse.indexer import paged_mqa_logits_core
    want = paged_mqa_logits_core(np, q8, host, w, lens, table, width)
    previous = cpsparse.set_device_value_checks(False)
    try:
        got = cpsparse.paged_mqa_logits(cp.asarray(q8), dev, cp.asarray(w), cp.asarray(lens),
                                        cp.asarray(table), width)
    finally:
        cpsparse.set_device_value_checks(previous)
    _check(got, want, f"mxfp4 H={heads} next_n={next_n} bs={block_size}")


def test_mxfp4_cache_on_cupy_matches_numpy():
    """MXFP4 insert on CuPy writes the NumPy bytes; pages of 32 keys have no MXFP4
    kernel: the reference runs, with a warning (never the fp8 kernel on MXFP4 bytes)."""
    import cupy as cp
    rng = np.random.default_rng(9)
    bs, d, nb = 32, 128, 8
    k = rng.standard_normal((nb * bs, d)).astype(np.float32)
    slots = rng.permutation(nb * bs).astype(np.int32)
    host = cpsparse.IndexerKCache(nb, bs, d, dtype="mxfp4")
    host.insert(k, slots)
    dev = cpsparse.IndexerKCache(nb, bs, d, xp=cp, dtype="mxfp4")
    with pytest.warns(UserWarning):
        dev.insert(cp.asarray(k), cp.asarray(slots))
    assert np.array_equal(dev.data.get(), host.data)
    q8, _ = cpsparse.quantize_fp8(rng.standard_normal((2, 1, 64, d)).astype(np.float32),
                                  eps=1e-10)
    w = rng.random((2, 64)).astype(np.float32)
    table = rng.permutation(nb).astype(np.int32).reshape(2, 4)
    lens = np.array([128, 77], np.int32)
    want = cpsparse.paged_mqa_logits(q8, host, w, lens, table, 128)
    with pytest.warns(UserWarning):
        got = cpsparse.paged_mqa_logits(cp.asarray(q8), dev, cp.asarray(w), cp.asarray(lens),
                                        cp.asarray(table), 128)
    np.testing.assert_array_equal(got.get(), want)


@pytest.fixture
def paged_core_calls(count_core_calls):
    """Counts the CuPy calls of paged_mqa_logits that leave the memoized launch for the
    checked path (paged_mqa_logits_core)."""
    from cpsparse import indexer
    indexer._PAGED_CALLS.clear()
    yield count_core_calls(indexer, "paged_mqa_logits_core")
    indexer._PAGED_CALLS.clear()


@pytest.mark.parametrize("form", ["fp8_n1", "fp8_n2_2d", "mxfp4_n2", "raw_2d", "raw_4d"])
def test_paged_memoized_launch_in_production_mode(cp, paged_core_calls, form):
    """Value checks off, a call whose layouts the memo holds is its one prepared launch
    (raw_kernels.indexer.call_launch: the core is not entered) and writes the bits the
    checked path writes, on fresh queries and tables in the same layouts; the cache as an
    IndexerKCache (fp8, MXFP4) or as vLLM's and DeepGEMM's raw arrays."""
    rng = np.random.default_rng(len(form))
    next_n = 1 if form == "fp8_n1" else 2
    lens = [20000, 65, 700, 1]
    cache, q8, w, ctx, table = _paged_batch(rng, lens, next_n, 64, two_d=form == "fp8_n2_2d")
    width = max(lens) + 37
    if form == "mxfp4_n2":
        host = cpsparse.IndexerKCache(cache.num_blocks, 64, 128, dtype="mxfp4")
        host.insert(rng.standard_normal((cache.num_blocks * 64, 128)).astype(np.float32),
                    np.arange(cache.num_blocks * 64, dtype=np.int32))
        dcache = cpsparse.IndexerKCache.wrap(cp.asarray(host.data), 64, 128, dtype="mxfp4")
    else:
        dcache = cpsparse.IndexerKCache.wrap(cp.asarray(cache.data), 64, 128)
    arg = dcache.data if form == "raw_2d" else \
        dcache.data.reshape(-1, 64, 1, 132) if form == "raw_4d" else dcache
    dctx, dtable = cp.asarray(ctx), cp.asarray(table)
    previous = cpsparse.set_device_value_checks(False)
    try:
        for call in range(3):
            dq, dw = (cp.asarray(a) for a in _queries(rng, (len(lens), next_n, 64, 128)))
            if call == 2:                       # the same pages under other ids
                ids = rng.permutation(cache.num_blocks)
                dtable = cp.asarray(np.where(table >= 0, ids[table], -1).astype(np.int32))
            got = cpsparse.paged_mqa_logits(dq, arg, dw, dctx, dtable, width)
            cpsparse.set_device_value_checks(True)
            want = cpsparse.paged_mqa_logits(dq, dcache, dw, dctx, dtable, width)
            cpsparse.set_device_value_checks(False)
            # (bitwise, NaN where both read a garbage page: the new table's ids reach pages
            # _paged_batch never wrote)
            assert cp.array_equal(got, want, equal_nan=True).item(), f"{form}: call {call}"
    finally:
        cpsparse.set_device_value_checks(previous)
    assert len(paged_core_calls) == 1 + 3     # the first (checked) call, then the `want`s


def test_paged_memoized_launch_leaves_a_misaligned_view(cp, paged_core_calls, monkeypatch):
    """Queries at an address off 16 bytes have the layouts of aligned ones: the memoized
    launch declines them, and the checked path runs the reference (with its fallback
    warning, once a shape)."""
    rng = np.random.default_rng(5)
    lens = [3000, 65]
    cache, q8, w, ctx, table = _paged_batch(rng, lens, 1, 64)
    width = max(lens)
    dcache = cpsparse.IndexerKCache.wrap(cp.asarray(cache.data), 64, 128)
    dw, dctx, dtable = cp.asarray(w), cp.asarray(ctx), cp.asarray(table)
    flat = cp.zeros(q8.size + 1, cp.uint8)
    shifted = flat[1:].reshape(q8.shape)
    shifted[...] = cp.asarray(q8)
    previous = cpsparse.set_device_value_checks(False)
    try:
        cpsparse.paged_mqa_logits(cp.asarray(q8), dcache, dw, dctx, dtable, width)
        monkeypatch.setattr(cpsparse._backend, "_FALLBACKS_WARNED", set())
        with pytest.warns(KernelFallbackWarning, match="paged_mqa_logits"):
            got = cpsparse.paged_mqa_logits(shifted, dcache, dw, dctx, dtable, width)
    finally:
        cpsparse.set_device_value_checks(previous)
    assert len(paged_core_calls) == 2
    _check(got, ref.paged_mqa_logits(q8, cache.data, 64, w, ctx, table, width),
           "misaligned queries")


@pytest.fixture
def prefill_core_calls(count_core_calls):
    """Counts the CuPy calls of mqa_logits that leave the memoized launch for the checked
    path (mqa_logits_core), with the op's memo empty before and after."""
    from cpsparse import indexer
    indexer._MQA_CALLS.clear()
    yield count_core_calls(indexer, "mqa_logits_core")
    indexer._MQA_CALLS.clear()


@pytest.mark.parametrize("form", ["h64", "h32", "scales_n1"])
def test_prefill_memoized_launch_in_production_mode(cp, prefill_core_calls, form):
    """Value checks off, an mqa_logits call whose layouts the memo holds is the prefill
    kernel's prepared launch (raw_kernels.indexer.prefill_call_launch: the core is not
    entered) and writes the bits the checked path writes, on fresh queries, keys and
    windows in the same layouts (64 heads: the _h64 kernel; 32: the generic one;
    quantize_fp8's [N, 1] scales)."""
    rng = np.random.default_rng(len(form))
    heads = 32 if form == "h32" else 64
    previous = cpsparse.set_device_value_checks(False)
    try:
        ks, ke, n = _prefill_batch(rng, [(500, 40), (0, 9), (300, 31)])
        for call in range(3):
            expect, dev = _prefill_inputs(cp, rng, heads, n, ks, ke)
            if form == "scales_n1":
                dev[2] = dev[2].reshape(-1, 1)
            got = cpsparse.indexer.mqa_logits(*dev)
            cpsparse.set_device_value_checks(True)
            want = cpsparse.indexer.mqa_logits(*dev)
            cpsparse.set_device_value_checks(False)
            assert cp.array_equal(got, want).item(), f"{form}: call {call}"
            _check(got, expect, f"{form}: call {call}")
    finally:
        cpsparse.set_device_value_checks(previous)
    assert len(prefill_core_calls) == 1 + 3       # the first (checked) call, then the `want`s


@pytest.mark.parametrize("case", ["int64_windows", "misaligned_q", "checks_on"])
def test_prefill_memoized_launch_steps_aside(cp, prefill_core_calls, monkeypatch, case):
    """int64 windows (copied to int32 first), queries at an address off 16 bytes (the
    layouts do not say it: the checked path falls back to the reference, with its
    warning) and value checks back on take the checked path, and still answer right."""
    rng = np.random.default_rng(3)
    ks, ke, n = _prefill_batch(rng, [(700, 20), (0, 12)])
    if case == "int64_windows":
        ks, ke = ks.astype(np.int64), ke.astype(np.int64)
    expect, dev = _prefill_inputs(cp, rng, 64, n, ks, ke)
    args = list(dev)
    if case == "misaligned_q":
        flat = cp.zeros(dev[0].size + 1, cp.uint8)
        args[0] = flat[1:].reshape(dev[0].shape)
        args[0][...] = dev[0]
    previous = cpsparse.set_device_value_checks(False)
    try:
        cpsparse.indexer.mqa_logits(*dev)           # fills the memo
        fills = len(prefill_core_calls)
        if case == "checks_on":
            cpsparse.set_device_value_checks(True)
        if case == "misaligned_q":
            monkeypatch.setattr(cpsparse._backend, "_FALLBACKS_WARNED", set())
            with pytest.warns(KernelFallbackWarning, match="mqa_logits"):
                got = cpsparse.indexer.mqa_logits(*args)
        else:
            got = cpsparse.indexer.mqa_logits(*args)
    finally:
        cpsparse.set_device_value_checks(previous)
    assert len(prefill_core_calls) == fills + 1, case
    _check(got, expect, case)
