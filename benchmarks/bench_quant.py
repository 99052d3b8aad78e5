"""FP8 quantize and quantize + insert into the indexer key cache, vs copy bandwidth.

Run on a GPU machine from the repository root::

    PYTHONPATH=$PWD python3 -m benchmarks.bench_quant

Bytes counted: float32 keys read + e4m3 codes and float32 scales written (the
fewest bytes the op must move). Timing and the copy ceiling: :mod:`cpsparse.timing`
(CUDA events, medians with p10/p90 over rotating inputs). Writes
benchmarks/results/quant.json.
"""

import numpy

from benchmarks import harness
from cpsparse import timing


def main():
    cp = harness.cupy()
    import cpsparse
    cpsparse.set_device_value_checks(False)       # no host reads while timing
    cpsparse.precompile(["quant"])
    info = harness.device_info()
    copy_tbs = timing.copy_bandwidth_tbs()
    rows = []
    n, d = 1 << 20, 128
    sets = [cp.random.standard_normal((n, d), dtype=cp.float32) for _ in range(3)]
    nbytes = n * d * 4 + n * d + n * 4

    def add(name, fn, inputs):
        t = timing.time_cuda(fn, inputs, warmup=3, iters=30)
        tbs = nbytes / (t["median_ms"] * 1e-3) / 1e12
        rows.append({"op": name, "keys": n, "median_us": t["median_ms"] * 1e3,
                     "p10_us": t["p10_ms"] * 1e3, "p90_us": t["p90_ms"] * 1e3,
                     "tb_s": tbs, "pct_of_copy": 100 * tbs / copy_tbs})
        print(f"{name}: {t['median_ms'] * 1e3:.1f} us, {tbs:.3f} TB/s "
              f"({100 * tbs / copy_tbs:.0f}% of copy)", flush=True)

    add("quantize_fp8 [1M, 128] ue8m0",
        lambda x: cpsparse.quantize_fp8(x, block_size=d), [(x,) for x in sets])
    cache = cpsparse.IndexerKCache(n // 64, 64, d, xp=cp)
    perm = [cp.asarray(numpy.random.default_rng(i).permutation(n).astype(numpy.int32))
            for i in range(3)]
    add("IndexerKCache.insert (quantize + scatter to pages) 1M keys",
        lambda x, s: cache.insert(x, s), list(zip(sets, perm)))
    codes, scales = cpsparse.quantize_fp8(sets[0], block_size=d)
    want = cpsparse.quantize_fp8(sets[0][:4096].get(), block_size=d)
    assert numpy.array_equal(codes[:4096].get(), want[0])
    copy_end = timing.copy_bandwidth_tbs()
    harness.write_results("quant", {"device": info, "copy_tbs": copy_tbs,
                                    "copy_tbs_end": copy_end, "rows": rows,
                                    "target": "quantize+insert >= 50% of copy bandwidth"})
    print(f"copy {copy_tbs:.3f} TB/s at the start, {copy_end:.3f} at the end")
    harness.print_table(rows, ["op", "keys", "median_us", "tb_s", "pct_of_copy"])


if __name__ == "__main__":
    main()
