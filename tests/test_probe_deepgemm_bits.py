"""benchmarks.probe_deepgemm_bits without a GPU: its host emulation of DeepGEMM's
logits epilogue (the column groups each lane sums, fused or not, the key scale, the lane
sum) and the counts it reports."""

import numpy as np

from benchmarks import probe_deepgemm_bits as probe


def _exact_products(rng, keys=64, heads=64):
    ml_dtypes = __import__("ml_dtypes")
    k = probe.E4M3_EXACT[rng.integers(0, 4, (keys, 128))]
    q = probe.E4M3_EXACT[rng.integers(0, 4, (heads, 128))]
    kf = k.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    qf = q.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return k, q, (kf @ qf.T)


def test_exact_codes_give_products_exact_in_float32():
    _, _, s = _exact_products(np.random.default_rng(0))
    assert np.all(s == s.astype(np.float32))
    assert np.all(s * 4 == np.round(s * 4)) and np.abs(s).max() < 2 ** 9


def test_one_hot_weights_pick_one_head_relu_times_the_scale():
    rng = np.random.default_rng(1)
    _, _, s = _exact_products(rng)
    s32 = s.astype(np.float32)
    scale = np.ldexp(1.0, rng.integers(-10, -5, s.shape[0])).astype(np.float32)
    for h in (0, 5, 13, 63):               # heads of every lane t = (h % 8) // 2, parity h % 2
        w = np.zeros(64, np.float32)
        w[h] = 1.0
        for order in probe.ORDERS:
            got = probe._emulate(s32, w, scale, order)
            assert np.array_equal(got, np.maximum(s32[:, h], 0) * scale), (h, order)


def test_fused_and_unfused_orders_are_each_one_rounding_chain():
    rng = np.random.default_rng(2)
    _, _, s = _exact_products(rng)
    s32 = s.astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    scale = np.ones(s.shape[0], np.float32)
    fused, unfused, compiled = (probe._emulate(s32, w, scale, o) for o in probe.ORDERS)
    exact = np.maximum(s, 0) @ w.astype(np.float64)
    # all within a few float32 roundings of the exact sum, and not the same chains
    tol = 8 * np.finfo(np.float32).eps * (np.maximum(s, 0) @ np.abs(w.astype(np.float64)))
    for got in (fused, unfused, compiled):
        assert np.all(np.abs(got - exact) <= tol)
    assert (fused != unfused).mean() > 0.2 and (fused != compiled).mean() > 0.02
    # lane t = 0's column-0 chain by hand for key 0: heads 0, 8, ..., 56
    r = np.maximum(s32[0], 0)
    acc = np.float32(r[0] * w[0])
    for h in range(8, 64, 8):
        acc = np.float32(np.float64(r[h]) * np.float64(w[h]) + np.float64(acc))
    w1 = np.zeros(64, np.float32)
    w1[0::8] = w[0::8]
    assert probe._emulate(s32[:1], w1, scale[:1], "fma")[0] == acc
    # ... and in the compiled order: head 8's product rounded, head 0's fused onto it
    acc = np.float32(np.float64(r[0]) * np.float64(w[0]) + np.float64(np.float32(r[8] * w[8])))
    for h in range(16, 64, 8):
        acc = np.float32(np.float64(r[h]) * np.float64(w[h]) + np.float64(acc))
    assert probe._emulate(s32[:1], w1, scale[:1], "compiled")[0] == acc


def test_exact_split_counts_which_side_matches_which_chain():
    rng = np.random.default_rng(3)
    k, q, s = _exact_products(rng, keys=64, heads=64)
    w = rng.standard_normal(64).astype(np.float32)
    scale = np.ldexp(1.0, rng.integers(-10, -5, 64)).astype(np.float32)
    fused = probe._emulate(s.astype(np.float32), w, scale, "fma")[None, :]
    unfused = probe._emulate(s.astype(np.float32), w, scale, "mul+add")[None, :]
    fin = np.ones((1, 64), bool)
    fin[0, :4] = False                      # entries not compared are not counted
    got = probe._exact_split(k, scale, fused, unfused, fin, [(q, w, 0)])
    assert got["n"] == 60 and got["ours=fma"] == 60 and got["dg=mul+add"] == 60
    assert got["ours=mul+add"] == got["dg=fma"] < 60
    assert got["ours=compiled"] < 60 and got["dg=compiled"] < 60


def test_ulp_counts_measure_float32_steps_of_the_compared_entries():
    a = np.array([1.0, 1.0, 1.0, -2.0, 5.0], np.float32)
    b = a.copy()
    b[0] = np.nextafter(a[0], np.float32(2))
    b[1] = np.nextafter(np.nextafter(a[1], np.float32(0)), np.float32(0))
    b[3] = np.float32(-2.5)
    b[4] = np.float32(7.0)
    fin = np.array([True, True, True, True, False])
    assert probe.ulp_counts(a, b, fin) == {1: 1, 2: 1, "3+": 1}


def test_exact_code_logits_are_the_compiled_chains_within_roundings_of_the_reference():
    """exact_code_logits (what the GPU tests hold the kernels to) is the compiled order
    row by row, close to the float64 reference, and refuses codes whose products' sum
    would depend on the MMA's order."""
    import pytest

    from cpsparse.reference import indexer as ref
    rng = np.random.default_rng(4)
    rows, n = 5, 96
    q = probe.E4M3_EXACT[rng.integers(0, 4, (rows, 64, 128))]
    k = probe.E4M3_EXACT[rng.integers(0, 4, (n, 128))]
    w = rng.standard_normal((rows, 64)).astype(np.float32)
    sk = np.ldexp(1.0, rng.integers(-10, -5, n)).astype(np.float32)
    got = probe.exact_code_logits(q, w, k, sk)
    assert got.shape == (rows, n) and got.dtype == np.float32
    for r in (0, rows - 1):
        s_r = probe._exact_products(k, q[r])
        assert np.array_equal(got[r], probe._emulate(s_r, w[r], sk, "compiled"))
        assert (got[r] != probe._emulate(s_r, w[r], sk, "fma")).any()
    expect = ref.mqa_logits(q, k, sk, w, np.zeros(rows, np.int32), np.full(rows, n, np.int32))
    assert np.allclose(got, expect, rtol=1e-5, atol=1e-6 * np.abs(expect).max())
    bad = k.copy()
    bad[3, 7] = 0x40                        # 2.0: exact too, but not one of the four codes
    with pytest.raises(ValueError, match="k_codes"):
        probe.exact_code_logits(q, w, bad, sk)
