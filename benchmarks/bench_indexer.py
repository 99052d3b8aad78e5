"""Indexer scoring benchmark: prefill mqa_logits and paged decode, against peers
measured in the same run (copy bandwidth, cuBLASLt fp8 GEMM rate, the torch
_scaled_mm prefill path).

Timing (:mod:`cpsparse.timing`): the kernel time is a CUDA-graph replay of calls
over rotating inputs (per call, Python launch overhead out); the eager time,
host overhead included, is reported beside it. Ceilings: ``timing.copy_bandwidth_tbs``
and ``timing.fp8_gemm_tflops``, at the start and the end of the run.

Run on a GPU machine from the repository root::

    PYTHONPATH=$PWD python3 -m benchmarks.bench_indexer

Writes benchmarks/results/indexer.json (and $OUT/indexer.json, $OUT/indexer_table.md).
"""

import os
import pathlib

import numpy

from benchmarks import harness
from cpsparse import timing

D = 128
PATHS = ("wgmma", "mma")


def _codes(cp, shape, rng):
    """Random e4m3 codes (no NaN codes), moderate magnitudes (|v| <= 15)."""
    c = cp.random.randint(0, 256, size=shape, dtype=cp.int32).astype(cp.uint8)
    # exponent field <= 10 keeps products well inside fp32 and avoids NaN codes
    exp = (c >> 3) & 0xF
    c = cp.where(exp > 10, c & 0xD7, c).astype(cp.uint8)
    return c


def _prefill_inputs(cp, requests, heads, sets):
    ks, ke, cu = [], [], 0
    for ctx, qlen in requests:
        i = numpy.arange(qlen)
        ks.append(numpy.full(qlen, cu))
        ke.append(cu + ctx + i + 1)
        cu += ctx + qlen
    ks = numpy.concatenate(ks).astype(numpy.int32)
    ke = numpy.concatenate(ke).astype(numpy.int32)
    m, n = ks.size, cu
    out = []
    for s in range(sets):
        q = _codes(cp, (m, heads, D), s)
        k = _codes(cp, (n, D), s)
        sk = cp.random.random(n, dtype=cp.float32) * 0.01 + 1e-3
        w = cp.random.standard_normal((m, heads), dtype=cp.float32)
        res = cp.empty((m, n), dtype=cp.float32)
        out.append((q, k, sk, w, cp.asarray(ks), cp.asarray(ke), res))
    pairs = int((ke.astype(numpy.int64) - ks).sum())
    return out, m, n, pairs


def bench_prefill(cp, kin, name, requests, heads, rows):
    inputs, m, n, pairs = _prefill_inputs(cp, requests, heads, sets=2)
    for path in PATHS:
        def run(q, k, sk, w, ks, ke, res, path=path):
            kin.mqa_logits(cp, q, k, sk, w, ks, ke, out=res, path=path)
        eager = timing.time_cuda(run, inputs, warmup=3, iters=10)
        t = timing.time_graph(run, inputs, reps=4, iters=15)
        ms = t["median_ms"]
        rows.append({"kind": "prefill", "workload": name, "impl": f"cpsparse-{path}",
                     "H": heads, "M": m, "N": n, "pairs": pairs, "time_ms": ms,
                     "eager_ms": eager["median_ms"],
                     "p10_ms": t["p10_ms"], "p90_ms": t["p90_ms"],
                     "causal_tflops": 2 * heads * D * pairs / (ms * 1e-3) / 1e12})
    del inputs
    cp.get_default_memory_pool().free_all_blocks()


def bench_torch_prefill(cp, torch, rows, t_len=8192, heads=64):
    """torch._scaled_mm fp8 [T*H, D] x [S, D]^T -> bf16, relu, head-weighted sum, causal mask."""
    m = n = t_len
    q8 = torch.randn(m * heads, D, device="cuda").to(torch.float8_e4m3fn)
    k8 = torch.randn(n, D, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(m, 1, heads, device="cuda").to(torch.bfloat16)
    sk = torch.rand(n, device="cuda")
    one = torch.ones((), device="cuda")
    mask = torch.ones(m, n, dtype=torch.bool, device="cuda").triu_(1)

    def run():
        x = torch._scaled_mm(q8, k8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        x = x.view(m, heads, n).relu_()
        y = torch.bmm(w, x).view(m, n).float() * sk
        return y.masked_fill_(mask, float("-inf"))

    t = timing.time_torch(run, warmup=2, iters=10)
    pairs = m * (m + 1) // 2
    ms = t["median_ms"]
    rows.append({"kind": "prefill", "workload": f"causal 1x{t_len}", "impl": "torch _scaled_mm",
                 "H": heads, "M": m, "N": n, "pairs": pairs, "time_ms": ms,
                 "p10_ms": t["p10_ms"], "p90_ms": t["p90_ms"],
                 "causal_tflops": 2 * heads * D * pairs / (ms * 1e-3) / 1e12})
    del q8, k8, w, sk, mask
    torch.cuda.empty_cache()


def _decode_inputs(cp, batch, ctx, next_n, heads, rng):
    import cpsparse
    pages = batch * (-(-ctx // 64))
    page_bytes = 64 * (D + 4)
    sets = 3 if pages * page_bytes < (256 << 20) else 1      # rotate past the L2
    data = _codes(cp, (sets * pages, page_bytes), 0)
    scales = cp.random.random((sets * pages, 64), dtype=cp.float32) * 0.01 + 1e-3
    data[:, 64 * D:] = scales.view(cp.uint8)
    cache = cpsparse.IndexerKCache.wrap(data, 64, D)
    perm = rng.permutation(sets * pages).astype(numpy.int32)
    out = []
    for s in range(sets):
        table = cp.asarray(perm[s * pages:(s + 1) * pages].reshape(batch, -1))
        q = _codes(cp, (batch, next_n, heads, D), s)
        w = cp.random.standard_normal((batch * next_n, heads), dtype=cp.float32)
        lens = cp.full((batch,), ctx, dtype=cp.int32)
        res = cp.empty((batch * next_n, ctx), dtype=cp.float32)
        out.append((q, cache, w, lens, table, res))
    return out


def bench_decode(cp, kin, batch, ctx, next_n, heads, rows, rng, copy_tbs, piece_tiles=()):
    """Both paths with the default plan, then wgmma with other ``piece_tiles`` (tuning)."""
    inputs = _decode_inputs(cp, batch, ctx, next_n, heads, rng)
    keys = batch * ctx
    nbytes = keys * (D + 4) + batch * next_n * ctx * 4
    configs = [(f"cpsparse-{p}", p, None) for p in PATHS]
    configs += [(f"wgmma pt={pt}", "wgmma", pt) for pt in piece_tiles]
    for impl, path, pt in configs:
        def run(q, cache, w, lens, table, res, path=path, pt=pt):
            kin.paged_mqa_logits(cp, q, cache, w, lens, table, ctx, out=res, path=path,
                                 piece_tiles=pt)
        eager = (timing.time_cuda(run, inputs, warmup=3, iters=10)
                 if impl.startswith("cpsparse") else None)
        t = timing.time_graph(run, inputs, reps=10, iters=15)
        ms = t["median_ms"]
        tbs = nbytes / (ms * 1e-3) / 1e12
        rows.append({"kind": "decode", "workload": f"B={batch} ctx={ctx} next_n={next_n}",
                     "impl": impl, "H": heads, "time_ms": ms,
                     "eager_ms": eager["median_ms"] if eager else None,
                     "p10_ms": t["p10_ms"], "p90_ms": t["p90_ms"], "bytes": nbytes,
                     "tbs": tbs, "frac_copy": tbs / copy_tbs if copy_tbs else None,
                     "causal_tflops": 2 * heads * D * keys * next_n / (ms * 1e-3) / 1e12})
    del inputs
    cp.get_default_memory_pool().free_all_blocks()


def _markdown(payload):
    lines = ["| kind | workload | impl | time (ms) | causal TFLOP/s | TB/s | vs peer |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in payload["rows"]:
        tbs = f"{r['tbs']:.2f}" if r.get("tbs") else ""
        peer = ""
        if r["kind"] == "decode" and r.get("frac_copy"):
            peer = f"{100 * r['frac_copy']:.0f}% of copy"
        elif r["kind"] == "prefill" and payload.get("fp8_gemm_tflops"):
            peer = f"{100 * r['causal_tflops'] / payload['fp8_gemm_tflops']:.0f}% of fp8 GEMM"
        lines.append(f"| {r['kind']} | {r['workload']} (H={r['H']}) | {r['impl']} | "
                     f"{r['time_ms']:.4g} | {r['causal_tflops']:.4g} | {tbs} | {peer} |")
    return "\n".join(lines) + "\n"


def main():
    cp = harness.cupy()
    import cpsparse
    from cpsparse import raw_kernels
    from cpsparse.raw_kernels import indexer as kin
    torch = harness.torch_or_none()
    raw_kernels.precompile(["indexer"])
    info = harness.device_info()
    copy_tbs = timing.copy_bandwidth_tbs()
    gemm = timing.fp8_gemm_tflops()
    print(f"device {info['device']}: copy {copy_tbs:.3f} TB/s, fp8 GEMM "
          f"{gemm if gemm is None else round(gemm, 1)} TFLOP/s", flush=True)
    rows = []
    rng = numpy.random.default_rng(0)
    bench_prefill(cp, kin, "causal 1x8192", [(0, 8192)], 64, rows)
    if torch is not None and hasattr(torch, "_scaled_mm"):
        bench_torch_prefill(cp, torch, rows)
    bench_prefill(cp, kin, "causal 4x4096", [(0, 4096)] * 4, 64, rows)
    bench_prefill(cp, kin, "2048 q over 65536 keys", [(65536 - 2048, 2048)], 64, rows)
    bench_prefill(cp, kin, "causal 1x8192", [(0, 8192)], 32, rows)
    # CPSPARSE_BENCH_VARIANTS=1 also times other piece_tiles of the wgmma plan (tuning runs)
    explore = os.environ.get("CPSPARSE_BENCH_VARIANTS") == "1"
    piece_tiles = (16, 32, 64) if explore else ()
    for batch in (64, 256):
        for ctx in (4096, 32768):
            for next_n in (1, 2):
                pt = piece_tiles if (batch, ctx) in ((64, 32768), (256, 4096)) else ()
                bench_decode(cp, kin, batch, ctx, next_n, 64, rows, rng, copy_tbs, pt)
    gemm_end = timing.fp8_gemm_tflops()
    copy_end = timing.copy_bandwidth_tbs()
    payload = {"device": info, "copy_tbs": copy_tbs, "copy_tbs_end": copy_end,
               "fp8_gemm_tflops": gemm, "fp8_gemm_tflops_end": gemm_end, "rows": rows,
               "default_path": kin.DEFAULT_PATH, "cpsparse": cpsparse.__version__}
    # targets
    best = {}
    for r in rows:
        key = (r["kind"], r["workload"], r["H"])
        if r["impl"].startswith("cpsparse") and (key not in best
                                                 or r["time_ms"] < best[key]["time_ms"]):
            best[key] = r
    torch_row = next((r for r in rows if r["impl"] == "torch _scaled_mm"), None)
    p = best.get(("prefill", "causal 1x8192", 64))
    d = best.get(("decode", "B=64 ctx=32768 next_n=1", 64))
    targets = {}
    if p and torch_row:
        targets["prefill_speedup_vs_torch"] = torch_row["time_ms"] / p["time_ms"]
    if p and gemm:
        targets["prefill_frac_fp8_gemm"] = p["causal_tflops"] / gemm
    if d:
        targets["decode_frac_copy"] = d["frac_copy"]
    payload["targets"] = targets
    harness.write_results("indexer", payload)
    harness.print_table(rows, ["kind", "workload", "impl", "H", "time_ms", "eager_ms",
                               "causal_tflops", "tbs", "frac_copy"])
    print("targets:", {k: round(v, 3) for k, v in targets.items()})
    print(f"peers end of run: copy {copy_end:.3f} TB/s, fp8 GEMM {gemm_end}")
    md = _markdown(payload)
    out = os.environ.get("OUT")
    if out:
        pathlib.Path(out, "indexer_table.md").write_text(md)
    return payload


if __name__ == "__main__":
    main()
