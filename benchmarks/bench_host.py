"""Host time of the public ops at B=1, and the eager decode step vs its CUDA-graph replay.

Run on a GPU machine from the repository root::

    PYTHONPATH=$PWD python3 -m benchmarks.bench_host

A decode step at batch 1 is launch-bound: the GPU work of each op is a few
microseconds, so what the Python call costs on the host decides the step time
unless the step is replayed as a CUDA graph. Measured (:mod:`cpsparse.timing`,
device value checks off as in a production loop, DeepSeek-V3.2 shapes, one
request of a 32K context, inputs rotating over 3 sets):

* the floor: one allocation (``raw_kernels.empty``, as the ops allocate) and
  one launch of a 1-argument kernel through :class:`cpsparse.raw_kernels.Kernel`,
  timed the same way (what any op that allocates its output costs on this
  host; host speed varies between leases);
* host time of one public call: wall time until the Python call returns
  (launches are asynchronous), on an idle GPU (synchronized before each call),
  ``time.perf_counter_ns``, median with p10/p90 in microseconds; target
  <= 15 us each:

  - ``cpsparse.paged_mqa_logits``: H=64, D=128, next_n=1 over the paged fp8
    key cache;
  - ``cpsparse.topk_per_row_decode``: k=2048 on those logits;
  - ``cpsparse.local_to_global_slots``: the 2048 top-k positions to cache slots;
  - ``cpsparse.topk_per_row_decode`` with ``block_table=``: the top-k written
    as cache slots in the same launch (no target of its own: what a step calls);
  - ``cpsparse.sparse_mla_attention``: H=128, topk 2048 over the fp8_ds_mla
    ``cpsparse.MLAKVCache``;

  their eager device time (CUDA events around the call) is reported beside it;
* the decode step of one layer (scoring + top-k to slots + attention, three
  calls as :meth:`cpsparse.bench.DecodeStep.step` makes them): eager (CUDA
  events around the calls: the GPU waits for the host's launches) against its
  CUDA-graph replay (per step); target eager <= 1.3x graph.

Results: benchmarks/results/host.json (and $OUT/host.json when set).
"""

import numpy

from benchmarks import harness
from cpsparse import timing

BATCH, CONTEXT, SETS = 1, 32768, 3
TARGET_HOST_US = 15.0
TARGET_EAGER_VS_GRAPH = 1.3


def _row(op, shape, host, eager=None, graph=None):
    return {"op": op, "shape": shape, "host_us": host["median_us"],
            "host_p10_p90_us": [host["p10_us"], host["p90_us"]],
            "eager_us": eager["median_ms"] * 1e3 if eager else None,
            "graph_us": graph["median_ms"] * 1e3 if graph else None,
            "host": host, "eager": eager, "graph": graph}


def _floor(cp):
    """The least a public op that allocates its output and launches one kernel can cost
    on this host: one ``raw_kernels.empty`` and one :class:`cpsparse.raw_kernels.Kernel`
    launch of a 1-argument kernel (no validation, no plan)."""
    from cpsparse import raw_kernels
    raw = cp.RawKernel('extern "C" __global__ void cps_floor(int* a) '
                       '{ if (threadIdx.x == 1000) a[0] = 1; }', "cps_floor")
    fn = raw_kernels.Kernel(raw, "cps_floor", "P").bind(cp)

    def call():
        a = raw_kernels.empty(cp, (1, 2048), cp.int32)
        fn((1,), (32,), (a,))
        return a
    return call


def main():
    cp = harness.cupy()
    import cpsparse
    from cpsparse.bench import DecodeStep, sizes

    previous = cpsparse.set_device_value_checks(False)     # no host reads while timing
    try:
        cpsparse.precompile()
        s = sizes(cp)                                      # MLAConfig(): V3.2 shapes
        d = DecodeStep(cp, numpy.random.default_rng(0), BATCH, CONTEXT, s, sets=SETS)
        ops = [
            ("paged_mqa_logits", f"B={BATCH} ctx={CONTEXT} H={s['index_heads']} "
                                 f"D={s['head_dim']} next_n=1", d.scoring),
            ("topk_per_row_decode", f"k={s['topk']} of [{BATCH}, {CONTEXT}] logits", d.topk),
            ("local_to_global_slots", f"[{BATCH}, {s['topk']}] positions", d.slots),
            ("topk_per_row_decode(block_table=)", f"k={s['topk']} of [{BATCH}, {CONTEXT}] "
                                                  "logits, as cache slots", d.topk_slots),
            ("sparse_mla_attention", f"fp8_ds_mla MLAKVCache H={s['mla_heads']} "
                                     f"topk {s['topk']}", d.attention),
        ]
        rows = [dict(_row("floor: one allocation + one 1-argument launch",
                          "raw_kernels.Kernel, nothing else",
                          timing.time_host(_floor(cp), None, xp=cp, warmup=20, iters=300)),
                     target_us=None, ok=True)]
        print(f"floor (one allocation + one launch): {rows[0]['host_us']:.1f} us", flush=True)
        for name, shape, fn in ops:
            host = timing.time_host(fn, d.inputs, xp=cp, warmup=20, iters=300)
            eager = timing.time_cuda(fn, d.inputs, warmup=3, iters=50)
            target = None if "block_table" in name else TARGET_HOST_US
            rows.append(dict(_row(name, shape, host, eager), target_us=target,
                             ok=target is None or host["median_us"] <= target))
            print(f"{name}: host {host['median_us']:.1f} us (p10-p90 {host['p10_us']:.1f}-"
                  f"{host['p90_us']:.1f}), eager device {eager['median_ms'] * 1e3:.1f} us",
                  flush=True)
        step_host = timing.time_host(d.step, d.inputs, xp=cp, warmup=10, iters=200)
        step_eager = timing.time_cuda(d.step, d.inputs, warmup=3, iters=50)
        step_graph = timing.time_graph(d.step, d.inputs, reps=2 * SETS, warmup=3, iters=50)
        ratio = step_eager["median_ms"] / step_graph["median_ms"]
        rows.append(dict(_row("decode step (eager vs graph)",
                              "scoring + top-k to slots + attention", step_host, step_eager,
                              step_graph),
                         eager_vs_graph=ratio, target_eager_vs_graph=TARGET_EAGER_VS_GRAPH,
                         ok=ratio <= TARGET_EAGER_VS_GRAPH))
        print(f"decode step: eager {step_eager['median_ms'] * 1e3:.1f} us, graph replay "
              f"{step_graph['median_ms'] * 1e3:.1f} us per step ({ratio:.2f}x), host "
              f"{step_host['median_us']:.1f} us", flush=True)
    finally:
        cpsparse.set_device_value_checks(previous)

    payload = {
        "device": harness.device_info(), "cpsparse": cpsparse.__version__,
        "command": "python3 -m benchmarks.bench_host", "rows": rows,
        "sizes": {"batch": BATCH, "context": CONTEXT, "sets": SETS, "topk": s["topk"],
                  "index_heads": s["index_heads"], "head_dim": s["head_dim"],
                  "mla_heads": s["mla_heads"], "block": s["block"]},
        "targets": {"host_us_each_op": TARGET_HOST_US,
                    "eager_step_vs_graph": TARGET_EAGER_VS_GRAPH,
                    "all_ok": all(r["ok"] for r in rows)},
        "what": "host_us: wall time until the public call returns, on an idle GPU "
                "(synchronized before each call; perf_counter_ns; median, p10/p90); "
                "eager_us: CUDA events around the eager call(s); graph_us: the step "
                "captured in a CUDA graph, per step; value checks off; "
                "cpsparse.timing throughout",
    }
    harness.write_results("host", payload)
    print()
    harness.print_table(rows, ["op", "shape", "host_us", "host_p10_p90_us", "eager_us",
                               "graph_us", "ok"])
    print("targets:", payload["targets"])
    return payload


if __name__ == "__main__":
    main()
