"""Sparse MLA attention (issue 6) against a torch gather + bmm + softmax peer, same run.

Run on a GPU machine from the repository root::

    python3 -m benchmarks.bench_attention

Workloads (PEERS.md), FLOPs = 2 * T * H * topk * (576 + 512):

* prefill: T = 4096 tokens, H = 128, topk 2048 distinct keys of an 8192-row
  workspace (float16 q and rows; the kernel rounds them to bf16);
* decode: B = 128 requests, s_q = 2 (T = 256), H = 128, topk 2048 of a 32768-token
  context each, over the paged fp8_ds_mla cache (656 bytes a token, 2.75 GB);
* dense causal (the short-prefill route): 4 requests of 1024 tokens, H = 128,
  causal FLOPs.

Timings (:mod:`cpsparse.timing`: CUDA events, medians with p10/p90 over rotating
inputs): the public op (``cpsparse.sparse_mla_attention`` with device value checks
off, as a production loop runs it; prefill includes the bf16 pre-pass of the
workspace) and the kernel alone (one kernel: no variants to sweep). The torch
peer (bf16 gather + bmm + fp32 softmax + bmm, chunked over tokens; for decode it
dequantizes the gathered fp8 records first) is timed when torch is present, as is
the bf16 GEMM ceiling. A spot check against the float64 reference runs on a few
tokens of each workload. Results: benchmarks/results/attention.json (and
$OUT/attention.json when set).
"""

import numpy as np

from benchmarks import harness
from cpsparse import timing

D_QK, D_V = 576, 512


def _flops(tokens, heads, keys):
    return 2.0 * tokens * heads * keys * (D_QK + D_V)


def _tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def _rand_topk(cp, rows, width, k, seed):
    cp.random.seed(seed)
    return cp.argsort(cp.random.random((rows, width), dtype=cp.float32),
                      axis=1)[:, :k].astype(cp.int32)


def _spot_check(cp, q, kv_host_fn, idx, scale, out, lse, tokens):
    """Relative out error and max lse error of the first tokens vs the reference."""
    from cpsparse.reference import attention as ref
    qh = cp.asnumpy(q[:tokens]).astype(np.float32)
    ih = cp.asnumpy(idx[:tokens])
    rows, decode = kv_host_fn(ih)
    e_out, e_lse = ref.sparse_mla_attention(qh, rows, ih, scale, D_V, decode)
    g_out, g_lse = cp.asnumpy(out[:tokens]), cp.asnumpy(lse[:tokens])
    rel = float(np.linalg.norm(g_out - e_out) / np.linalg.norm(e_out))
    return {"tokens": tokens, "out_rel_err": rel,
            "lse_max_abs_err": float(np.abs(g_lse - e_lse).max())}


def _torch_sparse(torch, q, rows_of, idx, scale, chunk):
    """bf16 gather + bmm + fp32 softmax + bmm, ``rows_of(idx_chunk)`` -> [c, k, 576] bf16."""
    tokens, heads, _ = q.shape
    out = torch.empty((tokens, heads, D_V), device=q.device, dtype=torch.float32)
    for t0 in range(0, tokens, chunk):
        t1 = min(tokens, t0 + chunk)
        k = rows_of(idx[t0:t1])
        s = torch.bmm(q[t0:t1], k.transpose(1, 2)).float() * scale
        p = torch.softmax(s, dim=-1).to(torch.bfloat16)
        out[t0:t1] = torch.bmm(p, k[:, :, :D_V]).float()
    return out


def bench_prefill(cp, torch, katt, cpsparse, scale):
    tokens, heads, rows, k = 4096, 128, 8192, 2048
    cp.random.seed(1)
    q = cp.random.standard_normal((tokens, heads, D_QK), dtype=cp.float32).astype(cp.float16)
    kv = cp.random.standard_normal((rows, D_QK), dtype=cp.float32).astype(cp.float16)
    idx = [_rand_topk(cp, tokens, rows, k, 2), _rand_topk(cp, tokens, rows, k, 3)]
    flops = _flops(tokens, heads, k)
    res = {"workload": f"prefill T={tokens} H={heads} topk={k} of {rows} (fp16 in, bf16 MMA)",
           "flops": flops}
    t = timing.time_cuda(lambda i: cpsparse.sparse_mla_attention(q, kv, i, scale),
                         [(i,) for i in idx], warmup=2, iters=10)
    res["op"] = dict(t, tflops=_tflops(flops, t["median_ms"]))
    kvb = katt.to_bf16(cp, kv)
    t = timing.time_cuda(lambda i: katt._launch(cp, q, kvb, False, indices=i,
                                                sm_scale=scale, d_v=D_V),
                         [(i,) for i in idx], warmup=2, iters=10)
    res["kernel"] = dict(t, tflops=_tflops(flops, t["median_ms"]))
    out, lse = cpsparse.sparse_mla_attention(q, kv, idx[0], scale)
    kv_h = cp.asnumpy(kv).astype(np.float32)
    res["spot_check"] = _spot_check(cp, q, lambda ih: (kv_h, None), idx[0], scale, out, lse, 3)
    del out, lse
    if torch is not None:
        qt = torch.from_dlpack(q).to(torch.bfloat16)
        kvt = torch.from_dlpack(kv).to(torch.bfloat16)
        it = [torch.from_dlpack(i).long() for i in idx]
        t = timing.time_torch(
            lambda i: _torch_sparse(torch, qt, lambda ix: kvt[ix], i, scale, 256),
            [(i,) for i in it], warmup=1, iters=5)
        res["torch_peer"] = dict(t, tflops=_tflops(flops, t["median_ms"]))
        del qt, kvt, it
    return res


def _decode_cache(cp, num_slots, seed):
    """Valid fp8_ds_mla records (no NaN codes, positive scales, bf16 RoPE) on the GPU."""
    cp.random.seed(seed)
    rec = cp.empty((num_slots, 656), dtype=cp.uint8)
    codes = cp.random.randint(0, 256, (num_slots, 512), dtype=cp.int32).astype(cp.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    rec[:, :512] = codes
    del codes
    scales = cp.random.uniform(0.002, 0.02, (num_slots, 4), dtype=cp.float32)
    rec[:, 512:528] = scales.view(cp.uint8)
    del scales
    rope = cp.random.standard_normal((num_slots, 64), dtype=cp.float32)
    rec[:, 528:] = (rope.view(cp.uint32) >> 16).astype(cp.uint16).view(cp.uint8)
    del rope
    return rec


def bench_decode(cp, torch, katt, cpsparse, scale):
    batch, s_q, heads, k, ctx, bs = 128, 2, 128, 2048, 32768, 64
    tokens = batch * s_q
    pages = ctx // bs
    records = _decode_cache(cp, batch * ctx, 4)
    cache = cpsparse.MLAKVCache.wrap(records.reshape(batch * pages, bs, 656))
    cp.random.seed(5)
    table = cp.random.permutation(batch * pages).astype(cp.int32).reshape(batch, pages)
    req = cp.repeat(cp.arange(batch, dtype=cp.int32), s_q)
    cp.random.seed(6)
    q = cp.random.standard_normal((tokens, heads, D_QK), dtype=cp.float32).astype(cp.float16)
    slots = []
    for seed in (7, 8):
        pos = _rand_topk(cp, tokens, ctx, k, seed)
        slots.append(cpsparse.local_to_global_slots(pos, req, table, bs))
    flops = _flops(tokens, heads, k)
    res = {"workload": f"decode B={batch} s_q={s_q} H={heads} topk={k} ctx={ctx} "
                       "(fp8_ds_mla cache)", "flops": flops}
    pos = _rand_topk(cp, tokens, ctx, k, 9)
    t = timing.time_cuda(lambda: cpsparse.local_to_global_slots(pos, req, table, bs),
                         warmup=2, iters=20)
    res["local_to_global_slots"] = t
    t = timing.time_cuda(lambda s: cpsparse.sparse_mla_attention(q, cache, s, scale),
                         [(s,) for s in slots], warmup=2, iters=20)
    res["op"] = dict(t, tflops=_tflops(flops, t["median_ms"]))
    rows = cache.records()
    t = timing.time_cuda(lambda s: katt._launch(cp, q, rows, True, indices=s,
                                                sm_scale=scale, d_v=D_V),
                         [(s,) for s in slots], warmup=2, iters=20)
    res["kernel"] = dict(t, tflops=_tflops(flops, t["median_ms"]))
    out, lse = cpsparse.sparse_mla_attention(q, cache, slots[0], scale)
    from cpsparse.reference import cache as cache_ref

    def host_rows(ih):
        uniq, inv = np.unique(np.where(ih >= 0, ih, 0), return_inverse=True)
        rec_h = cp.asnumpy(rows[cp.asarray(uniq)])
        return rec_h, (lambda r: cache_ref.mla_decode(r, 512, 64)), inv.reshape(ih.shape)

    from cpsparse.reference import attention as ref
    ih = cp.asnumpy(slots[0][:3])
    rec_h, dec, inv = host_rows(ih)
    e_out, e_lse = ref.sparse_mla_attention(cp.asnumpy(q[:3]).astype(np.float32), rec_h,
                                            inv.astype(np.int32), scale, D_V, dec)
    g_out, g_lse = cp.asnumpy(out[:3]), cp.asnumpy(lse[:3])
    res["spot_check"] = {"tokens": 3,
                         "out_rel_err": float(np.linalg.norm(g_out - e_out)
                                              / np.linalg.norm(e_out)),
                         "lse_max_abs_err": float(np.abs(g_lse - e_lse).max())}
    del out, lse
    if torch is not None:
        qt = torch.from_dlpack(q).to(torch.bfloat16)
        rt = torch.from_dlpack(rows)
        st = [torch.from_dlpack(s).long() for s in slots]

        def rows_of(ix):
            rec = rt[ix]                                             # [c, k, 656] uint8
            c = ix.shape[0]
            codes = rec[..., :512].contiguous().view(torch.float8_e4m3fn).float()
            sc = rec[..., 512:528].contiguous().view(torch.float32)  # [c, k, 4]
            lat = (codes.view(c, k, 4, 128) * sc[..., None]).view(c, k, 512)
            rope = rec[..., 528:].contiguous().view(torch.bfloat16)
            return torch.cat([lat.to(torch.bfloat16), rope], dim=-1)

        t = timing.time_torch(lambda s: _torch_sparse(torch, qt, rows_of, s, scale, 64),
                              [(s,) for s in st], warmup=1, iters=5)
        res["torch_peer"] = dict(t, tflops=_tflops(flops, t["median_ms"]))
        del qt, rt, st
    del records, cache, rows, slots
    return res


def bench_dense(cp, cpsparse, scale):
    reqs, length, heads = 4, 1024, 128
    tokens = reqs * length
    cp.random.seed(10)
    q = cp.random.standard_normal((tokens, heads, D_QK), dtype=cp.float32).astype(cp.float16)
    kv = cp.random.standard_normal((tokens, D_QK), dtype=cp.float32).astype(cp.float16)
    cu = cp.arange(0, tokens + 1, length, dtype=cp.int32)
    pairs = reqs * length * (length + 1) // 2
    flops = 2.0 * heads * pairs * (D_QK + D_V)
    t = timing.time_cuda(lambda: cpsparse.dense_mla_attention(q, kv, scale, cu_seqlens_q=cu,
                                                              cu_seqlens_k=cu),
                         warmup=2, iters=10)
    return {"workload": f"dense causal {reqs} x {length} tokens H={heads} (fp16 in)",
            "flops": flops, "op": dict(t, tflops=_tflops(flops, t["median_ms"]))}


def main(argv=None):
    cp = harness.cupy()
    torch = harness.torch_or_none()
    import cpsparse
    from cpsparse.attention import softmax_scale
    from cpsparse.raw_kernels import attention as katt
    cpsparse.set_device_value_checks(False)
    scale = softmax_scale(128, 64)
    payload = {"info": harness.device_info(),
               "what": "times: cpsparse.timing dicts (median_ms, p10_ms, p90_ms, iters); "
                       "'kernel' is the one attention kernel launched alone (a dict by "
                       "variant before issue 13, when the kernel had variants; "
                       "'variant_default' and the per-variant entries are gone)"}
    payload["bf16_gemm_tflops"] = timing.bf16_gemm_tflops()
    for key, fn in (("prefill", bench_prefill), ("decode", bench_decode),
                    ("dense", bench_dense)):
        try:
            payload[key] = (fn(cp, cpsparse, scale) if key == "dense"
                            else fn(cp, torch, katt, cpsparse, scale))
        except Exception as exc:  # noqa: BLE001 - record it, keep the other workloads
            payload[key] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{key}: {payload[key]['error']}")
        cp.get_default_memory_pool().free_all_blocks()
        if torch is not None:
            torch.cuda.empty_cache()
    payload["targets"] = {"prefill_speedup_vs_torch": 3.0, "decode_tflops": 250.0,
                          "flashmla_prefill_tflops": 656.0, "flashmla_decode_tflops": 364.0}
    harness.write_results("attention", payload)

    rows = []
    for key in ("prefill", "decode"):
        r = payload[key]
        if "error" in r:
            continue
        peer = r.get("torch_peer")
        for what in ("kernel", "op"):
            t = r[what]
            rows.append({"workload": key, "what": what, "ms": t["median_ms"],
                         "p10-p90": [t["p10_ms"], t["p90_ms"]], "TFLOP/s": t["tflops"],
                         "vs torch": peer["median_ms"] / t["median_ms"] if peer else None})
        if peer:
            rows.append({"workload": key, "what": "torch peer", "ms": peer["median_ms"],
                         "p10-p90": [peer["p10_ms"], peer["p90_ms"]],
                         "TFLOP/s": peer["tflops"], "vs torch": 1.0})
    if "op" in payload["dense"]:
        d = payload["dense"]["op"]
        rows.append({"workload": "dense", "what": "op", "ms": d["median_ms"],
                     "p10-p90": [d["p10_ms"], d["p90_ms"]], "TFLOP/s": d["tflops"],
                     "vs torch": None})
    print(f"bf16 GEMM: {payload['bf16_gemm_tflops']} TFLOP/s")
    print("spot checks:", {k: payload[k].get("spot_check") for k in ("prefill", "decode")})
    if "local_to_global_slots" in payload["decode"]:
        print("local_to_global_slots 256x2048:",
              round(payload["decode"]["local_to_global_slots"]["median_ms"], 4), "ms")
    harness.print_table(rows, ["workload", "what", "ms", "p10-p90", "TFLOP/s", "vs torch"])
    return payload


if __name__ == "__main__":
    main()
