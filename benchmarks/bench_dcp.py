"""What decode context parallelism's merges cost, against the single-GPU step (issue 22).

Run on a GPU machine from the repository root::

    PYTHONPATH=$PWD python3 -m benchmarks.bench_dcp

For B decode requests of a 32K context, top-k 2048, 128 MLA heads, it times on one GPU
(CUDA-graph replays where the op can be captured, else CUDA events; fresh random
inputs, medians with p10-p90, :mod:`cpsparse.timing`):

- the single-GPU step's top-k and attention: ``topk_per_row`` over the whole row and
  ``sparse_mla_attention`` over the fp8 cache (the work DCP splits);
- the merges a rank adds for ``world`` ranks, with the other ranks' candidates and
  partials already gathered (what NCCL would deliver): ``merge_topk`` over
  ``world x k`` candidates a row and ``merge_attention`` of ``world`` partial rows;
- on a machine with several GPUs, the NCCL all-gathers of those candidates and
  partials are the rest of the cost: timed by the test of real ranks
  (tests/test_gpu_parallel.py), not here.

Results: benchmarks/results/dcp.json (and $OUT/dcp.json when set).
"""

from benchmarks import harness
from cpsparse import timing

CTX, TOPK, HEADS, D_V = 32768, 2048, 128, 512
BATCHES = (1, 8, 64)
WORLDS = (2, 4, 8)


def main():
    cp = harness.cupy()
    import cpsparse
    from benchmarks.bench_peers import mla_decode_inputs
    from cpsparse.reference import context_parallel as dcp

    cpsparse.set_device_value_checks(False)
    scale = cpsparse.softmax_scale(128, 64)
    rows = []
    for b in BATCHES:
        cache, sets = mla_decode_inputs(cp, cpsparse, b, 1, HEADS, CTX)
        logits = [cp.random.standard_normal((b, CTX), dtype=cp.float32) for _ in range(2)]
        starts = cp.zeros(b, dtype=cp.int32)
        ends = cp.full(b, CTX, dtype=cp.int32)
        topk = timing.try_time_graph(
            cp, lambda x: cpsparse.topk_per_row(x, starts, ends, TOPK), [(x,) for x in logits])
        attn = timing.try_time_graph(
            cp, lambda q, s: cpsparse.sparse_mla_attention(q, cache, s, scale), sets)
        row = {"B": b, "topk_us": topk["median_ms"] * 1e3,
               "attention_us": attn["median_ms"] * 1e3, "merges": []}
        for world in WORLDS:
            vals = [cp.random.standard_normal((world, b, TOPK), dtype=cp.float32)
                    for _ in range(2)]
            pos = [cp.stack([dcp.dcp_to_global(
                cp.argsort(cp.random.random((b, CTX // world)), axis=1)[:, :TOPK], r, world)
                for r in range(world)]) for _ in range(2)]
            lens = cp.full(b, CTX, dtype=cp.int64)
            outs = [cp.random.standard_normal((world, b, HEADS, D_V), dtype=cp.float32)
                    for _ in range(2)]
            lses = [cp.random.standard_normal((world, b, HEADS), dtype=cp.float32)
                    for _ in range(2)]
            mt = timing.time_cuda(lambda v, p: dcp.merge_topk(v, p, lens, TOPK),
                                  list(zip(vals, pos)), warmup=3, iters=20)
            ma = timing.time_cuda(dcp.merge_attention, list(zip(outs, lses)), warmup=3,
                                  iters=20)
            row["merges"].append({
                "world": world, "merge_topk_us": mt["median_ms"] * 1e3,
                "merge_topk_p10_p90_us": [mt["p10_ms"] * 1e3, mt["p90_ms"] * 1e3],
                "merge_attention_us": ma["median_ms"] * 1e3,
                "merge_attention_p10_p90_us": [ma["p10_ms"] * 1e3, ma["p90_ms"] * 1e3]})
            print(f"B={b:3d} world={world}: step top-k {row['topk_us']:.1f} us, attention "
                  f"{row['attention_us']:.1f} us; merge_topk {mt['median_ms'] * 1e3:.1f} us, "
                  f"merge_attention {ma['median_ms'] * 1e3:.1f} us", flush=True)
        rows.append(row)
    payload = {"device": harness.device_info(), "command": "python3 -m benchmarks.bench_dcp",
               "ctx": CTX, "topk": TOPK, "heads": HEADS, "rows": rows,
               "what": "single-GPU decode step parts vs the DCP merges one rank adds "
                       "(candidates already gathered; NCCL not included)"}
    harness.write_results("dcp", payload)
    return payload


if __name__ == "__main__":
    main()
