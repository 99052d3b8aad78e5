"""Which finish the GPU top-k tests reach (CPU only): a host model of the kernel's path.

``topk.cu`` ranks a row's threshold-bin candidates by a warp scan over the list (at most
TK_RANK_SCAN_MAX = 32 of them) or by buckets (``tk_bucket_rank``, more), reached from the
coarse histogram (R0) or after the fallback's radix rounds. The GPU tests check the
selections; this checks that ``tests/test_gpu_topk.py``'s adversarial rows reach each way
in, so that a change to those rows cannot drop one unnoticed. The model follows
``tk_adapt`` (the transform from the first 4 * THREADS values), ``tk_coarse`` and the
rounds' digits; it counts over the whole row (a cluster's CTAs count alike), and it reads
the statistics from the row's start, where the kernel reads whole 16-byte units: close
enough to tell which finish a row reaches.
"""

import zlib

import numpy as np
import pytest

from cpsparse.reference.indexer import order_keys
from tests.test_gpu_topk import KINDS, VARIANTS, _row_n, adversarial

BINS, RANK_MAX, SCAN_MAX = 2048, 512, 32


def transform(x, threads):
    """tk_adapt: (scale, bias) from the medians of the warps' means and max - mean."""
    means, spreads = [], []
    for w in x[:4 * threads].reshape(-1, 128) if x.size >= 128 else []:
        f = w[np.isfinite(w)]
        if f.size:
            m = np.float32(f.sum(dtype=np.float32) / np.float32(f.size))
            means.append(m)
            spreads.append(f.max() - m)
    if not means:
        return np.float32(1), np.float32(0)
    c = np.sort(means)[(len(means) - 1) // 2]
    d = np.sort(spreads)[(len(spreads) - 1) // 2]
    if not (d > 0 and np.isfinite(d) and np.isfinite(c)):
        return np.float32(1), np.float32(0)
    scale = np.float32(2.0 ** min(127, max(-126, 2 - int(np.frexp(np.float32(d))[1]))))
    bias = np.float32(-c * scale)
    return scale, (bias if bias != 0 and np.isfinite(bias) else np.float32(0))


def coarse(x, scale, bias):
    """tk_coarse: the top 11 bits of the fp16 order key of fma(x, scale, bias)."""
    with np.errstate(all="ignore"):
        h = (x.astype(np.float64) * scale + bias).astype(np.float32).astype(np.float16)
    h = h.view(np.uint16).astype(np.uint32)
    return np.where(np.isnan(x), 0, np.where(h & 0x8000, ~h & 0xFFFF, h | 0x8000) >> 5)


def finish(x, k, threads):
    """(where the rank finish starts: "r0" or "round"; its candidates), or None when a
    row ends without it (short, or taken whole through the tie cursor)."""
    if x.size <= k:
        return None
    scale, bias = transform(x, threads)
    cb = coarse(x, scale, bias)
    hist = np.bincount(cb, minlength=BINS)
    above = np.cumsum(hist[::-1])[::-1]
    b0 = int(np.nonzero(above >= k)[0].max())
    need, eq = k - (int(above[b0 + 1]) if b0 + 1 < BINS else 0), int(hist[b0])
    if need == eq:
        return None
    if eq <= RANK_MAX:
        return "r0", eq
    keys = order_keys(x)[cb == b0].astype(np.uint64)
    level = (int(keys.min()) ^ int(keys.max())).bit_length()
    while True:
        shift = max(0, level - 11)
        digit = ((keys >> np.uint64(shift)) & np.uint64((1 << (level - shift)) - 1)).astype(int)
        h = np.bincount(digit)
        at_or_above = np.cumsum(h[::-1])[::-1]
        t = int(np.nonzero(at_or_above >= need)[0].max())
        nn = need - (int(at_or_above[t + 1]) if t + 1 < h.size else 0)
        if shift == 0 or nn == h[t]:
            return None
        if h[t] <= RANK_MAX:
            return "round", int(h[t])
        keys, need, level = keys[digit == t], nn, shift


def reached(variant):
    """{(start, "scan" or "buckets")} over test_adversarial's rows for ``variant``."""
    threads = 256 if variant in ("r256", "c1_t256") else 512
    got = set()
    for kind in KINDS:
        for n0 in (3000, 8195, 65536):
            k = 1024 if n0 == 3000 else 2048
            n = _row_n(variant, n0)
            rng = np.random.default_rng(zlib.crc32(f"{kind}/{n}/{variant}".encode()))
            rows = [adversarial(rng, kind, n + 3, k) for _ in range(3)]
            for row, (s, length) in zip(rows, ((0, n), (1, n - 1), (3, n))):
                f = finish(row[s:s + length], k, threads)
                if f:
                    got.add((f[0], "buckets" if f[1] > SCAN_MAX else "scan"))
    return got


@pytest.mark.parametrize("variant", ["c1", "c2", "r256"])
def test_adversarial_rows_reach_every_finish(variant):
    # the variants where tk_bucket_rank runs (one or two CTAs a row)
    assert variant in VARIANTS
    got = reached(variant)
    for way in (("r0", "buckets"), ("round", "buckets"), ("r0", "scan")):
        assert way in got, (variant, way, sorted(got))


def test_the_model_counts_a_crowded_bin():
    # 300 values at the k-th largest of a normal row: the bin holds them and the rank
    # finish starts from R0 with more than 300 candidates; a normal row's holds ~130
    rng = np.random.default_rng(0)
    crowded = adversarial(rng, "crowded_bin", 65536, 2048)
    normal = adversarial(rng, "normal", 65536, 2048)
    where, m = finish(crowded, 2048, 512)
    assert where == "r0" and 300 < m <= RANK_MAX
    assert 60 < finish(normal, 2048, 512)[1] < 250
