"""Split-KV sweep of sparse MLA decode: kernel time by split count, per decode shape.

Run on a GPU machine from the repository root::

    PYTHONPATH=$PWD python3 -m benchmarks.bench_splits

For the ``mla_decode_*`` peer workloads (fp8_ds_mla cache, topk 2048 of a
32K context per request) it times the launcher with every split count that
leaves each split at least one 64-key tile (``splits`` forced), as CUDA-graph
replays (:func:`cpsparse.timing.time_graph`: kernel + combine, no host time), and
marks the count :func:`cpsparse.raw_kernels.attention.choose_splits` picks. The
schedule's constants (``MIN_TILES_PER_SPLIT``, ``MAX_SPLITS``) come from this
table. Results: benchmarks/results/splits.json (and $OUT/splits.json when set).
"""

from benchmarks import harness
from benchmarks.bench_peers import mla_decode_inputs
from cpsparse import timing

SHAPES = [(1, 1, 128), (8, 1, 128), (32, 1, 128), (64, 2, 64), (128, 1, 128)]
CTX, TOPK = 32768, 2048
SPLITS = (1, 2, 4, 8, 16, 24, 32, 48, 64)


def main():
    cp = harness.cupy()
    import cpsparse
    from cpsparse import raw_kernels
    from cpsparse.raw_kernels import attention as katt

    sms = raw_kernels.device_facts().sms
    scale = cpsparse.softmax_scale(128, 64)
    rows = []
    for b, sq, h in SHAPES:
        t = b * sq
        cache, sets = mla_decode_inputs(cp, cpsparse, b, sq, h, CTX, TOPK, cp.float32)
        units = t * -(-h // katt.HEADS_PER_CTA)
        chosen = katt.choose_splits(units, TOPK // 64, sms)
        recs = cache.records()
        for splits in SPLITS:
            if splits > TOPK // 64:
                continue

            def call(q, slots, splits=splits):
                return katt.sparse_mla_attention(cp, q, recs, slots, scale, 512, True,
                                                 splits=splits)
            g = timing.time_graph(call, sets, reps=4, warmup=2, iters=20)
            rows.append({"B": b, "s_q": sq, "H": h, "units": units, "splits": splits,
                         "ctas": units * splits, "chosen": splits == chosen,
                         "graph_us": g["median_ms"] * 1e3,
                         "p10_p90_us": [g["p10_ms"] * 1e3, g["p90_ms"] * 1e3]})
            print(f"B={b} s_q={sq} H={h} splits={splits:2d}: {g['median_ms'] * 1e3:7.1f} us"
                  f"{'  <- chosen' if splits == chosen else ''}", flush=True)
        del cache, sets
    payload = {"device": harness.device_info(), "command": "python3 -m benchmarks.bench_splits",
               "ctx": CTX, "topk": TOPK, "rows": rows,
               "what": "CUDA-graph replay per call of the sparse decode kernel (+ combine) "
                       "with a forced split count; fp8_ds_mla cache"}
    harness.write_results("splits", payload)
    return payload


if __name__ == "__main__":
    main()
