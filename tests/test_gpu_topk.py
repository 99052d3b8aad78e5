"""GPU: per-row top-k kernels against the reference's order (DESIGN.md sections 6, 11).

Set test on every long row: the k chosen positions are distinct and in the
window, and they hold the k largest order keys (all keys above the k-th
largest, the rest equal to it: min over selected >= max over unselected,
exactly, on the reference's ``order_keys``: NaN lowest, -0 == +0). Short rows
(len <= k) must be exactly ``0..len-1`` then -1. Outputs are poisoned first.
"""

import zlib

import numpy as np
import pytest

import cpsparse
from cpsparse.indexer import decode_row_ends, topk_per_row, topk_per_row_decode
from cpsparse.reference.indexer import order_keys

pytestmark = pytest.mark.gpu

POISON = 0x5EADBEEF
LENGTH_CLASSES = lambda k: [0, 1, k - 1, k, k + 1, 4096, 8192, 65536, 131072]  # noqa: E731


@pytest.fixture
def cp():
    import cupy
    return cupy


@pytest.fixture
def ktopk():
    from cpsparse.raw_kernels import topk
    return topk


def check_rows(logits, starts, ends, k, got):
    """Set test of DESIGN section 11 on host arrays (exact on order keys)."""
    got = np.asarray(got)
    assert got.shape == (logits.shape[0], k) and got.dtype == np.int32
    for r in range(logits.shape[0]):
        s, e = int(starts[r]), int(ends[r])
        n, g = e - s, got[r].astype(np.int64)
        if n <= k:
            want = np.where(np.arange(k) < n, np.arange(k), -1)
            assert np.array_equal(g, want), f"row {r} (len {n}): {g[:8]} ... vs {want[:8]}"
            continue
        assert g.min() >= 0 and g.max() < n, f"row {r}: position outside [0, {n})"
        assert np.unique(g).size == k, f"row {r}: repeated positions"
        keys = order_keys(logits[r, s:e]).astype(np.int64)
        sel = keys[g]
        kth = np.partition(keys, n - k)[n - k]
        assert sel.min() == kth, f"row {r} (len {n}): min selected {sel.min()} != k-th {kth}"
        assert (sel > kth).sum() == (keys > kth).sum(), f"row {r}: an element above the k-th missed"


def _poisoned(cp, rows, k):
    return cp.full((rows, k), POISON, dtype=cp.int32)


def adversarial(rng, kind, n, k):
    """float32 [n] of one adversarial kind."""
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "equal":
        return np.full(n, 0.75, np.float32)
    if kind == "ties":                       # many ties at the threshold
        return rng.integers(0, 7, n).astype(np.float32)
    if kind == "duplicates":
        return rng.choice(rng.standard_normal(40).astype(np.float32), n)
    if kind == "neginf_tail":                # fewer finite values than k, -inf after
        x = np.full(n, -np.inf, np.float32)
        m = min(n, k // 3)
        x[rng.choice(n, m, replace=False)] = rng.standard_normal(m)
        return x
    if kind == "nan":
        x = rng.standard_normal(n).astype(np.float32)
        x[rng.random(n) < 0.4] = np.nan
        x[rng.random(n) < 0.01] = -np.nan
        return x
    if kind == "mostly_nan":                 # NaN only chosen when nothing else is left
        x = np.full(n, np.nan, np.float32)
        x[rng.choice(n, min(n, 7), replace=False)] = -np.inf
        x[rng.choice(n, min(n, 5), replace=False)] = 2.0
        return x
    if kind == "huge":
        x = rng.standard_normal(n).astype(np.float32)
        x[rng.integers(n)] = np.float32(3e38)
        x[rng.integers(n)] = np.inf
        return x
    if kind == "ascending":
        return np.sort(rng.standard_normal(n).astype(np.float32))
    if kind == "descending":
        return np.sort(rng.standard_normal(n).astype(np.float32))[::-1].copy()
    if kind == "low_mantissa":               # values differ only in the last bits
        bits = np.uint32(0x3F800000) + rng.integers(0, 3 * k, n).astype(np.uint32)
        return bits.view(np.float32)
    if kind == "signed_zeros":
        vals = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, -1.0], np.float32)
        return rng.choice(vals, n)
    if kind == "crowded_bin":                # ~300 values (100 distinct) at the k-th
        # largest: the threshold bin holds 300-450 candidates, as on the scoring
        # kernel's logits, and ranks them by buckets (tk_bucket_rank), ties inside
        x = rng.standard_normal(n).astype(np.float32)
        kth = np.partition(x, n - k)[n - k]
        pos = rng.choice(n, min(n // 4, 300), replace=False)
        x[pos] = kth + rng.integers(-50, 50, pos.size).astype(np.float32) * np.float32(1e-5)
        return x
    if kind == "narrow":                     # everything in one fp16 bin
        return (np.float32(1.0) + rng.random(n).astype(np.float32) * np.float32(1e-3))
    # The coarse key adapts to statistics of a row's first values (topk.cu, tk_adapt):
    # the benchmark's distributions, and first values that mislead it.
    if kind == "shift100":
        return rng.standard_normal(n).astype(np.float32) + np.float32(100)
    if kind == "scale1e-8":
        return rng.standard_normal(n).astype(np.float32) * np.float32(1e-8)
    if kind == "low10bits":
        return (np.uint32(0x3F900000) | rng.integers(0, 1024, n).astype(np.uint32)).view(
            np.float32)
    if kind == "subnormal":                  # spread below the smallest normal float
        return (rng.integers(-4000, 4000, n).astype(np.int32) * 1e-43).astype(np.float32)
    if kind == "probe_outliers":             # the first values span 60 decades
        x = rng.standard_normal(n).astype(np.float32)
        m = min(n, 4096)
        x[:m] *= np.float32(10.0) ** rng.integers(-30, 30, m).astype(np.float32)
        return x
    if kind == "probe_narrow":               # the first values all but equal, the rest not
        x = (rng.standard_normal(n) * 1e4).astype(np.float32)
        x[:min(n, 4096)] = np.float32(3.0) + rng.random(min(n, 4096)).astype(np.float32) * 1e-6
        return x
    if kind == "probe_nonfinite":            # no finite value among the first
        x = rng.standard_normal(n).astype(np.float32)
        m = min(n, 4096)
        x[:m] = np.where(rng.random(m) < 0.5, np.float32(-np.inf), np.float32(np.nan))
        return x
    raise ValueError(kind)


KINDS = ["normal", "equal", "ties", "duplicates", "neginf_tail", "nan", "mostly_nan", "huge",
         "ascending", "descending", "low_mantissa", "signed_zeros", "crowded_bin", "narrow",
         "shift100", "scale1e-8", "low10bits", "subnormal", "probe_outliers", "probe_narrow",
         "probe_nonfinite"]


def _ragged(rng, lens, extra=5):
    """Logits [M, max(len) + extra] with each row's window at a random offset."""
    width = max(lens) + extra
    starts = np.array([rng.integers(0, width - n + 1) for n in lens], np.int32)
    ends = (starts + np.asarray(lens)).astype(np.int32)
    return width, starts, ends


@pytest.mark.parametrize("cluster", [None, 1, 2, 8])
@pytest.mark.parametrize("k", [512, 2048])
def test_length_classes(cp, ktopk, k, cluster):
    rng = np.random.default_rng(k + (cluster or 0))
    lens = LENGTH_CLASSES(k) + [k + 3, 3 * k + 1]
    width, starts, ends = _ragged(rng, lens)
    logits = (rng.standard_normal((len(lens), width)) * 4).astype(np.float32)
    out = _poisoned(cp, len(lens), k)
    if cluster is None:
        res = topk_per_row(cp.asarray(logits), cp.asarray(starts), cp.asarray(ends), k, out=out)
    else:
        res = ktopk.topk_per_row(cp, cp.asarray(logits), cp.asarray(starts), cp.asarray(ends),
                                 k, out, cluster=cluster)
    assert res is out
    check_rows(logits, starts, ends, k, out.get())


# The r* variants hold the row in shared memory: rows up to topk.ROW_MAX_WIDTH (32768).
ROW_VARIANTS = ["r256"]
VARIANTS = ["c1", "c1_t256", "c2", "c4", "c8", "c16"] + ROW_VARIANTS


def _row_n(variant, n):
    """n, or for a row-in-shared-memory variant a width it takes (the widest it can)."""
    from cpsparse.raw_kernels import topk
    return min(n, topk.ROW_MAX_WIDTH - 6) if variant in ROW_VARIANTS else n


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", [3000, 8195, 65536])
@pytest.mark.parametrize("kind", KINDS)
def test_adversarial(cp, ktopk, kind, n, variant):
    k = 1024 if n == 3000 else 2048
    n = _row_n(variant, n)
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{n}/{variant}".encode()))
    rows = 3
    width = n + 3
    logits = np.stack([adversarial(rng, kind, width, k) for _ in range(rows)])
    starts = np.array([0, 1, 3], np.int32)
    ends = (starts + np.array([n, n - 1, n])).astype(np.int32)
    out = _poisoned(cp, rows, k)
    ktopk.topk_per_row(cp, cp.asarray(logits), cp.asarray(starts), cp.asarray(ends), k, out,
                       variant=variant)
    check_rows(logits, starts, ends, k, out.get())


@pytest.mark.parametrize("variant", ROW_VARIANTS)
def test_row_variants_refuse_wider_rows(cp, ktopk, variant):
    """A row-in-shared-memory variant forced onto rows wider than its buffer can hold
    is an error before any launch, never a launch past its shared memory."""
    width = ktopk.ROW_MAX_WIDTH + 1
    logits = cp.zeros((1, width), cp.float32)
    z = cp.zeros(1, cp.int32)
    with pytest.raises(ValueError, match="at most 32768"):
        ktopk.topk_per_row(cp, logits, z, z + width, 2048, None, variant=variant)


def test_row_variants_chosen_for_short_rows(ktopk):
    """Rows up to ROW_WIDTH run the shared-memory variant, wider ones the register tiles."""
    assert ktopk._plan(8192, ktopk.ROW_WIDTH, None, None)[2] == 256
    assert ktopk._plan(8192, ktopk.ROW_WIDTH, None, None)[3] == ktopk.row_buffer_bytes(
        ktopk.ROW_WIDTH)
    assert ktopk._plan(8192, ktopk.ROW_WIDTH + 1, None, None)[3] == 2 * ktopk.CAND_ONE_CTA * 8


def _strided_positions(n, head, ctas, threads):
    """The first value of each thread's first float4 (tile 0) of every CTA's slice."""
    nv = (head + n + 3) >> 2
    per = -(-nv // ctas)
    pos = []
    for r in range(ctas):
        lo = min(nv, r * per)
        hi = min(nv, lo + per)
        v = lo + np.arange(threads)
        i = 4 * v - head
        pos.append(i[(v < hi) & (i >= 0) & (i < n)])
    return np.concatenate(pos)


@pytest.mark.parametrize("variant", VARIANTS)
def test_large_values_on_thread_strides(cp, ktopk, variant):
    """Large values exactly at the first value of every thread's first float4 (the
    positions an earlier sampled pass read): still exact."""
    rng = np.random.default_rng(9)
    k, n, start = 2048, _row_n(variant, 65536), 1
    ctas, threads, _ = ktopk.VARIANTS[variant]
    width = n + 6
    row = rng.standard_normal(width).astype(np.float32)
    logits = cp.asarray(np.stack([row, row]))
    head = (logits.data.ptr // 4 + start) % 4                      # row 0
    pos = _strided_positions(n, head, ctas, threads)
    host = logits.get()
    host[0, start + pos] = (100 + 0.25 * np.arange(pos.size)).astype(np.float32)
    logits.set(host)
    starts = np.array([start, 0], np.int32)
    ends = (starts + n).astype(np.int32)
    out = _poisoned(cp, 2, k)
    ktopk.topk_per_row(cp, logits, cp.asarray(starts), cp.asarray(ends), k, out,
                       variant=variant)
    check_rows(host, starts, ends, k, out.get())


def test_variants_listed(ktopk):
    assert sorted(VARIANTS) == sorted(ktopk.VARIANTS)


@pytest.mark.parametrize("k", [512, 1024, 2048])
def test_prefill_ragged_random(cp, k):
    """Many rows, causal windows of several requests, fresh random data."""
    rng = np.random.default_rng(k)
    ctx, q = [3000, 0, 5000], [300, 200, 150]
    starts, ends, width = [], [], sum(c + t for c, t in zip(ctx, q))
    off = 0
    for c, t in zip(ctx, q):
        for i in range(t):
            starts.append(off)
            ends.append(off + c + i + 1)
        off += c + t
    starts, ends = np.array(starts, np.int32), np.array(ends, np.int32)
    logits = rng.standard_normal((starts.size, width)).astype(np.float32)
    logits[:, ::7] *= 100
    out = _poisoned(cp, starts.size, k)
    topk_per_row(cp.asarray(logits), cp.asarray(starts), cp.asarray(ends), k, out=out)
    check_rows(logits, starts, ends, k, out.get())


def test_out_row_slice_of_bigger_buffer(cp):
    """out= a row slice of the shared buffer: written in place, other rows untouched."""
    rng = np.random.default_rng(5)
    k, rows = 2048, 6
    lens = [10, 2048, 2049, 5000, 70000, 0]
    width, starts, ends = _ragged(rng, lens)
    logits = rng.standard_normal((rows, width)).astype(np.float32)
    buf = _poisoned(cp, rows + 7, k)
    view = buf[3:3 + rows]
    res = topk_per_row(cp.asarray(logits), cp.asarray(starts), cp.asarray(ends), k, out=view)
    assert res.data.ptr == view.data.ptr
    host = buf.get()
    assert (host[:3] == POISON).all() and (host[3 + rows:] == POISON).all()
    check_rows(logits, starts, ends, k, host[3:3 + rows])
    # out=None allocates
    fresh = topk_per_row(cp.asarray(logits), cp.asarray(starts), cp.asarray(ends), k)
    check_rows(logits, starts, ends, k, fresh.get())


@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("width", [4000, 131072])
def test_decode(cp, next_n, two_d, width):
    rng = np.random.default_rng(next_n * 10 + two_d + width)
    k = 2048
    batch = 5
    lens = np.array([width, 1, 2049 + next_n, rng.integers(k, width + 1), 0], np.int32)
    if two_d:
        ctx = np.minimum(lens[:, None] + np.arange(next_n)[None, :] - 1, width)
        ctx = np.maximum(ctx, 0).astype(np.int32)
    else:
        ctx = lens
    logits = rng.standard_normal((batch * next_n, width)).astype(np.float32)
    logits[::3, ::5] = np.nan
    ends = decode_row_ends(ctx, next_n)
    out = _poisoned(cp, batch * next_n, k)
    topk_per_row_decode(cp.asarray(logits), cp.asarray(ctx), next_n, k, out=out)
    check_rows(logits, np.zeros_like(ends), ends, k, out.get())


@pytest.mark.parametrize("cluster", [1, 2, 4, 8, 16])
def test_decode_cluster_variants(cp, ktopk, cluster):
    rng = np.random.default_rng(cluster)
    k, next_n, width = 2048, 2, 131072
    ctx = np.array([131072, 70001, 9000], np.int32)
    logits = rng.standard_normal((3 * next_n, width)).astype(np.float32)
    out = _poisoned(cp, 3 * next_n, k)
    ktopk.topk_per_row_decode(cp, cp.asarray(logits), cp.asarray(ctx), next_n, k, out,
                              cluster=cluster)
    ends = decode_row_ends(ctx, next_n)
    check_rows(logits, np.zeros_like(ends), ends, k, out.get())


def test_many_rows_and_empty(cp):
    rng = np.random.default_rng(11)
    k = 512
    rows, width = 3000, 1600
    logits = rng.standard_normal((rows, width)).astype(np.float32)
    starts = rng.integers(0, 500, rows).astype(np.int32)
    ends = (starts + rng.integers(0, 1101, rows)).astype(np.int32)
    out = _poisoned(cp, rows, k)
    topk_per_row(cp.asarray(logits), cp.asarray(starts), cp.asarray(ends), k, out=out)
    check_rows(logits, starts, ends, k, out.get())
    empty = topk_per_row(cp.zeros((0, 10), cp.float32), cp.zeros(0, cp.int32),
                         cp.zeros(0, cp.int32), 4)
    assert empty.shape == (0, 4)


def test_graph_capture_and_stream(cp):
    """No host sync inside: the public call captures into a CUDA graph and replays."""
    from cpsparse import raw_kernels
    raw_kernels.precompile(["topk"])
    rng = np.random.default_rng(3)
    k, next_n = 2048, 1
    ctx = np.array([131072, 5000, 100, 40000], np.int32)
    width = 131072
    logits_h = rng.standard_normal((ctx.size, width)).astype(np.float32)
    logits, ctx_d = cp.asarray(logits_h), cp.asarray(ctx)
    out = _poisoned(cp, ctx.size, k)
    topk_per_row_decode(logits[:1], ctx_d[:1], next_n, k, out=out[:1])   # warm (SM count)
    out.fill(POISON)
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        topk_per_row_decode(logits, ctx_d, next_n, k, out=out)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
    ends = decode_row_ends(ctx, next_n)
    check_rows(logits_h, np.zeros_like(ends), ends, k, out.get())
    # replay on fresh values in the same buffers
    logits_h = rng.standard_normal((ctx.size, width)).astype(np.float32)
    with stream:
        logits.set(logits_h)
        out.fill(POISON)
        graph.launch(stream)
        stream.synchronize()
    check_rows(logits_h, np.zeros_like(ends), ends, k, out.get())


def test_matches_reference_backend_short_rows(cp):
    """Rows no longer than k are bit-identical to the reference (no scoring needed)."""
    rng = np.random.default_rng(2)
    k = 1024
    lens = [0, 1, 1000, 1023, 1024]
    width, starts, ends = _ragged(rng, lens)
    logits = rng.standard_normal((len(lens), width)).astype(np.float32)
    ref = cpsparse.indexer.topk_per_row(logits, starts, ends, k)
    got = topk_per_row(cp.asarray(logits), cp.asarray(starts), cp.asarray(ends), k,
                       out=_poisoned(cp, len(lens), k))
    assert np.array_equal(got.get(), ref)


def _slot_table(rng, batch, cols, num_blocks, bad=False):
    """Distinct random page ids; ``bad``: negative and int32-overflowing ids in use."""
    table = rng.permutation(num_blocks)[:batch * cols].reshape(batch, cols).astype(np.int32)
    if bad:
        table[0, 1] = -1
        table[1, 0] = 2**31 - 1          # page * block_size overflows int32: -1
    return table


def _mapped(positions, table, next_n, block_size):
    from cpsparse import paging
    req = np.arange(positions.shape[0], dtype=np.int32) // next_n
    return paging.local_to_global_slots(positions, req, table, block_size)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("bad", [False, True])
def test_decode_fused_slots_every_variant(cp, ktopk, variant, bad):
    """The fused slot mapping gives what local_to_global_slots gives the positions
    (distinct logits, so the chosen set is unique), on every compiled variant, with
    bad page ids in use (value checks off: masked to -1, never read)."""
    rng = np.random.default_rng(len(variant) + bad)
    k, next_n, bs = 2048, 2, 64
    width = 20000 if variant == "c1_t256" or variant in ROW_VARIANTS else 131072
    ctx = np.array([width, 5000, 100], np.int32)
    cols = -(-width // bs)
    table = _slot_table(rng, 3, cols, 8 * cols, bad)
    logits = np.stack([rng.permutation(width) for _ in range(3 * next_n)]).astype(np.float32)
    dl, dctx, dtable = cp.asarray(logits), cp.asarray(ctx), cp.asarray(table)
    positions = ktopk.topk_per_row_decode(cp, dl, dctx, next_n, k, None, variant=variant)
    fused = ktopk.topk_per_row_decode(cp, dl, dctx, next_n, k, _poisoned(cp, 3 * next_n, k),
                                      variant=variant, block_table=dtable, block_size=bs)
    want = _mapped(positions.get(), table, next_n, bs)
    assert np.array_equal(np.sort(fused.get(), axis=1), np.sort(want, axis=1))
    if bad:
        assert (want == -1).sum() > (positions.get() == -1).sum()   # the masking was hit


@pytest.mark.parametrize("block_size", [64, 48])
@pytest.mark.parametrize("two_d", [False, True])
def test_decode_fused_slots_public(cp, block_size, two_d):
    """The public op with block_table: the kernel's fused path (64) and the
    two-launch path (48, not a power of two) against the reference backend."""
    rng = np.random.default_rng(block_size + two_d)
    k, next_n, width = 2048, 2, 40000
    lens = np.array([width, 3000, 2049, 7], np.int32)
    ctx = np.minimum(lens[:, None] + np.arange(next_n) - 1, width).astype(np.int32) \
        if two_d else lens
    cols = -(-width // block_size)
    table = _slot_table(rng, 4, cols, 6 * cols)
    logits = np.stack([rng.permutation(width) for _ in range(4 * next_n)]).astype(np.float32)
    want = topk_per_row_decode(logits, ctx, next_n, k, block_table=table,
                               block_size=block_size)
    out = _poisoned(cp, 4 * next_n, k)
    got = topk_per_row_decode(cp.asarray(logits), cp.asarray(ctx), next_n, k, out=out,
                              block_table=cp.asarray(table), block_size=block_size)
    assert got is out
    assert np.array_equal(np.sort(got.get(), axis=1), np.sort(want, axis=1))


def test_cluster_capacity_on_the_device(cp, ktopk):
    """The driver's count of co-resident clusters (cuOccupancyMaxActiveClusters) is read:
    portable 8-CTA clusters fit at least once, the non-portable 16 fit where the plan uses
    them (the H200: 7; four rows ran in one wave) and the default never picks a cluster the
    device cannot hold for every row."""
    from cpsparse import raw_kernels
    assert ktopk.cluster_capacity(8) >= 1
    facts = raw_kernels.device_facts()
    if ktopk.max_cluster(facts.capability, facts.sms) == 16:
        assert ktopk.cluster_capacity(16) >= 4
    for rows in (1, 2, 4, 8, 16, 64):
        c = ktopk.default_cluster(rows, 131072)
        assert c <= raw_kernels.PORTABLE_CLUSTER or rows <= ktopk.cluster_capacity(c), (rows, c)


@pytest.fixture
def checks_off():
    """Value checks off, and the top-k ops' memos empty before and after (an entry another
    test filled, with kernels off, say, would hold no launch)."""
    from cpsparse import indexer
    memos = (indexer._TOPK_CALLS, indexer._TOPK_DECODE_CALLS)
    for m in memos:
        m.clear()
    previous = cpsparse.set_device_value_checks(False)
    yield
    cpsparse.set_device_value_checks(previous)
    for m in memos:
        m.clear()


@pytest.fixture
def checked_path(count_core_calls):
    """Counts the CuPy calls that leave the memoized launch for the checked path (the
    cores)."""
    from cpsparse import indexer
    return count_core_calls(indexer, "topk_per_row_core", "topk_per_row_decode_core")


@pytest.mark.parametrize("form", ["1d", "2d", "slots", "out_none", "rows"])
def test_memoized_launch_in_production_mode(cp, checks_off, checked_path, form):
    """Value checks off, a call whose layouts the memo holds is its one prepared launch
    (raw_kernels.topk.call_launch: the cores are not entered, the first call included) and
    chooses what the set test wants on fresh values in the same arrays' layouts."""
    rng = np.random.default_rng(len(form))
    k, next_n, width, bs = 2048, 2, 40000, 64
    lens = np.array([width, 3000, 2049, 7], np.int32)
    ctx = np.minimum(lens[:, None] + np.arange(next_n) - 1, width).astype(np.int32) \
        if form == "2d" else lens
    table = _slot_table(rng, 4, -(-width // bs), 6 * (-(-width // bs)))
    for call in range(3):
        logits = rng.standard_normal((4 * next_n, width)).astype(np.float32)
        if form == "slots":
            logits = np.stack([rng.permutation(width) for _ in range(4 * next_n)]).astype(
                np.float32)
        out = None if form == "out_none" else _poisoned(cp, 4 * next_n, k)
        if form == "rows":
            starts = rng.integers(0, 100, 4 * next_n).astype(np.int32)
            ends = np.minimum(starts + rng.integers(0, width, 4 * next_n), width).astype(
                np.int32)
            got = topk_per_row(cp.asarray(logits), cp.asarray(starts), cp.asarray(ends), k,
                               out=out)
            check_rows(logits, starts, ends, k, got.get())
        elif form == "slots":
            got = topk_per_row_decode(cp.asarray(logits), cp.asarray(ctx), next_n, k, out=out,
                                      block_table=cp.asarray(table), block_size=bs)
            want = topk_per_row_decode(logits, ctx, next_n, k, block_table=table,
                                       block_size=bs)
            assert np.array_equal(np.sort(got.get(), axis=1), np.sort(want, axis=1))
        else:
            got = topk_per_row_decode(cp.asarray(logits), cp.asarray(ctx), next_n, k,
                                      out=out)
            ends = decode_row_ends(ctx, next_n)
            check_rows(logits, np.zeros_like(ends), ends, k, got.get())
        assert out is None or got is out
    assert checked_path == []


@pytest.mark.parametrize("case", ["int64_lens", "block_size_48", "kernels_off", "checks_on",
                                  "other_device"])
def test_memoized_launch_steps_aside(cp, checks_off, checked_path, prepared_elsewhere, case):
    """The memoized launch is the whole call only where it is the same work: an int64
    ``context_lens`` (copied to int32 first), a page size the kernel does not map (a second
    launch), kernels switched off after the memo was filled, value checks back on (they
    read the arrays), another current device than the launch was prepared on: these take
    the checked path, and still answer right."""
    from cpsparse import indexer
    rng = np.random.default_rng(7)
    k, width = 2048, 40000
    lens = np.array([width, 3000, 2049, 7], np.int32)
    bs = 48 if case == "block_size_48" else 64
    table = _slot_table(rng, 4, -(-width // bs), 6 * (-(-width // bs)))
    extra = dict(block_table=cp.asarray(table), block_size=bs) if case == "block_size_48" \
        else {}
    logits = np.stack([rng.permutation(width) for _ in range(4)]).astype(np.float32)
    dctx = cp.asarray(lens.astype(np.int64) if case == "int64_lens" else lens)
    topk_per_row_decode(cp.asarray(logits), dctx, 1, k, out=_poisoned(cp, 4, k), **extra)
    fills = len(checked_path)
    if case == "checks_on":
        cpsparse.set_device_value_checks(True)
    elif case == "other_device":
        prepared_elsewhere(indexer._TOPK_DECODE_CALLS)
    previous = cpsparse.set_kernels_enabled(case != "kernels_off")
    try:
        got = topk_per_row_decode(cp.asarray(logits), dctx, 1, k, out=_poisoned(cp, 4, k),
                                  **extra)
    finally:
        cpsparse.set_kernels_enabled(previous)
    assert len(checked_path) == fills + 1
    want = topk_per_row_decode(logits, lens, 1, k, **{n: (v.get() if hasattr(v, "get") else v)
                                                      for n, v in extra.items()})
    assert np.array_equal(np.sort(got.get(), axis=1), np.sort(want, axis=1))
