"""``python -m cpsparse.bench``: the seed scenarios and the decode step, end to end.

Scenarios (each prints a progress line per case, then a table; all results go
to one JSON file, and PNG plots when matplotlib is installed):

* ``short_prefill``: one request of L tokens, DeepSeek-V3.2 indexer shapes;
  indexer latency with the construction gate enabled (the layer's name is
  passed) vs disabled (``""``); the reduction in %, and the crossover at
  ``index_topk`` / ``index_topk + 1`` where the skip must stop.
* ``mtp``: a draft round of 3 steps; indexer + attention time of steps 1+
  with step-0 top-k reuse vs recomputing the top-k every step.
* ``decode_step``: one decode step of a layer, split into projections /
  indexer scoring / top-k / sparse attention, against the sum of their
  rooflines; with the scoring + top-k + attention part captured as a CUDA
  graph and replayed where possible.

On CuPy (a GPU) the sizes are DeepSeek-V3.2's; on NumPy the same scenarios run
at small sizes so the command works on any machine.
"""

import argparse
import datetime
import json
import pathlib
import statistics
import time

import numpy

import cpsparse
from cpsparse.attention import local_to_global_slots, sparse_mla_attention
from cpsparse.cache import IndexerKCache, MLAKVCache
from cpsparse.demo import pick_backend
from cpsparse.indexer import (IndexerStats, paged_mqa_logits, sparse_attn_indexer,
                              topk_per_row_decode)
from cpsparse.metadata import ForwardContext, build_batch
from cpsparse.reference import cache as cache_ref

SCENARIOS = ("short_prefill", "mtp", "decode_step")


# ---- sizes -------------------------------------------------------------------

def sizes(xp, quick=False):
    """Workload sizes: DeepSeek-V3.2 on the GPU, scaled down on the CPU."""
    if xp is numpy:
        return dict(topk=64, index_heads=8, head_dim=128, mla_heads=4, block=64,
                    short_lens=[16, 32, 64, 65, 128], mtp_batches=[1, 4],
                    mtp_contexts=[256, 512], decode_batches=[1, 4], decode_contexts=[256, 1024],
                    iters=5, warmup=1)
    s = dict(topk=2048, index_heads=64, head_dim=128, mla_heads=128, block=64,
             short_lens=[256, 1024, 2048, 2049, 4096], mtp_batches=[1, 8, 64],
             mtp_contexts=[4096, 32768], decode_batches=[1, 8, 32, 64, 128],
             decode_contexts=[4096, 32768, 131072], iters=20, warmup=3)
    if quick:
        s.update(mtp_batches=[8, 64], decode_batches=[64], decode_contexts=[32768], iters=10)
    return s


# ---- timing ------------------------------------------------------------------

def time_op(xp, fn, *, iters, warmup):
    """Median milliseconds of fn() (CUDA events on CuPy, perf_counter on NumPy)."""
    for _ in range(warmup):
        fn()
    times = []
    if xp is numpy:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    else:
        start, stop = xp.cuda.Event(), xp.cuda.Event()
        xp.cuda.get_current_stream().synchronize()
        for _ in range(iters):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(xp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def _rng_array(xp, rng, shape, dtype=numpy.float32, scale=1.0):
    return xp.asarray((rng.standard_normal(shape) * scale).astype(dtype))


def _indexer_inputs(xp, rng, tokens, heads, dim):
    q = _rng_array(xp, rng, (tokens, heads, dim))
    q8, qs = cpsparse.quantize_fp8(q, block_size=dim, eps=1e-10)
    w = cpsparse.fold_weights(_rng_array(xp, rng, (tokens, heads)), qs[..., 0], dim)
    return q8, w, _rng_array(xp, rng, (tokens, dim))


def _fill_mla_cache(xp, rng, cache, num_tokens):
    """Fill the first num_tokens slots with valid records (a random pool, tiled)."""
    pool = min(num_tokens, 4096)
    kv_c = rng.standard_normal((pool, cache.kv_lora_rank)).astype(numpy.float32)
    k_pe = rng.standard_normal((pool, cache.rope_dim)).astype(numpy.float32)
    records = xp.asarray(cache_ref.mla_encode(kv_c, k_pe))
    flat = cache.records()
    reps = -(-num_tokens // pool)
    flat[:num_tokens] = xp.tile(records, (reps, 1))[:num_tokens]


def _fill_indexer_cache(xp, rng, cache, num_tokens):
    pool = min(num_tokens, 4096)
    keys = xp.asarray(rng.standard_normal((pool, cache.head_dim)).astype(numpy.float32))
    reps = -(-num_tokens // pool)
    slots = xp.arange(num_tokens, dtype=xp.int32)
    for r in range(reps):
        chunk = slots[r * pool:(r + 1) * pool]
        cache.insert(keys[:chunk.size], chunk)


def _tables(xp, batch, context, block, extra=1):
    """Contiguous page tables: request b owns pages [b*n, (b+1)*n)."""
    n = -(-(context + extra) // block)
    return xp.asarray(numpy.arange(batch * n, dtype=numpy.int32).reshape(batch, n)), batch * n


# ---- scenario 1: short-prefill skip -------------------------------------------

def bench_short_prefill(xp, s, rng, progress):
    rows = []
    name = "layers.0.attn"
    for length in s["short_lens"]:
        table, blocks = _tables(xp, 1, length, s["block"])
        cache = IndexerKCache(blocks, s["block"], s["head_dim"], xp=xp)
        meta = build_batch([length], [0], table, block_size=s["block"], index_topk=s["topk"])
        ctx = ForwardContext.for_layers(meta, [name])
        q8, w, k = _indexer_inputs(xp, rng, length, s["index_heads"], s["head_dim"])
        buf = xp.full((length, s["topk"]), -1, dtype=xp.int32)
        stats = {True: IndexerStats(), False: IndexerStats()}

        def run(enabled):
            sparse_attn_indexer(q8, w, k, cache, meta, buf, forward_context=ctx,
                                dense_mha_metadata_layer_name=name if enabled else "",
                                stats=stats[enabled])

        t_on = time_op(xp, lambda: run(True), iters=s["iters"], warmup=s["warmup"])
        t_off = time_op(xp, lambda: run(False), iters=s["iters"], warmup=s["warmup"])
        row = dict(tokens=length, topk=s["topk"], use_dense_mha=meta.mla.prefill.use_dense_mha,
                   skip_fired=stats[True].skipped > 0, gate_on_ms=t_on, gate_off_ms=t_off,
                   reduction_pct=100.0 * (1 - t_on / t_off))
        rows.append(row)
        progress(f"short_prefill L={length}: gate on {t_on:.3f} ms, off {t_off:.3f} ms, "
                 f"reduction {row['reduction_pct']:.1f}% (skip fired: {row['skip_fired']})")
    return rows


# ---- scenario 2: MTP reuse ------------------------------------------------------

def _attention_step(xp, q, cache, rows, req_ids, table, block, sm_scale):
    slots = local_to_global_slots(rows, req_ids, table, block)
    return sparse_mla_attention(q, cache, slots, sm_scale)


def bench_mtp(xp, s, rng, progress, steps=3):
    rows = []
    sm_scale = cpsparse.softmax_scale()
    for batch in s["mtp_batches"]:
        for context in s["mtp_contexts"]:
            table, blocks = _tables(xp, batch, context, s["block"], extra=steps)
            icache = IndexerKCache(blocks, s["block"], s["head_dim"], xp=xp)
            mcache = MLAKVCache(blocks, s["block"], xp=xp)
            _fill_indexer_cache(xp, rng, icache, blocks * s["block"])
            _fill_mla_cache(xp, rng, mcache, blocks * s["block"])
            # a draft step: one token per request at position context + step
            meta = build_batch([1] * batch, [context] * batch, table, block_size=s["block"],
                               index_topk=s["topk"])
            q8, w, k = _indexer_inputs(xp, rng, batch, s["index_heads"], s["head_dim"])
            q = _rng_array(xp, rng, (batch, s["mla_heads"], 576), scale=0.1)
            buf = xp.full((batch, s["topk"]), -1, dtype=xp.int32)
            ctx = ForwardContext.for_layers(meta, [])
            sparse_attn_indexer(q8, w, k, icache, meta, buf, forward_context=ctx)  # step 0 rows

            def reuse():
                _attention_step(xp, q, mcache, buf, meta.req_ids, table, s["block"], sm_scale)

            def recompute():
                sparse_attn_indexer(q8, w, k, icache, meta, buf, forward_context=ctx)
                _attention_step(xp, q, mcache, buf, meta.req_ids, table, s["block"], sm_scale)

            t_reuse = (steps - 1) * time_op(xp, reuse, iters=s["iters"], warmup=s["warmup"])
            t_recompute = (steps - 1) * time_op(xp, recompute, iters=s["iters"],
                                                warmup=s["warmup"])
            row = dict(batch=batch, context=context, steps=steps, reuse_ms=t_reuse,
                       recompute_ms=t_recompute, speedup=t_recompute / t_reuse)
            rows.append(row)
            progress(f"mtp B={batch} ctx={context}: steps 1..{steps - 1} reuse {t_reuse:.3f} ms,"
                     f" recompute {t_recompute:.3f} ms, {row['speedup']:.2f}x")
    return rows


# ---- scenario 3: decode step ----------------------------------------------------

def _projection_shapes(mla_heads):
    """(rows of x, in, out) of every matmul of a V3.2 decode step per token."""
    return [(7168, 1536), (1536, mla_heads * 192), (7168, 576), (1536, 64 * 128),
            (7168, 128), (7168, 64), (mla_heads * 128, 7168)]


def bench_decode_step(xp, s, rng, progress, ceilings):
    rows = []
    sm_scale = cpsparse.softmax_scale()
    for batch in s["decode_batches"]:
        for context in s["decode_contexts"]:
            if xp is not numpy and batch * context * (656 + 132 + 8) > 40e9:
                continue                                    # keep well inside 141 GB
            table, blocks = _tables(xp, batch, context, s["block"])
            icache = IndexerKCache(blocks, s["block"], s["head_dim"], xp=xp)
            mcache = MLAKVCache(blocks, s["block"], xp=xp)
            _fill_indexer_cache(xp, rng, icache, blocks * s["block"])
            _fill_mla_cache(xp, rng, mcache, blocks * s["block"])
            lens = xp.full(batch, context, dtype=xp.int32)
            q8, w, _ = _indexer_inputs(xp, rng, batch, s["index_heads"], s["head_dim"])
            q8 = q8.reshape(batch, 1, s["index_heads"], s["head_dim"])
            q = _rng_array(xp, rng, (batch, s["mla_heads"], 576), scale=0.1)
            req_ids = xp.arange(batch, dtype=xp.int32)
            buf = xp.full((batch, s["topk"]), -1, dtype=xp.int32)
            logits = paged_mqa_logits(q8, icache, w, lens, table, context)

            def scoring():
                return paged_mqa_logits(q8, icache, w, lens, table, context)

            def topk():
                topk_per_row_decode(logits, lens, 1, s["topk"], out=buf)

            def attention():
                _attention_step(xp, q, mcache, buf, req_ids, table, s["block"], sm_scale)

            it = dict(iters=s["iters"], warmup=s["warmup"])
            t_score, t_topk = time_op(xp, scoring, **it), time_op(xp, topk, **it)
            t_attn = time_op(xp, attention, **it)
            t_proj = None
            if xp is not numpy:
                mats = [(xp.asarray(rng.standard_normal((batch, i)).astype(numpy.float32)),
                         xp.asarray((rng.standard_normal((i, o)) * 0.01).astype(numpy.float32)))
                        for i, o in _projection_shapes(s["mla_heads"])]
                t_proj = time_op(xp, lambda: [a @ b for a, b in mats], **it)
            graph_ms, graph_note = _graph_replay(xp, [scoring, topk, attention], it)
            roof = _decode_roofline(batch, context, s, ceilings)
            total = t_score + t_topk + t_attn
            row = dict(batch=batch, context=context, projections_ms=t_proj, indexer_ms=t_score,
                       topk_ms=t_topk, attention_ms=t_attn, sparse_path_ms=total,
                       graph_replay_ms=graph_ms, graph_note=graph_note, roofline_ms=roof,
                       vs_roofline=(total / roof) if roof else None,
                       graph_vs_roofline=(graph_ms / roof) if roof and graph_ms else None)
            rows.append(row)
            progress(f"decode_step B={batch} ctx={context}: indexer {t_score:.3f} + top-k "
                     f"{t_topk:.3f} + attention {t_attn:.3f} ms"
                     + (f" = {row['vs_roofline']:.2f}x roofline" if roof else ""))
            del icache, mcache
    return rows


def _graph_replay(xp, fns, it):
    """Capture fns on a CUDA graph and time its replay; (ms, note)."""
    if xp is numpy:
        return None, "no CUDA graphs on the NumPy backend"
    stream = xp.cuda.Stream(non_blocking=True)
    try:
        with stream:
            stream.begin_capture()
            try:
                for fn in fns:
                    fn()
            finally:
                graph = stream.end_capture()
        with stream:                 # events on the replay stream, not the null stream
            ms = time_op(xp, lambda: graph.launch(stream), **it)
        return ms, "captured: scoring + top-k + attention"
    except Exception as exc:  # noqa: BLE001 - report why capture is not possible
        return None, f"not capturable: {type(exc).__name__}: {str(exc)[:120]}"


def _decode_roofline(batch, context, s, ceilings):
    """Sum of the three rooflines in ms (bytes / copy rate, FLOPs / bf16 rate)."""
    bw = ceilings.get("copy_tbs")
    mm = ceilings.get("bf16_tflops")
    if not bw:
        return None
    keys = batch * context
    score_bytes = keys * 132 + keys * 4                       # read keys, write logits
    topk_bytes = keys * 4 + batch * s["topk"] * 4
    attn_bytes = batch * s["topk"] * 656
    t = (score_bytes + topk_bytes + attn_bytes) / (bw * 1e12)
    if mm:
        t += 2 * batch * s["mla_heads"] * s["topk"] * (576 + 512) / (mm * 1e12)
    return t * 1e3


def measure_ceilings(xp):
    """Copy bandwidth (CuPy) and the bf16 matrix rate (torch, when installed)."""
    if xp is numpy:
        return {}
    n = 1 << 29
    a = xp.ones(n, dtype=xp.float32)
    b = xp.empty_like(a)
    ms = time_op(xp, lambda: b.__setitem__(slice(None), a), iters=10, warmup=2)
    out = {"copy_tbs": 2 * 4 * n / (ms * 1e-3) / 1e12}
    del a, b
    try:
        import torch
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            x @ y
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            x @ y
        stop.record()
        stop.synchronize()
        out["bf16_tflops"] = 2 * 8192 ** 3 * 10 / (start.elapsed_time(stop) * 1e-3) / 1e12
    except Exception:  # noqa: BLE001 - torch is an optional peer
        pass
    return out


# ---- reporting -------------------------------------------------------------------

COLUMNS = {
    "short_prefill": ["tokens", "topk", "use_dense_mha", "skip_fired", "gate_on_ms",
                      "gate_off_ms", "reduction_pct"],
    "mtp": ["batch", "context", "steps", "reuse_ms", "recompute_ms", "speedup"],
    "decode_step": ["batch", "context", "projections_ms", "indexer_ms", "topk_ms",
                    "attention_ms", "sparse_path_ms", "graph_replay_ms", "roofline_ms",
                    "vs_roofline", "graph_vs_roofline"],
}


def table_lines(rows, columns):
    """Rows (dicts) as aligned text lines of ``columns`` (header, rule, rows)."""
    cells = [[str(c) for c in columns]] + [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:]


def print_table(title, rows, columns):
    print(f"\n{title}")
    print("\n".join(table_lines(rows, columns)))


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def plot(results, out_dir):
    """PNG plots of each scenario; returns the files written (none without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - optional dependency
        return []
    files = []
    rows = results["scenarios"].get("short_prefill")
    if rows:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = [str(r["tokens"]) for r in rows]
        ax.bar([i - 0.2 for i in range(len(xs))], [r["gate_off_ms"] for r in rows], 0.4,
               label="gate disabled")
        ax.bar([i + 0.2 for i in range(len(xs))], [r["gate_on_ms"] for r in rows], 0.4,
               label="gate enabled")
        ax.set_xticks(range(len(xs)), xs)
        ax.set_xlabel(f"prefill tokens (index_topk {rows[0]['topk']})")
        ax.set_ylabel("indexer latency (ms)")
        ax.set_title("Short-prefill skip")
        ax.legend()
        files.append(_save(fig, out_dir, "short_prefill.png"))
    rows = results["scenarios"].get("mtp")
    if rows:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels = [f"B={r['batch']}\nctx={r['context']}" for r in rows]
        ax.bar(range(len(rows)), [r["speedup"] for r in rows])
        ax.axhline(2.0, color="gray", ls="--", label="target 2.0x")
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("steps 1+: recompute / reuse")
        ax.set_title("MTP step-0 top-k reuse")
        ax.legend()
        files.append(_save(fig, out_dir, "mtp_reuse.png"))
    rows = results["scenarios"].get("decode_step")
    if rows:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"B={r['batch']}\n{r['context'] // 1024}K" for r in rows]
        bottom = [0.0] * len(rows)
        for key in ("projections_ms", "indexer_ms", "topk_ms", "attention_ms"):
            vals = [r.get(key) or 0.0 for r in rows]
            ax.bar(range(len(rows)), vals, bottom=bottom, label=key[:-3])
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_ylabel("ms per decode step")
        ax.set_title("Decode step of one layer")
        ax.legend(fontsize=7)
        files.append(_save(fig, out_dir, "decode_step.png"))
    return files


def _save(fig, out_dir, name):
    path = pathlib.Path(out_dir) / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return str(path)


def run(backend="auto", scenarios=SCENARIOS, out_dir=None, quick=False, seed=0,
        progress=print):
    """Run the scenarios; returns the results dict (also written as JSON)."""
    xp = pick_backend(backend)
    backend = "numpy" if xp is numpy else "cupy"
    s = sizes(xp, quick)
    rng = numpy.random.default_rng(seed)
    # Value checks read device memory (a sync per call): off while timing, as in
    # a production loop. NumPy inputs are always checked.
    previous_checks = cpsparse.set_device_value_checks(False)
    try:
        return _run(xp, backend, scenarios, out_dir, quick, rng, s, progress)
    finally:
        cpsparse.set_device_value_checks(previous_checks)


def _run(xp, backend, scenarios, out_dir, quick, rng, s, progress):
    ceilings = measure_ceilings(xp)
    results = {"backend": backend, "date": datetime.date.today().isoformat(),
               "cpsparse": cpsparse.__version__, "sizes": s, "ceilings": ceilings,
               "scenarios": {}}
    if xp is not numpy:
        props = xp.cuda.runtime.getDeviceProperties(xp.cuda.Device().id)
        results["device"] = props["name"].decode() if isinstance(props["name"], bytes) \
            else props["name"]
    progress(f"cpsparse.bench on {backend}" + (f" ({results.get('device')})"
                                                if xp is not numpy else " (small sizes)")
             + "".join(f", {k} {v:.4g}" for k, v in ceilings.items()))
    runners = {"short_prefill": lambda: bench_short_prefill(xp, s, rng, progress),
               "mtp": lambda: bench_mtp(xp, s, rng, progress),
               "decode_step": lambda: bench_decode_step(xp, s, rng, progress, ceilings)}
    for name in scenarios:
        results["scenarios"][name] = runners[name]()
    for name, rows in results["scenarios"].items():
        print_table(name, rows, COLUMNS[name])
    out = pathlib.Path(out_dir or ".")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_{backend}.json"
    path.write_text(json.dumps(results, indent=2, default=_json_default) + "\n")
    results["plots"] = plot(results, out)
    print(f"\nresults: {path}" + "".join(f"\nplot: {p}" for p in results["plots"]))
    return results


def _json_default(v):
    if isinstance(v, (numpy.integer,)):
        return int(v)
    if isinstance(v, (numpy.floating,)):
        return float(v)
    if isinstance(v, numpy.bool_):
        return bool(v)
    raise TypeError(type(v))


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m cpsparse.bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    parser.add_argument("--out", default=None, help="directory of the JSON and PNG files "
                        "(default: the current directory)")
    parser.add_argument("--quick", action="store_true", help="fewer GPU cases")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    chosen = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    run(args.backend, chosen, args.out, args.quick, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
