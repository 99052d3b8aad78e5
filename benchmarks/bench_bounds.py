"""The cost of bounding every index (production safety), kernel by kernel.

Run on the GPU machine once per source tree, alternately and twice each (clocks
and memory warm up over the first run), then compare (tools/gpu_check.sh bounds)::

    (cd <tree before> && PYTHONPATH=$PWD:<repo> python3 -m benchmarks.bench_bounds --tag before)
    PYTHONPATH=$PWD python3 -m benchmarks.bench_bounds --tag after
    ... the two again ...
    PYTHONPATH=$PWD python3 -m benchmarks.bench_bounds --compare

Each op is timed with :mod:`cpsparse.timing` (CUDA events, warm-up, median and
p10/p90 over rotating inputs, value checks off) on int32 indices, the form both trees accept, as a CUDA
graph replay of 10 calls (the kernel time; the eager call time is recorded
beside it). The comparison lands in benchmarks/results/bounds.json.
"""

import argparse
import json
import os
import pathlib

import numpy

from benchmarks import harness
from benchmarks.harness import timing     # also when the tree measured predates it

STAGE_DIR = pathlib.Path(os.environ.get("OUT", "gpu_out"))


def workloads(cp, cpsparse):
    rng = numpy.random.default_rng(0)
    i32 = numpy.int32
    scale = cpsparse.softmax_scale(128, 64)

    # sparse MLA decode: B=64, H=128, topk 2048 over 32K contexts (fp8_ds_mla cache)
    b, ctx, topk = 64, 32768, 2048
    mla = cpsparse.MLAKVCache(b * ctx // 64, 64, xp=cp)
    mla.data[...] = cp.random.randint(0, 120, mla.data.shape, dtype=cp.uint8)
    mla.records()[:, 512:528].view(cp.float32)[...] = 0.01
    q = [cp.random.standard_normal((b, 128, 576), dtype=cp.float32) for _ in range(3)]
    idx = [cp.asarray(rng.integers(0, mla.num_slots, (b, topk)).astype(i32)) for _ in range(3)]
    yield ("sparse_mla_attention fp8 B64 H128 topk2048",
           lambda q, i: cpsparse.sparse_mla_attention(q, mla, i, scale), list(zip(q, idx)))

    # sparse MLA prefill rows: bf16-exact float32 workspace of 8192 rows, T=512
    kv = cp.random.standard_normal((8192, 576), dtype=cp.float32)
    qp = [cp.random.standard_normal((512, 128, 576), dtype=cp.float32) for _ in range(2)]
    ip = [cp.asarray(rng.integers(0, 8192, (512, topk)).astype(i32)) for _ in range(2)]
    yield ("sparse_mla_attention workspace T512 H128 topk2048",
           lambda q, i: cpsparse.sparse_mla_attention(q, kv, i, scale), list(zip(qp, ip)))

    # paged indexer decode: B=64 x 32K, H=64, next_n=1
    cache = cpsparse.IndexerKCache(b * ctx // 64, 64, 128, xp=cp)
    cache.data[...] = cp.random.randint(0, 120, cache.data.shape, dtype=cp.uint8)
    cache.scales_view()[...] = 0.01
    qd = [cp.random.randint(0, 120, (b, 1, 64, 128), dtype=cp.uint8) for _ in range(3)]
    w = cp.random.standard_normal((b, 64), dtype=cp.float32)
    lens = cp.full(b, ctx, dtype=cp.int32)
    tables = [cp.asarray(numpy.stack([rng.permutation(b * ctx // 64)[:ctx // 64]
                                      for _ in range(b)]).astype(i32)) for _ in range(3)]
    yield ("paged_mqa_logits B64 x 32K H64",
           lambda q, t: cpsparse.paged_mqa_logits(q, cache, w, lens, t, ctx),
           list(zip(qd, tables)))

    # prefill indexer logits T=S=4096 causal
    n = 4096
    qf = [cp.random.randint(0, 120, (n, 64, 128), dtype=cp.uint8) for _ in range(2)]
    kf = cp.random.randint(0, 120, (n, 128), dtype=cp.uint8)
    ksc = cp.full(n, 0.01, dtype=cp.float32)
    wf = cp.random.standard_normal((n, 64), dtype=cp.float32)
    ks = cp.zeros(n, dtype=cp.int32)
    ke = cp.arange(1, n + 1, dtype=cp.int32)
    yield ("mqa_logits T=S=4096 causal",
           lambda q: cpsparse.mqa_logits(q, kf, ksc, wf, ks, ke), [(x,) for x in qf])

    # key insert (quantize + scatter), 256K keys; gather of 64K keys
    nk = 1 << 18
    keys = [cp.random.standard_normal((nk, 128), dtype=cp.float32) for _ in range(2)]
    slots = [cp.asarray(rng.permutation(cache.num_slots)[:nk].astype(i32)) for _ in range(2)]
    yield ("IndexerKCache.insert 256K keys", lambda k, s: cache.insert(k, s),
           list(zip(keys, slots)))
    gt = cp.asarray(numpy.stack([rng.permutation(cache.num_blocks)[:256] for _ in range(4)])
                    .astype(i32))
    cu = cp.asarray(numpy.arange(0, 5 * 16384, 16384).astype(i32))
    yield ("IndexerKCache.gather 64K keys", lambda t, c: cache.gather(t, c), [(gt, cu)])

    # request-local positions -> slots, decode batch and prefill batch
    for rows in (64, 8192):
        pos = [cp.asarray(rng.integers(-1, ctx, (rows, topk)).astype(i32)) for _ in range(2)]
        req = cp.asarray((numpy.arange(rows) % b).astype(i32))
        yield (f"local_to_global_slots [{rows}, 2048]",
               lambda p, r, t: cpsparse.local_to_global_slots(p, r, t, 64),
               [(p, req, tables[0]) for p in pos])


def measure(tag):
    cp = harness.cupy()
    import cpsparse
    cpsparse.set_device_value_checks(False)
    cpsparse.precompile()
    rows = []
    for name, fn, inputs in workloads(cp, cpsparse):
        eager = timing.time_cuda(fn, inputs, warmup=10, iters=60)
        try:
            # Kernel time: graph replay keeps the Python call out (the bound's cost is
            # device work; host time is the architecture issue's, and noisier).
            t = timing.time_graph(fn, inputs, reps=10, iters=40)
            how = "graph"
        except Exception as exc:  # noqa: BLE001 - ops that read the host (gather)
            print(f"[{tag}] {name}: not capturable ({type(exc).__name__}), eager time")
            t, how = eager, "eager"
        rows.append({"op": name, "timing": how, "eager_median_ms": eager["median_ms"], **t})
        print(f"[{tag}] {name}: {t['median_ms'] * 1e3:.1f} us {how} "
              f"(p10 {t['p10_ms'] * 1e3:.1f}, p90 {t['p90_ms'] * 1e3:.1f}); "
              f"eager call {eager['median_ms'] * 1e3:.1f} us", flush=True)
    STAGE_DIR.mkdir(parents=True, exist_ok=True)
    path = STAGE_DIR / f"bounds_{tag}.json"
    # Runs of one tag accumulate: the trees are measured alternately (before, after,
    # before, after) so that clock and memory warm-up do not favour the second one.
    runs = json.loads(path.read_text())["runs"] if path.exists() else []
    runs.append(rows)
    path.write_text(json.dumps({"tag": tag, "cpsparse": cpsparse.__file__,
                                "device": harness.device_info(), "runs": runs}, indent=1))


def compare():
    before = json.loads((STAGE_DIR / "bounds_before.json").read_text())
    after = json.loads((STAGE_DIR / "bounds_after.json").read_text())

    def best(runs, i):                   # the run with the lowest median, per op
        return min((r[i] for r in runs), key=lambda row: row["median_ms"])

    rows = []
    for i, op in enumerate(r["op"] for r in after["runs"][0]):
        b, a = best(before["runs"], i), best(after["runs"], i)
        rows.append({"op": op, "timing": a["timing"], "before_us": b["median_ms"] * 1e3,
                     "before_p10_p90_us": [b["p10_ms"] * 1e3, b["p90_ms"] * 1e3],
                     "after_us": a["median_ms"] * 1e3,
                     "after_p10_p90_us": [a["p10_ms"] * 1e3, a["p90_ms"] * 1e3],
                     "ratio": a["median_ms"] / b["median_ms"],
                     "runs_before_us": [r[i]["median_ms"] * 1e3 for r in before["runs"]],
                     "runs_after_us": [r[i]["median_ms"] * 1e3 for r in after["runs"]]})
    harness.write_results("bounds", {"device": after["device"], "rows": rows,
                                     "what": "per-call time (graph replay of 10 calls: "
                                             "kernel time; eager where the op reads the "
                                             "host), value checks off, before and after "
                                             "bounding every index; each tree measured "
                                             "twice, alternately, the lower median kept"})
    harness.print_table(rows, ["op", "timing", "before_us", "after_us", "ratio"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", default="after")
    parser.add_argument("--compare", action="store_true")
    args = parser.parse_args()
    compare() if args.compare else measure(args.tag)


if __name__ == "__main__":
    main()
