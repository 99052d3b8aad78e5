"""Per-row top-k: ``topk_per_row`` and ``topk_per_row_decode`` (DESIGN section 6).

Two oracles, both plain NumPy:

* the contract (DESIGN): positions relative to row_start; a row no longer than
  k gives 0..len-1 then -1; a longer row gives k distinct in-window positions
  holding its k largest values (set test: min selected >= max unselected);
* the documented order (docstring): largest first, ties to the lower
  position, NaN below every number (-inf included), i.e. a stable argsort of
  ``-values``.
"""

import numpy as np
import pytest

from cpsparse.indexer import topk_per_row, topk_per_row_decode

KS = [1, 4, 64, 512]


# ---------------------------------------------------------------- oracles ----

def expected_row(window, k):
    """Documented order for one row's window values (float32 [n])."""
    n = window.shape[0]
    if n <= k:
        return np.concatenate([np.arange(n), np.full(k - n, -1)]).astype(np.int32)
    # numpy sorts NaN last; -(-inf) = +inf sorts just before NaN; stable = lower position.
    return np.argsort(-window.astype(np.float64), kind="stable")[:k].astype(np.int32)


def check_row_contract(window, got, k):
    """DESIGN section 6 for one row, order-free."""
    n = window.shape[0]
    assert got.shape == (k,)
    if n <= k:
        np.testing.assert_array_equal(got[:n], np.arange(n))
        np.testing.assert_array_equal(got[n:], -1)
        return
    assert (got >= 0).all() and (got < n).all(), got
    assert np.unique(got).size == k, "duplicate positions"
    chosen_mask = np.zeros(n, bool)
    chosen_mask[got] = True
    chosen, rest = window[chosen_mask], window[~chosen_mask]
    rest_num = rest[~np.isnan(rest)]
    chosen_num = chosen[~np.isnan(chosen)]
    if np.isnan(chosen).any():
        # NaN is chosen only when nothing else is left.
        assert rest_num.size == 0, "NaN selected while a number was left out"
    if rest_num.size:
        assert chosen_num.min() >= rest_num.max(), (chosen_num.min(), rest_num.max())


# ---------------------------------------------------------- row generators ---

def low_bits(rng, n):
    base = np.float32(1.0).view(np.uint32)
    v = (base + np.arange(n, dtype=np.uint32)).view(np.float32)
    return rng.permutation(v)


def gen_row(kind, rng, n, k):
    if kind == "normal":
        v = rng.standard_normal(n)
    elif kind == "all_equal":
        v = np.full(n, 0.75)
    elif kind == "threshold_ties":
        v = rng.uniform(-2, -1, n)
        top = rng.choice(n, size=min(k // 2, n), replace=False)
        v[top] = rng.uniform(5, 6, top.size)
        rest = np.setdiff1d(np.arange(n), top)
        v[rng.choice(rest, size=min(rest.size, k + 3), replace=False)] = 1.0
    elif kind == "duplicates":
        v = rng.integers(0, 3, n).astype(np.float64)
    elif kind == "neg_inf_tail_few":
        v = np.full(n, -np.inf)
        m = min(k // 2, n)
        v[:m] = rng.standard_normal(m)
    elif kind == "neg_inf_tail_many":
        v = np.full(n, -np.inf)
        m = min(k + 2, n)
        v[:m] = rng.standard_normal(m)
    elif kind == "nan_some":
        v = rng.standard_normal(n)
        v[rng.random(n) < 0.3] = np.nan
    elif kind == "nan_most":
        v = np.full(n, np.nan)
        m = min(max(1, k // 3), n // 2)
        v[rng.choice(n, m, replace=False)] = rng.standard_normal(m)
        free = np.flatnonzero(np.isnan(v))
        v[rng.choice(free, m, replace=False)] = -np.inf
    elif kind == "nan_all":
        v = np.full(n, np.nan)
    elif kind == "nan_and_neg_inf":
        v = np.where(rng.random(n) < 0.5, np.nan, -np.inf)
    elif kind == "huge":
        v = rng.standard_normal(n)
        v[rng.integers(n)] = np.finfo(np.float32).max
    elif kind == "pos_inf":
        v = rng.standard_normal(n)
        v[rng.integers(n)] = np.inf
    elif kind == "ascending":
        v = np.arange(n, dtype=np.float64)
    elif kind == "descending":
        v = -np.arange(n, dtype=np.float64)
    elif kind == "low_bits":
        return low_bits(rng, n)
    elif kind == "signed_zeros":
        v = np.where(rng.random(n) < 0.5, 0.0, -0.0)
        v[rng.random(n) < 0.3] = -1.0
    elif kind == "subnormal":
        tiny = np.finfo(np.float32).smallest_subnormal
        v = rng.integers(-5, 6, n) * float(tiny)
    elif kind == "negative":
        v = -np.exp(rng.standard_normal(n)) - 1e3
    else:
        raise AssertionError(kind)
    return np.asarray(v, np.float32)


KINDS = ["normal", "all_equal", "threshold_ties", "duplicates", "neg_inf_tail_few",
         "neg_inf_tail_many", "nan_some", "nan_most", "nan_all", "nan_and_neg_inf", "huge",
         "pos_inf", "ascending", "descending", "low_bits", "signed_zeros", "subnormal",
         "negative"]


def poison(rng, n):
    """Out-of-window filler that a correct top-k never picks: +inf, float max, NaN."""
    choices = np.array([np.inf, np.finfo(np.float32).max, np.nan, 1e30], np.float32)
    return choices[rng.integers(0, 4, n)]


def build_case(k, seed):
    """logits [M, N], row_starts, row_ends covering every kind and edge length."""
    rng = np.random.default_rng(seed)
    width = 2 * k + 40
    rows = []
    lengths_long = [k + 1, 2 * k + 5, width]
    for kind in KINDS:
        for n in lengths_long:
            rows.append((kind, n))
    for kind in ("normal", "nan_all", "neg_inf_tail_few", "pos_inf"):
        for n in sorted({0, 1, max(k - 1, 0), k}):
            rows.append((kind, n))
    logits = np.empty((len(rows), width), np.float32)
    starts, ends = [], []
    for r, (kind, n) in enumerate(rows):
        s = int(rng.integers(0, width - n + 1))
        logits[r] = poison(rng, width)
        if n:
            logits[r, s:s + n] = gen_row(kind, rng, n, k)
        starts.append(s)
        ends.append(s + n)
    return logits, np.array(starts, np.int32), np.array(ends, np.int32), rows


# ------------------------------------------------------------ topk_per_row ---

@pytest.mark.parametrize("k", KS)
def test_topk_per_row_contract(k):
    logits, starts, ends, rows = build_case(k, seed=k)
    got = topk_per_row(logits, starts, ends, k)
    assert isinstance(got, np.ndarray) and got.dtype == np.int32 and got.shape == (len(rows), k)
    for r, (kind, n) in enumerate(rows):
        window = logits[r, starts[r]:ends[r]]
        try:
            check_row_contract(window, got[r], k)
        except AssertionError as e:
            raise AssertionError(f"row {r} kind={kind} len={n}: {e}") from e


@pytest.mark.parametrize("k", KS)
def test_topk_per_row_documented_order(k):
    logits, starts, ends, rows = build_case(k, seed=1000 + k)
    got = topk_per_row(logits, starts, ends, k)
    for r, (kind, n) in enumerate(rows):
        want = expected_row(logits[r, starts[r]:ends[r]], k)
        np.testing.assert_array_equal(got[r], want, err_msg=f"row {r} kind={kind} len={n}")


def test_nan_rule_small_examples():
    nan, inf = np.nan, np.inf
    logits = np.array([
        [nan, 1.0, nan, -inf, 2.0, nan],     # numbers, then -inf, then NaN
        [nan, nan, nan, nan, nan, nan],      # all NaN: still k valid positions
        [nan, -inf, nan, -inf, nan, -inf],   # -inf ranks above NaN
        [0.0, nan, 3.0, nan, nan, 3.0],      # ties to the lower position
    ], np.float32)
    z = np.zeros(4, np.int32)
    e = np.full(4, 6, np.int32)
    got = topk_per_row(logits, z, e, 4)
    np.testing.assert_array_equal(got, [[4, 1, 3, 0],
                                        [0, 1, 2, 3],
                                        [1, 3, 5, 0],
                                        [2, 5, 0, 1]])


def test_windows_are_relative_and_outside_never_read():
    """Huge values just outside the window are ignored; indices are start-relative."""
    inf = np.inf
    logits = np.array([[inf, 1.0, 5.0, 3.0, 2.0, inf],
                       [9.0, 9.0, 9.0, 0.0, 1.0, 2.0],
                       [7.0, 7.0, np.nan, 7.0, 7.0, 7.0]], np.float32)
    got = topk_per_row(logits, np.array([1, 3, 2], np.int32),
                       np.array([5, 6, 2], np.int32), 2)
    np.testing.assert_array_equal(got, [[1, 2], [2, 1], [-1, -1]])


def test_short_rows_do_not_read_values():
    """len <= k: 0..len-1 ascending then -1, whatever the values (NaN, -inf, +inf)."""
    k = 8
    logits = np.full((4, 20), np.nan, np.float32)
    logits[1, 3:11] = -np.inf
    logits[2, 5:9] = np.array([np.inf, -1, 5, np.nan], np.float32)
    starts = np.array([0, 3, 5, 20], np.int32)
    ends = np.array([7, 11, 9, 20], np.int32)
    got = topk_per_row(logits, starts, ends, k)
    want = np.full((4, k), -1, np.int32)
    want[0, :7] = np.arange(7)
    want[1, :8] = np.arange(8)
    want[2, :4] = np.arange(4)
    np.testing.assert_array_equal(got, want)


def test_exactly_k_and_k_plus_one():
    k = 4
    vals = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.float32)
    logits = np.tile(vals, (2, 1))
    got = topk_per_row(logits, np.array([0, 0], np.int32), np.array([4, 5], np.int32), k)
    np.testing.assert_array_equal(got[0], [0, 1, 2, 3])          # len == k: shortcut
    np.testing.assert_array_equal(got[1], [4, 2, 0, 1])          # len == k+1: drop one "1"


def test_k_larger_than_width_and_no_rows():
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((3, 10)).astype(np.float32)
    got = topk_per_row(logits, np.zeros(3, np.int32), np.array([10, 3, 0], np.int32), 512)
    assert got.shape == (3, 512)
    np.testing.assert_array_equal(got[0, :10], np.arange(10))
    assert (got[0, 10:] == -1).all() and (got[1, 3:] == -1).all() and (got[2] == -1).all()
    empty = topk_per_row(np.zeros((0, 10), np.float32), np.zeros(0, np.int32),
                         np.zeros(0, np.int32), 4)
    assert empty.shape == (0, 4) and empty.dtype == np.int32


@pytest.mark.parametrize("k", [4, 64])
def test_topk_per_row_out_is_row_slice_of_buffer(k):
    logits, starts, ends, rows = build_case(k, seed=7 + k)
    m = len(rows)
    buf = np.full((m + 7, k), 12345, np.int32)
    view = buf[3:3 + m]
    assert view.flags.c_contiguous
    res = topk_per_row(logits, starts, ends, k, out=view)
    assert res is view
    np.testing.assert_array_equal(buf[:3], 12345)
    np.testing.assert_array_equal(buf[3 + m:], 12345)
    fresh = topk_per_row(logits, starts, ends, k)
    np.testing.assert_array_equal(buf[3:3 + m], fresh)
    # Every row was written (short rows included).
    assert not (buf[3:3 + m] == 12345).any()


# ----------------------------------------------------- topk_per_row_decode ---

def decode_ends(context_lens, next_n):
    ends = []
    for b in range(context_lens.shape[0]):
        for j in range(next_n):
            if context_lens.ndim == 1:
                ends.append(max(0, int(context_lens[b]) - (next_n - 1 - j)))
            else:
                ends.append(int(context_lens[b, j]))
    return ends


def decode_case(rng, k, next_n, two_d):
    width = 2 * k + 20
    kinds = ["normal", "threshold_ties", "nan_some", "neg_inf_tail_few", "low_bits",
             "duplicates"]
    lens = [0, 1, next_n, k, k + 1, k + next_n, 2 * k, width, width - 1]
    lens = [L for L in lens if L >= 0]
    batch = len(lens)
    logits = poison(rng, batch * next_n * width).reshape(batch * next_n, width)
    if two_d:
        ctx = np.stack([rng.integers(0, L + 1, next_n) if L else np.zeros(next_n, int)
                        for L in lens]).astype(np.int32)
        ctx[:, -1] = lens
        ctx[3, 0] = k
        ctx[4, 0] = k + 1
    else:
        ctx = np.array(lens, np.int32)
    ends = decode_ends(ctx, next_n)
    for row, e in enumerate(ends):
        if e:
            logits[row, :e] = gen_row(kinds[row % len(kinds)], rng, e, k)
    return logits, ctx, ends


@pytest.mark.parametrize("k", [1, 4, 64])
@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("two_d", [False, True], ids=["lens_1d", "lens_2d"])
def test_topk_per_row_decode(k, next_n, two_d):
    rng = np.random.default_rng(k * 100 + next_n * 10 + two_d)
    logits, ctx, ends = decode_case(rng, k, next_n, two_d)
    got = topk_per_row_decode(logits, ctx, next_n, k)
    assert got.dtype == np.int32 and got.shape == (logits.shape[0], k)
    for row, e in enumerate(ends):
        window = logits[row, :e]
        check_row_contract(window, got[row], k)
        np.testing.assert_array_equal(got[row], expected_row(window, k), err_msg=f"row {row}")


def test_topk_per_row_decode_1d_window_arithmetic():
    """next_n=2, L=4: row 0 sees [0, 3), row 1 sees [0, 4)."""
    logits = np.array([[5, 1, 4, 9, 8], [5, 1, 4, 9, 8]], np.float32)
    got = topk_per_row_decode(logits, np.array([4], np.int32), next_n=2, k=2)
    np.testing.assert_array_equal(got, [[0, 2], [3, 0]])
    got = topk_per_row_decode(logits, np.array([[3, 5]], np.int32), next_n=2, k=2)
    np.testing.assert_array_equal(got, [[0, 2], [3, 4]])


@pytest.mark.parametrize("next_n", [1, 4])
def test_topk_per_row_decode_out_view(next_n):
    rng = np.random.default_rng(500 + next_n)
    k = 4
    logits, ctx, ends = decode_case(rng, k, next_n, False)
    rows = logits.shape[0]
    buf = np.full((rows + 5, k), -777, np.int32)
    view = buf[5:]
    res = topk_per_row_decode(logits, ctx, next_n, k, out=view)
    assert res is view
    np.testing.assert_array_equal(buf[:5], -777)
    np.testing.assert_array_equal(view, topk_per_row_decode(logits, ctx, next_n, k))
    assert not (view == -777).any()


def test_decode_equals_topk_per_row_with_zero_starts():
    rng = np.random.default_rng(77)
    k, next_n = 64, 2
    logits, ctx, ends = decode_case(rng, k, next_n, False)
    a = topk_per_row_decode(logits, ctx, next_n, k)
    b = topk_per_row(logits, np.zeros(len(ends), np.int32), np.array(ends, np.int32), k)
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_topk_per_row_k2048_long_rows():
    rng = np.random.default_rng(2048)
    k = 2048
    width = 3 * k
    logits = rng.standard_normal((6, width)).astype(np.float32)
    logits[1] = logits[1].round(1)                        # heavy ties
    logits[2, ::3] = np.nan
    logits[3, k:] = -np.inf
    logits[4] = low_bits(rng, width)
    starts = np.array([0, 5, 0, 0, 100, 0], np.int32)
    ends = np.array([width, width, width, width, width, k], np.int32)
    got = topk_per_row(logits, starts, ends, k)
    for r in range(6):
        window = logits[r, starts[r]:ends[r]]
        check_row_contract(window, got[r], k)
        np.testing.assert_array_equal(got[r], expected_row(window, k))


@pytest.mark.parametrize("block_size", [64, 48])
@pytest.mark.parametrize("two_d", [False, True])
def test_decode_block_table_gives_slots(block_size, two_d):
    """topk_per_row_decode(block_table=...) == local_to_global_slots of its positions,
    out= included; a table too narrow for a row's window is refused."""
    from cpsparse import local_to_global_slots, topk_per_row_decode
    rng = np.random.default_rng(block_size + two_d)
    k, next_n, width = 16, 2, 300
    lens = np.array([300, 40, 17, 3], np.int32)
    ctx = np.minimum(lens[:, None] + np.arange(next_n) - 1, width).astype(np.int32) \
        if two_d else lens
    cols = -(-width // block_size)
    table = rng.permutation(10 * cols)[:4 * cols].reshape(4, cols).astype(np.int32)
    logits = rng.standard_normal((4 * next_n, width)).astype(np.float32)
    positions = topk_per_row_decode(logits, ctx, next_n, k)
    want = local_to_global_slots(positions, np.arange(4 * next_n, dtype=np.int32) // next_n,
                                 table, block_size)
    got = topk_per_row_decode(logits, ctx, next_n, k, block_table=table,
                              block_size=block_size)
    np.testing.assert_array_equal(got, want)
    out = np.full((4 * next_n, k), 7, np.int32)
    assert topk_per_row_decode(logits, ctx, next_n, k, out, block_table=table,
                               block_size=block_size) is out
    np.testing.assert_array_equal(out, want)
    with pytest.raises(ValueError, match="Invalid shape of block_table"):
        topk_per_row_decode(logits, ctx, next_n, k, block_table=table[:, :1].copy(),
                            block_size=block_size)
    with pytest.raises(ValueError, match=r"Invalid shape of block_table: expected \[B, "):
        topk_per_row_decode(logits, ctx, next_n, k, block_table=table[:2],
                            block_size=block_size)


@pytest.mark.parametrize("width, ok", [(2**31 - 8, True), (2**31 - 7, False), (2**31, False)])
def test_kernel_launcher_refuses_rows_its_int32_unit_count_cannot_hold(width, ok, monkeypatch):
    """A row of 2**31 - 7 values, three of them before a 16-byte boundary, has more 16-byte
    units than int32 counts: refused before anything launches (CPU: a shape-only stand-in;
    a row within the limit gets as far as the launch plan, which needs a GPU)."""
    from cpsparse.raw_kernels import topk as ktopk

    class Shape:
        shape = (1, width)

    class Planned(Exception):
        pass

    def plan(*args):
        raise Planned

    monkeypatch.setattr(ktopk, "_plan", plan)
    monkeypatch.setattr(ktopk.raw_kernels, "current_device", lambda: 0)
    monkeypatch.setattr(ktopk, "_LAUNCHES", {})
    with pytest.raises(Planned if ok else ValueError, match=None if ok else "at most"):
        ktopk._launch(None, Shape(), None, None, None, 1, ktopk.MODE_ROWS, 2048, None, None)


@pytest.mark.parametrize("rows, width, largest, want", [
    (1, 131072, 16, 16), (4, 131072, 16, 16), (5, 131072, 16, 8), (8, 131072, 16, 8),
    (9, 131072, 16, 8),
    (4, 131072, 8, 8), (4, 65536, 16, 16), (4, 32768, 16, 8), (64, 131072, 16, 2),
    (64, 32768, 16, 2), (256, 32768, 16, 1), (1, 16384, 16, 1)])
def test_cluster_choice(rows, width, largest, want):
    """CTAs a row: doubled while the grid stays one wave and each slice keeps MIN_SLICE
    values, never past the device's largest cluster (16 only where non-portable sizes
    run, and only while the grid takes at most half the SMs)."""
    from cpsparse.raw_kernels import topk as ktopk
    assert ktopk.choose_cluster(rows, width, 132, largest) == want
    assert ktopk.max_cluster((9, 0), 132) == 16
    assert ktopk.max_cluster((9, 0), 78) == 8                     # H20: GPCs too small
    assert ktopk.max_cluster((10, 0), 148) == ktopk.max_cluster((12, 0), 170) == 8
    assert all(ktopk.DEFAULT_VARIANT[c] in ktopk.VARIANTS for c in ktopk.CLUSTERS)


def test_launch_config_has_cuda_h_layout():
    """cuOccupancyMaxActiveClusters reads cuda.h's CUlaunchConfig: seven unsigned ints,
    the stream at 32, the attribute pointer at 40, their count at 48 (56 bytes)."""
    import ctypes
    from cpsparse import raw_kernels
    c = raw_kernels._LaunchConfig
    assert ctypes.sizeof(c) == 56
    assert (c.sharedMemBytes.offset, c.hStream.offset, c.attrs.offset,
            c.numAttrs.offset) == (24, 32, 40, 48)


def test_no_non_portable_cluster_where_the_device_runs_none(monkeypatch):
    """A Hopper part that runs no 16-CTA cluster (GPCs of fewer than 16 SMs; or a driver
    that does not say) gets 8-CTA clusters by default, never a launch that cannot run."""
    from cpsparse import raw_kernels
    from cpsparse.raw_kernels import topk as ktopk
    facts = raw_kernels.DeviceFacts(0, (9, 0), 132, 233472, 232448)
    monkeypatch.setattr(raw_kernels, "device_facts", lambda: facts)
    for capacity, want in [(0, 8), (3, 8), (4, 16), (7, 16)]:
        monkeypatch.setattr(ktopk, "cluster_capacity", lambda c, n=capacity: n)
        assert ktopk.default_cluster(4, 131072) == want
