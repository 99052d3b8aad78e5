"""Per-row top-k (issue 5) against torch.topk on the same rows, same run.

Run on a GPU machine from the repository root::

    python3 -m benchmarks.bench_topk

Workloads (PEERS.md): prefill 8192 x 8192 fp32 causal (row i sees [0, i]; torch
gets the same rows with -inf outside the window), decode 64 x 32768,
64 x 131072, 4 x 131072, 1 x 131072; k = 2048; fresh standard-normal logits,
rotated between calls. Two timings each (METHOD.md):

* eager: one public call per CUDA-event pair (cpsparse.indexer.* with device
  value checks off, as a production loop runs them), median of iters;
* graph: REPS calls over the rotating inputs captured in one CUDA graph,
  median replay time / REPS: the kernel time without host launch gaps.

Both through :mod:`cpsparse.timing` (``time_cuda`` / ``time_graph``, and
``time_torch`` / ``time_graph_torch`` for the peer).

torch.topk is timed both ways too (skipped when torch is missing). A sweep of
the compiled variants (CTAs per row, threads) is timed on every workload as
well, and a set-test sanity check runs on a few rows of every workload. Results go to
benchmarks/results/topk.json (and $OUT/topk.json when set).
"""

import sys

import numpy as np

from benchmarks import harness
from cpsparse import timing

K = 2048
N_INPUTS = 3


def _set_ok(logits_row, start, end, got_row, k):
    from cpsparse.reference.indexer import order_keys
    n = end - start
    g = np.asarray(got_row, np.int64)
    if n <= k:
        return bool(np.array_equal(g, np.where(np.arange(k) < n, np.arange(k), -1)))
    if g.min() < 0 or g.max() >= n or np.unique(g).size != k:
        return False
    keys = order_keys(logits_row[start:end]).astype(np.int64)
    sel = keys[g]
    kth = np.partition(keys, n - k)[n - k]
    return bool(sel.min() == kth and (sel > kth).sum() == (keys > kth).sum())


def _workloads():
    return [
        {"name": "prefill 8192x8192 causal", "kind": "prefill", "rows": 8192, "width": 8192,
         "reps": 5, "torch_peer_ms": 1.39},
        {"name": "decode 64x32768", "kind": "decode", "rows": 64, "width": 32768, "reps": 20,
         "torch_peer_ms": 0.14},
        {"name": "decode 64x131072", "kind": "decode", "rows": 64, "width": 131072, "reps": 20,
         "torch_peer_ms": 0.205},
        {"name": "decode 4x131072", "kind": "decode", "rows": 4, "width": 131072, "reps": 20,
         "torch_peer_ms": None},
        {"name": "decode 1x131072", "kind": "decode", "rows": 1, "width": 131072, "reps": 20,
         "torch_peer_ms": None},
    ]


def main(argv=None):
    cp = harness.cupy()
    import cpsparse
    from cpsparse import raw_kernels
    from cpsparse.indexer import topk_per_row, topk_per_row_decode
    from cpsparse.raw_kernels import topk as ktopk

    torch = harness.torch_or_none()
    raw_kernels.precompile(["topk"])
    cpsparse.set_device_value_checks(False)
    rows_out, variants = [], []
    for w in _workloads():
        m, width = w["rows"], w["width"]
        logits = []
        for _ in range(N_INPUTS):
            x = cp.random.standard_normal((m, width), dtype=cp.float32)
            if w["kind"] == "prefill":
                col = cp.arange(width)[None, :]
                x = cp.where(col <= cp.arange(m)[:, None], x, cp.float32(-cp.inf))
            logits.append(x)
        out = cp.empty((m, K), cp.int32)
        if w["kind"] == "prefill":
            starts = cp.zeros(m, cp.int32)
            ends = cp.arange(1, m + 1, dtype=cp.int32)

            def call(x, _s=starts, _e=ends, _o=out):
                topk_per_row(x, _s, _e, K, out=_o)
        else:
            ctx = cp.full(m, width, cp.int32)

            def call(x, _c=ctx, _o=out):
                topk_per_row_decode(x, _c, 1, K, out=_o)
        cluster = ktopk.default_cluster(m, width)
        inputs = [(x,) for x in logits]
        eager = timing.time_cuda(call, inputs, warmup=3, iters=30)
        graph = timing.time_graph(call, inputs, reps=w["reps"], iters=10)
        # sanity: set test on a few rows of the last input
        call(*inputs[0])
        host_rows = [0, m // 2, m - 1] if m > 2 else list(range(m))
        lx = logits[0][host_rows].get()
        lo = out[host_rows].get()
        ok = True
        for j, r in enumerate(host_rows):
            end = r + 1 if w["kind"] == "prefill" else width
            ok &= _set_ok(lx[j], 0, end, lo[j], K)
        rec = {"workload": w["name"], "rows": m, "width": width, "k": K, "cluster": cluster,
               "ours_eager_us": eager["median_ms"] * 1e3, "ours_graph_us": graph["median_ms"] * 1e3,
               "ours_eager": eager, "ours_graph": graph, "set_test_ok": ok,
               "torch_peer_ms_peers_md": w["torch_peer_ms"]}
        if torch is not None:
            tx = [(torch.from_dlpack(x),) for x in logits]
            tcall = lambda x: torch.topk(x, K, dim=-1)  # noqa: E731
            te = timing.time_torch(tcall, tx, warmup=3, iters=30)
            tg = timing.time_graph_torch(tcall, tx, reps=w["reps"], iters=10)
            rec.update({"torch_eager_us": te["median_ms"] * 1e3,
                        "torch_graph_us": tg["median_ms"] * 1e3,
                        "torch_eager": te, "torch_graph": tg,
                        "speedup_eager": te["median_ms"] / eager["median_ms"],
                        "speedup_graph": tg["median_ms"] / graph["median_ms"]})
            del tx
        rows_out.append(rec)
        print(f"{w['name']}: ours {rec['ours_eager_us']:.1f} us eager, {rec['ours_graph_us']:.1f} us "
              f"graph (cluster {cluster}); torch {rec.get('torch_eager_us', float('nan')):.1f} / "
              f"{rec.get('torch_graph_us', float('nan')):.1f} us; set test ok={ok}", flush=True)
        sweep_ctx = cp.full(m, width, cp.int32)
        for v in ktopk.VARIANTS:
            if w["kind"] == "prefill":
                def vcall(x, _s=starts, _e=ends, _o=out, _v=v):
                    ktopk.topk_per_row(cp, x, _s, _e, K, _o, variant=_v)
            else:
                def vcall(x, _c=sweep_ctx, _o=out, _v=v):
                    ktopk.topk_per_row_decode(cp, x, _c, 1, K, _o, variant=_v)
            t = timing.time_graph(vcall, inputs, reps=w["reps"], iters=10)
            variants.append({"workload": w["name"], "variant": v,
                             "ctas_per_row": ktopk.VARIANTS[v][0],
                             "threads": ktopk.VARIANTS[v][1], "graph_us": t["median_ms"] * 1e3})
        del logits, inputs, out
        cp.get_default_memory_pool().free_all_blocks()

    by = {r["workload"]: r for r in rows_out}
    targets = {
        "prefill_8192_causal_speedup_ge_8": by["prefill 8192x8192 causal"].get("speedup_graph"),
        "decode_64x131072_speedup_ge_5": by["decode 64x131072"].get("speedup_graph"),
        "decode_4x131072_graph_us_lt_30": by["decode 4x131072"]["ours_graph_us"],
        "decode_4x131072_eager_us": by["decode 4x131072"]["ours_eager_us"],
    }
    payload = {"bench": "topk", "device": harness.device_info(), "k": K,
               "command": "python3 -m benchmarks.bench_topk", "results": rows_out,
               "variant_sweep": variants, "targets": targets,
               "torch": None if torch is None else torch.__version__}
    harness.write_results("topk", payload)
    print("\nvariant sweep (graph us per call):")
    harness.print_table(variants, ["workload", "variant", "ctas_per_row", "threads", "graph_us"])
    print("\ntop-k, k=2048 (us per call; graph = back-to-back in a CUDA graph):")
    harness.print_table(rows_out, ["workload", "cluster", "ours_eager_us", "ours_graph_us",
                                   "torch_eager_us", "torch_graph_us", "speedup_eager",
                                   "speedup_graph", "set_test_ok"])
    print("\ntargets:", targets)
    return 0 if all(r["set_test_ok"] for r in rows_out) else 1


if __name__ == "__main__":
    sys.exit(main())
