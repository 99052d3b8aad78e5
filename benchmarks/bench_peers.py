"""cpsparse beside its peers: same process, same input bytes (docs/performance.md).

Run on the GPU machine from the repository root, the peers' build started first
(shared/peers/README.md; the script waits up to ``--wait`` s for ``<peers-dir>/built``)::

    setsid bash .peers/build.sh .peers/peers.tar.xz /tmp/peers > /tmp/peers.log 2>&1 &
    python3 -m benchmarks.bench_peers [--only PREFIX ...] [--quick] [--list] [--fresh]

``--only`` keeps the workloads whose name starts with a prefix. The torch.topk rows run
first (no build needed). The process re-executes itself once with ``LD_PRELOAD`` = the
system libstdc++ (DeepGEMM's JIT needs it) and puts ``<peers-dir>/{DeepGEMM,FlashMLA}``
on ``sys.path``; a peer that does not load leaves the cpsparse side measured and says why.

Peers: FlashMLA (sparse decode over the same MLAKVCache bytes, sparse prefill), DeepGEMM
(prefill and paged indexer logits over the same IndexerKCache bytes), torch.topk, and
their chain for a decode step. Arrays are shared zero-copy by DLPack; CuPy has no
bfloat16, so MLA queries/rows are float16 holding bf16-exact values, the peer reads them
as bf16 (the same numbers). Timing is cpsparse.timing only: ``*_ms`` = the public call,
eager (CUDA events, host included); ``*_kernel_ms`` = the same call captured in a CUDA
graph and replayed, per call; medians with p10/p90 over rotating input sets. The peers'
schedules (DeepGEMM paged metadata, FlashMLA tile schedule) are made once per workload,
untimed, as vLLM does once per step. ``speedup = peer_ms / cpsparse_ms``. Cross-checks
on set 0, cpsparse's output poisoned first: MLA out and lse (natural log both), indexer
logits (equal on the window, same -inf mask: 0.0 expected), top-k (same multiset of
selected values per row). Writes benchmarks/results/peers.json and $OUT/peers.json,
merged by workload with the rows already there for the same device unless ``--fresh``.
"""

import argparse
import datetime
import importlib
import json
import os
import pathlib
import statistics
import sys
import time

import numpy

from benchmarks import harness
from cpsparse import timing
from cpsparse.paging import decode_row_ends
from cpsparse.reference import fp4, fp8

K, BS, D, H_IDX, D_QK, D_V, RECORD = 2048, 64, 128, 64, 576, 512, 656
LIBSTDCXX = "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
TOPK_VARIANTS = ("", "_shift100", "_scale1e-8", "_low10bits")
METHOD = ("cpsparse.timing: *_ms public call eager (CUDA events, host included, "
          "time_cuda/time_torch); *_kernel_ms the same call captured in a CUDA graph "
          "(time_graph/time_graph_torch), per call; medians, p10/p90 over rotating sets; "
          "timed once the peers' build has finished")


# ---- the workloads (the names of the peer protocol) ------------------------------

def workloads():
    """Every workload: dicts with name, kind, peer and the sizes (no device needed)."""
    out = []
    # "_bf16io": FlashMLA's dtypes on cpsparse's side too: bfloat16 q (and prefill rows)
    # in, a bfloat16 out (CuPy >= 14); the plain rows: float16 in, float32 out.
    for io in ("", "_bf16io"):
        for b, sq, h in ((1, 1, 128), (8, 1, 128), (128, 1, 128), (128, 2, 128), (64, 2, 64)):
            out.append(dict(name=f"mla_decode_B{b}_sq{sq}_H{h}{io}", kind="mla_decode",
                            peer="flashmla", B=b, s_q=sq, H=h, ctx=32768, io=io[1:]))
    for h in (64, 128):                                   # issue 19: DeepSeek-V4's cache
        for k in (512, 1024):
            out.append(dict(name=f"mla_model1_decode_B128_H{h}_topk{k}_w128",
                            kind="mla_model1_decode", peer="flashmla", B=128, s_q=1, H=h,
                            topk=k, window=128, ctx=32768))
    for io in ("", "_bf16io"):
        for t, h in ((4096, 128), (4096, 64)):
            out.append(dict(name=f"mla_prefill_T{t}_H{h}{io}", kind="mla_prefill",
                            peer="flashmla", T=t, H=h, S=8192, io=io[1:]))
    for t, s in ((8192, 8192), (2048, 65536), (4096, 4096)):
        out.append(dict(name=f"indexer_prefill_T{t}_S{s}", kind="indexer_prefill",
                        peer="deepgemm", T=t, S=s))
    for b, c, n in ((64, 32768, 1), (64, 32768, 2), (256, 4096, 1), (4, 131072, 1),
                    (1, 32768, 1)):
        out.append(dict(name=f"indexer_decode_B{b}_ctx{c}_n{n}", kind="indexer_decode",
                        peer="deepgemm", B=b, ctx=c, next_n=n))
    for b, c, n in ((64, 32768, 1), (64, 32768, 2), (4, 131072, 1)):
        out.append(dict(name=f"indexer_decode_B{b}_ctx{c}_n{n}_mxfp4", kind="indexer_decode",
                        peer="deepgemm", B=b, ctx=c, next_n=n, keys="mxfp4"))
    for b, c, n in ((64, 65536, 1), (64, 65536, 2)):   # issue 16: mixed context lengths
        out.append(dict(name=f"indexer_decode_B{b}_ctx{c}_n{n}_mixed", kind="indexer_decode",
                        peer="deepgemm", B=b, ctx=c, next_n=n, lens="mixed"))
    shapes = [("prefill", 8192, 8192)] + [("decode", r, c) for r, c in
                                          ((64, 32768), (64, 131072), (4, 131072), (1, 131072))]
    for variant in TOPK_VARIANTS:
        for mode, r, c in shapes:
            base = (f"topk_prefill_{r}x{c}_causal" if mode == "prefill"
                    else f"topk_decode_{r}x{c}")
            out.append(dict(name=base + variant, kind="topk", peer="torch.topk", mode=mode,
                            rows=r, width=c, variant=variant))
    for b, n in ((1, 1), (8, 1), (64, 1), (128, 2)):
        out.append(dict(name=f"decode_step_B{b}_ctx32768" + (f"_n{n}" if n > 1 else ""),
                        kind="decode_step", peer="vllm-stack", B=b, ctx=32768, next_n=n))
    return out


def row_names():
    """Every row name, in report order (a decode_step workload also has an _eager row)."""
    return [n for w in workloads() for n in _names(w)]


def _names(w):
    return [w["name"]] + ([w["name"] + "_eager"] if w["kind"] == "decode_step" else [])


def select(prefixes=None):
    """The workloads whose name (or _eager row name) starts with one of ``prefixes``."""
    return [w for w in workloads()
            if not prefixes or any(n.startswith(p) for n in _names(w) for p in prefixes)]


# ---- rows and the results file ---------------------------------------------------------

def make_row(name, peer, shapes, ours=None, ours_kernel=None, theirs=None, theirs_kernel=None,
             err=None, check=None, notes=(), flops=None, nbytes=None, peer_unavailable=None):
    """One results row from timing dicts (``{"median_ms", "p10_ms", "p90_ms", "iters"}``)."""
    row = {"workload": name, "peer": peer, "shapes": dict(shapes),
           "date": datetime.date.today().isoformat()}
    for key, t in (("cpsparse", ours), ("cpsparse_kernel", ours_kernel), ("peer", theirs),
                   ("peer_kernel", theirs_kernel)):
        for stat, suffix in (("median_ms", "_ms"), ("p10_ms", "_p10_ms"), ("p90_ms", "_p90_ms")):
            row[key + suffix] = t[stat] if t else None
        row[key + "_iters"] = t["iters"] if t else None
    for key, num, den in (("speedup", "peer_ms", "cpsparse_ms"),
                          ("kernel_speedup", "peer_kernel_ms", "cpsparse_kernel_ms")):
        row[key] = row[num] / row[den] if row[num] is not None and row[den] else None
    row["max_rel_err_vs_peer"] = err
    for key in ("cpsparse_kernel", "peer_kernel"):
        ms = row[key + "_ms"]
        if flops and ms:
            row[key + "_tflops"] = flops / (ms * 1e-3) / 1e12
        if nbytes and ms:
            row[key + "_tbs"] = nbytes / (ms * 1e-3) / 1e12
    if check is not None:
        row["check"] = check
    if peer_unavailable:
        row["peer_unavailable"] = peer_unavailable
    notes = [n for n in notes if n]
    if notes:
        row["notes"] = notes
    return row


def merge_payload(old, new):
    """``new`` with the rows of ``old`` (same device) whose workload ``new`` did not run."""
    rows = list(new["rows"])
    same = bool(old) and old.get("device") == new.get("device")
    if same:
        have = {r["workload"] for r in rows}
        rows += [r for r in old.get("rows", []) if r.get("workload") not in have]
    order = {n: i for i, n in enumerate(row_names())}
    rows.sort(key=lambda r: order.get(r["workload"], len(order)))
    runs = (old.get("runs", []) if same else []) + [
        {"date": new.get("date"), "command": new.get("command"),
         "workloads": [r["workload"] for r in new["rows"]]}]
    return dict(new, rows=rows, runs=runs[-20:])


# ---- inputs (CuPy; random, never zeros) ------------------------------------------------

def _codes(cp, shape):
    """Random e4m3 codes with exponent field <= 10: |v| <= 15, never a NaN code."""
    c = cp.random.randint(0, 256, size=shape, dtype=cp.int32).astype(cp.uint8)
    return cp.where(((c >> 3) & 0xF) > 10, c & 0xD7, c).astype(cp.uint8)


def _bf16_f16(cp, shape, scale=1.0):
    """float16 normals holding bf16-exact values (so bf16(x) == x on the peer side)."""
    x = cp.random.standard_normal(shape, dtype=cp.float32) * cp.float32(scale)
    b = x.view(cp.uint32)
    b = (b + ((b >> 16) & cp.uint32(1)) + cp.uint32(0x7FFF)) & cp.uint32(0xFFFF0000)
    return b.view(cp.float32).astype(cp.float16)


def _ue8m0_scales(cp, shape):
    """Powers of two in [2**-10, 2**-6]: the ue8m0 key scales DeepSeek-V3.2's indexer
    cache stores (``scale_fmt="ue8m0"``). A product by them is exact in any order, so
    the logits of both sides can agree bit for bit."""
    e = cp.random.randint(-10, -5, size=shape, dtype=cp.int32)
    return cp.ldexp(cp.ones(shape, dtype=cp.float32), e).astype(cp.float32)


def _fill_indexer(cp, data, chunk=4096):
    """Pages of random codes and positive float32 scales (vLLM layout)."""
    for p0 in range(0, data.shape[0], chunk):
        p1 = min(data.shape[0], p0 + chunk)
        data[p0:p1, :BS * D] = _codes(cp, (p1 - p0, BS * D))
        sc = _ue8m0_scales(cp, (p1 - p0, BS))
        data[p0:p1, BS * D:] = sc.view(cp.uint8)


def _fill_indexer_mxfp4(cp, fp4_data, fp8_data, chunk=4096):
    """The same random keys as MXFP4 pages and as fp8 pages: random e2m1 codes, one
    ue8m0 exponent a key (in [2**-10, 2**-6], repeated over its 4 groups), so the fp8
    key (code as e4m3, float32 scale 2**e) is exactly the MXFP4 key and both sides'
    logits can agree to the rounding of their fp32 sums."""
    # e4m3 bytes of the 8 e2m1 magnitudes
    lut = cp.asarray(fp8.e4m3_encode(cp.asarray(fp4.E2M1_VALUES, dtype=cp.float32)))
    for p0 in range(0, fp4_data.shape[0], chunk):
        p1 = min(fp4_data.shape[0], p0 + chunk)
        n = (p1 - p0) * BS
        packed = cp.random.randint(0, 256, size=(n, D // 2), dtype=cp.int32).astype(cp.uint8)
        expo = cp.random.randint(117, 122, size=n, dtype=cp.int32).astype(cp.uint8)
        fp4_data[p0:p1, :BS * D // 2] = packed.reshape(p1 - p0, -1)
        fp4_data[p0:p1, BS * D // 2:] = cp.repeat(expo, 4).reshape(p1 - p0, -1)
        nib = cp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, D)
        codes = lut[(nib & 7).astype(cp.int32)] | ((nib & 8) << 4).astype(cp.uint8)
        codes = cp.where((nib & 7) == 0, cp.uint8(0), codes)       # no -0: e2m1 has none
        fp8_data[p0:p1, :BS * D] = codes.reshape(p1 - p0, -1)
        scale = cp.ldexp(cp.ones(n, cp.float32), expo.astype(cp.int32) - 127)
        fp8_data[p0:p1, BS * D:] = scale.astype(cp.float32).view(cp.uint8).reshape(p1 - p0, -1)


def _copy_tbs(s):
    """Device-to-device copy bandwidth of this run (TB/s, read + write bytes): the
    ceiling a memory-bound kernel is held to. Measured once per run."""
    if getattr(s, "copy_tbs", None) is None:
        cp = s.cp
        a = cp.empty(1 << 31, cp.uint8)
        b = cp.empty_like(a)
        t = timing.time_cuda(lambda: b.__setitem__(Ellipsis, a), warmup=3, iters=20)
        s.copy_tbs = 2 * a.nbytes / (t["median_ms"] * 1e-3) / 1e12
        del a, b
    return s.copy_tbs


def _fill_mla(cp, records, chunk=1 << 19):
    """Valid fp8_ds_mla records: codes, 4 positive float32 scales, 64 bf16 RoPE values."""
    for s0 in range(0, records.shape[0], chunk):
        r = records[s0:min(records.shape[0], s0 + chunk)]
        n = r.shape[0]
        r[:, :512] = _codes(cp, (n, 512))
        r[:, 512:528] = cp.random.uniform(0.002, 0.02, (n, 4), dtype=cp.float32).view(cp.uint8)
        rope = cp.random.standard_normal((n, 64), dtype=cp.float32) * cp.float32(0.5)
        r[:, 528:] = (rope.view(cp.uint32) >> 16).astype(cp.uint16).view(cp.uint8)


def _fill_model1(cp, cache, chunk=2048):
    """Valid MODEL1 pages: e4m3 codes, ue8m0 scale bytes in [2**-10, 2**-1], zero pad,
    64 bf16 RoPE values a token."""
    from cpsparse.reference import cache as cache_ref
    nope, rope_dim = cache_ref.MODEL1_NOPE, cache_ref.MODEL1_ROPE
    groups = cache_ref.MODEL1_SCALES                       # scale bytes, then 1 pad byte
    rows, scales = cache_ref._model1_views(cache.data, cache.block_size)
    bs = cache.block_size
    for p0 in range(0, rows.shape[0], chunk):
        p1 = min(rows.shape[0], p0 + chunk)
        n = (p1 - p0) * bs
        rows[p0:p1, :, :nope] = _codes(cp, (n, nope)).reshape(p1 - p0, bs, nope)
        rope = cp.random.standard_normal((n, rope_dim), dtype=cp.float32) * cp.float32(0.5)
        rows[p0:p1, :, nope:] = (rope.view(cp.uint32) >> 16).astype(cp.uint16).view(
            cp.uint8).reshape(p1 - p0, bs, 2 * rope_dim)
        scales[p0:p1, :, :groups] = cp.random.randint(117, 127, (p1 - p0, bs, groups),
                                                      dtype=cp.int32).astype(cp.uint8)
        scales[p0:p1, :, groups] = 0


def _positions(cp, rows, width, k):
    """k distinct random positions in [0, width) per row, int32 [rows, k]."""
    return cp.argsort(cp.random.random((rows, width), dtype=cp.float32),
                      axis=1)[:, :k].astype(cp.int32)


def _rows_lens(cp, longest, n):
    """2-D context lengths [B, next_n] of requests whose longest row sees ``longest[b]``
    positions: row (b, j) sees < L_b - n + j + 1 (cpsparse.paging.decode_row_ends)."""
    rows = decode_row_ends(numpy.asarray(longest), n).reshape(len(longest), n)
    return cp.asarray(rows.astype(numpy.int32))


def _decode_lens(cp, b, ctx, n):
    """2-D context lengths [B, next_n]: row (b, j) sees positions < ctx - n + j + 1."""
    return _rows_lens(cp, numpy.full(b, ctx), n)


def _mixed_decode_lens(cp, b, ctx, n, seed=16):
    """2-D context lengths [B, next_n] of a mixed batch: request b's longest row sees L_b
    positions, L_b uniform in [n, ctx] (a fixed seed: every run the same batch)."""
    return _rows_lens(cp, numpy.random.default_rng(seed).integers(n, ctx + 1, size=b), n)


def _poison_pool(cp, nbytes):
    """Empty CuPy's pool, then leave one 0xFF (NaN) block there larger than the outputs
    (``nbytes``) plus a margin: what the op allocates next is carved from poison, not
    from a block that still holds an earlier (correct) result."""
    cp.get_default_memory_pool().free_all_blocks()
    junk = cp.full(int(sum(nbytes)) + (64 << 20), 0xFF, dtype=cp.uint8)
    del junk


# ---- cross-checks ------------------------------------------------------------------------

def _rel(cp, ours, theirs):
    """max |ours - theirs| / max |theirs| over the entries finite in both."""
    if not ours.size:
        return 0.0
    fin = cp.isfinite(ours) & cp.isfinite(theirs)
    a, b = cp.where(fin, ours, 0), cp.where(fin, theirs, 0)
    diff, scale = float(cp.abs(a - b).max()), float(cp.abs(b).max())
    return diff / scale if scale > 0 else diff


def _mla_check(cp, out, lse, p_out, p_lse):
    out = out.astype(cp.float32, copy=False)          # a bfloat16 out (the _bf16io rows)
    out_rel, lse_rel = _rel(cp, out, p_out), _rel(cp, lse, p_lse)
    lse_abs = float(cp.abs(lse - p_lse).max())
    bad = int((~cp.isfinite(out)).sum() + (~cp.isfinite(lse)).sum())
    return max(out_rel, lse_rel), {"out_rel_err": out_rel, "lse_rel_err": lse_rel,
                                   "lse_max_abs_err": lse_abs, "nonfinite_ours": bad,
                                   "ok": bad == 0 and out_rel < 5e-2 and lse_abs < 5e-2}


def _logits_check(cp, ours, theirs, visible=None, ours_clean=True):
    """Prefill (``visible`` None): the same -inf mask and equal finite values. Decode:
    the peer writes only the window (clean_logits=False), cpsparse -inf elsewhere
    (``ours_clean`` False: cpsparse's call was clean_logits=False too, and only the
    windows are compared)."""
    neg_o, neg_p = cp.isneginf(ours), cp.isneginf(theirs)
    if visible is None:
        mask_bad, both = int((neg_o != neg_p).sum()), ~neg_o & ~neg_p
    else:
        mask_bad = int((visible & (neg_o != neg_p)).sum())
        if ours_clean:
            mask_bad += int((~visible & ~neg_o).sum())
        both = visible & ~neg_o & ~neg_p
    unequal = int((both & (ours != theirs)).sum())
    z = cp.float32(0)
    err = _rel(cp, cp.where(both, ours, z), cp.where(both, theirs, z))
    nan = int((cp.isnan(ours) if visible is None or ours_clean
               else cp.isnan(ours) & visible).sum())
    return err, {"mask_mismatches": mask_bad, "unequal_entries": unequal, "nan_ours": nan,
                 "ok": mask_bad == 0 and nan == 0 and err == 0.0}


def _topk_check(cp, logits, lens, ours, peer_vals):
    """Per row: valid entries first, in the window, distinct, and the same multiset of
    selected values as the peer's (ties at the threshold may pick other positions)."""
    m, k = ours.shape
    col = cp.arange(k, dtype=cp.int32)[None, :]
    valid = ours >= 0
    layout = int((valid != (col < cp.minimum(lens, k)[:, None])).any(axis=1).sum())
    outside = int((valid & (ours >= lens[:, None])).any(axis=1).sum())
    srt = cp.sort(cp.where(valid, ours, -1 - col), axis=1)
    dup = int(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(axis=1).sum())
    safe = cp.where(valid & (ours < logits.shape[1]), ours, 0)
    vals = cp.where(valid, cp.take_along_axis(logits, safe, axis=1), cp.float32(-cp.inf))
    a, b = -cp.sort(-vals, axis=1), -cp.sort(-peer_vals, axis=1)
    rows_bad = int((a != b).any(axis=1).sum())
    err = _rel(cp, a, b)
    return err, {"rows": m, "rows_value_mismatch": rows_bad, "rows_bad_layout": layout,
                 "rows_out_of_window": outside, "rows_duplicate": dup,
                 "ok": rows_bad == layout == outside == dup == 0}


# ---- session: backends, peers, timing ----------------------------------------------------

class Session:
    def __init__(self, args):
        self.cp = harness.cupy()
        import cpsparse
        self.cps = cpsparse
        cpsparse.set_device_value_checks(False)
        self.iters, self.giters = (10, 6) if args.quick else (30, 15)
        self.dir = pathlib.Path(args.peers_dir)
        self.wait_s, self.no_peers = args.wait, args.no_peers
        self.peer_first, self.rounds = args.peer_first, args.rounds
        self.torch = None if args.no_peers else timing.torch_or_none()
        self.mods, self.why, self.built, self._waited = {}, {}, None, False

    def peer(self, name):
        """The module ``torch``, ``deep_gemm`` or ``flash_mla``, or None (see ``why``)."""
        if name not in self.mods:
            mod, why = None, None
            if self.no_peers:
                why = "--no-peers"
            elif self.torch is None:
                why = "torch with a CUDA device is not importable"
            elif name == "torch":
                mod = self.torch
            else:
                why = self._wait_built()
                if why is None:
                    try:
                        mod = importlib.import_module(name)
                    except Exception as exc:  # noqa: BLE001 - the row says why
                        why = f"import {name}: {type(exc).__name__}: {str(exc)[:300]}"
            self.mods[name] = mod
            if why:
                self.why[name] = why
                print(f"peer {name} unavailable: {why}", flush=True)
        return self.mods[name]

    def _wait_built(self):
        if not self._waited:
            self._waited = True
            flag, t0 = self.dir / "built", time.time()
            if not flag.exists():
                print(f"waiting up to {self.wait_s:.0f} s for {flag} (peers' build.sh)",
                      flush=True)
            while not flag.exists() and time.time() - t0 < self.wait_s:
                if time.time() - t0 > 15 and not self.dir.exists():
                    break                                   # no build was started
                time.sleep(2)
            self.built = flag.read_text()[:1000] if flag.exists() else None
            for sub in ("FlashMLA", "DeepGEMM"):
                path = str(self.dir / sub)
                if (self.dir / sub).is_dir() and path not in sys.path:
                    sys.path.insert(0, path)
        return None if self.built is not None else \
            f"{self.dir / 'built'} absent after {self.wait_s:.0f} s"

    def time(self, fn, inputs, reps, torch_clock=False):
        """(eager, graph or None, note) of ``fn`` over the rotating ``inputs``."""
        eager_t, graph_t = ((timing.time_torch, timing.time_graph_torch) if torch_clock
                            else (timing.time_cuda, timing.time_graph))
        eager = eager_t(fn, inputs, warmup=3, iters=self.iters)
        try:
            graph, note = graph_t(fn, inputs, reps=reps, iters=self.giters), None
        except Exception as exc:  # noqa: BLE001 - report it, keep the eager time
            graph = None
            note = f"{'peer' if torch_clock else 'cpsparse'} graph capture failed: " \
                   f"{type(exc).__name__}: {str(exc)[:200]}"
        self.sync()
        return eager, graph, note

    def sync(self):
        self.cp.cuda.Device().synchronize()
        if self.torch is not None:
            self.torch.cuda.synchronize()

    def free(self):
        self.sync()
        self.cp.get_default_memory_pool().free_all_blocks()
        if self.torch is not None:
            self.torch.cuda.empty_cache()


def _t2c(s, tensor):
    """A torch tensor as a CuPy array (float32 first when CuPy lacks its dtype)."""
    if tensor.dtype in (s.torch.bfloat16, s.torch.float16):
        tensor = tensor.float()
    return s.cp.from_dlpack(tensor.contiguous())


# ---- runners: one per kind, each returns rows ----------------------------------------------

def _pool(runs):
    """One timing dict from several rounds' (``{"median_ms", "p10_ms", "p90_ms",
    "iters"}``): the median of the rounds' medians, the lowest p10 and the highest p90,
    the iterations summed. A single round is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    return dict(runs[0], median_ms=float(statistics.median(t["median_ms"] for t in runs)),
                p10_ms=min(t["p10_ms"] for t in runs), p90_ms=max(t["p90_ms"] for t in runs),
                iters=sum(t["iters"] for t in runs))


def _pooled(runs):
    """(eager, graph or None, note) pooled over the rounds of :meth:`Session.time`."""
    if not runs:
        return None, None, None
    graphs = [g for _, g, _ in runs]
    notes = [n for _, _, n in runs if n]
    return (_pool([e for e, _, _ in runs]),
            _pool(graphs) if all(g is not None for g in graphs) else None,
            notes[0] if notes else None)


def _side_by_side(s, call, sets, reps, poison, peer_names, make_peer):
    """Time cpsparse's ``call`` over ``sets``, run it once on set 0 after poisoning (a
    callable, or the output sizes in bytes for :func:`_poison_pool`);
    then, when every peer module of ``peer_names`` loads, ``make_peer(*modules)`` gives
    (peer call, its sets, compare(ours_out, peer_out) -> (err, check)); the peer is
    cross-checked on set 0 (its first call: JIT, schedules) and timed.

    The order of the two sides moves compute-bound rows (the side timed first reads ~5%
    faster on the H200's large prefill rows: docs/performance.md). ``s.peer_first``
    (``--peer-first``) times the peer first; ``s.rounds`` (``--rounds N``, N > 1) times
    both sides N times, alternating which goes first (cpsparse, peer, peer, cpsparse,
    ...: ABBA for 2), each side's figures pooled (:func:`_pool`), the rounds' kernel
    medians in the notes. Either way the peer is made before the first timing and
    cross-checked after (a peer that fails the cross-check or a later round reports no
    time); by default (one round, cpsparse first) its module is loaded, and it is made,
    cross-checked and timed, after cpsparse's side. Returns the make_row arguments."""
    rounds = max(1, int(s.rounds))
    ordered = s.peer_first or rounds > 1
    mods = [s.peer(n) for n in peer_names] if ordered else None
    early = ordered and all(m is not None for m in mods)     # the peer made before timing
    err = check = pnote = None
    peer = None
    if early:
        try:
            peer = make_peer(*mods)
        except Exception as exc:  # noqa: BLE001 - keep cpsparse's side, say why
            pnote = f"peer error: {type(exc).__name__}: {str(exc)[:400]}"
    ours_runs, peer_runs = [], []
    for r in range(rounds):
        order = ("peer", "ours") if (r % 2 == 1) != s.peer_first else ("ours", "peer")
        for side in order:
            if side == "ours":
                ours_runs.append(s.time(call, sets, reps))
            elif peer is not None:
                try:
                    peer_runs.append(s.time(peer[0], peer[1], reps, torch_clock=True))
                except Exception as exc:  # noqa: BLE001 - keep cpsparse's side, say why
                    pnote, peer = f"peer error: {type(exc).__name__}: {str(exc)[:400]}", None
    if callable(poison):
        poison()
    else:
        _poison_pool(s.cp, poison)
    got = call(*sets[0])
    if not ordered:
        mods = [s.peer(n) for n in peer_names]
    try:
        if peer is not None or (not ordered and all(m is not None for m in mods)):
            pcall, tsets, compare = peer if peer is not None else make_peer(*mods)
            err, check = compare(got, pcall(*tsets[0]))
            del got
            s.sync()
            if not early:
                peer_runs.append(s.time(pcall, tsets, reps, torch_clock=True))
    except Exception as exc:  # noqa: BLE001 - keep cpsparse's side, say why
        pnote = f"peer error: {type(exc).__name__}: {str(exc)[:400]}"
    if pnote:
        peer_runs = []          # timed before a failed cross-check or round: not reported
    ours, ours_k, note = _pooled(ours_runs)
    theirs, theirs_k, tnote = _pooled(peer_runs)
    notes = [note, pnote or tnote]
    if rounds > 1:
        def medians(runs):
            return [round((g or e)["median_ms"], 5) for e, g, _ in runs]
        first = ["peer" if (r % 2 == 1) != s.peer_first else "cpsparse" for r in range(rounds)]
        notes.append(f"{rounds} rounds, timed first by round: {', '.join(first)}; kernel "
                     f"medians ms a round: cpsparse {medians(ours_runs)}"
                     + (f", peer {medians(peer_runs)}" if peer_runs else ""))
    why = "; ".join(s.why[n] for n in peer_names if n in s.why) or None
    return dict(ours=ours, ours_kernel=ours_k, theirs=theirs, theirs_kernel=theirs_k, err=err,
                check=check, notes=notes, peer_unavailable=why)


def _flashmla_decode(s, fm, cache, scale):
    """FlashMLA's sparse decode on the bytes of ``cache``: fn(q [B, s_q, H, 576] bf16,
    slots [B, s_q, topk] int32) -> (out, lse [B, H, s_q]); one tile schedule, made by the
    first call and reused (same shapes, no topk_length)."""
    torch, nb = s.torch, cache.num_blocks
    tk = torch.from_dlpack(cache.data).view(torch.float8_e4m3fn).view(nb, BS, 1, RECORD)
    meta = fm.get_mla_metadata()[0]
    return lambda q, sl: fm.flash_mla_with_kvcache(q, tk, None, None, D_V, meta, None,
                                                   softmax_scale=scale, causal=False,
                                                   is_fp8_kvcache=True, indices=sl)


def _flashmla_compare(s, decode):
    """compare((out, lse), FlashMLA's (out, lse)); decode lse is [B, H, s_q]."""
    def compare(ours, theirs):
        (out, lse), (p_out, p_lse) = ours, (theirs[0], theirs[-1])
        t, h = lse.shape
        p_lse = p_lse.permute(0, 2, 1) if decode else p_lse
        return _mla_check(s.cp, out, lse, _t2c(s, p_out.reshape(t, h, D_V)),
                          _t2c(s, p_lse.reshape(t, h)))
    return compare


def mla_decode_inputs(cp, cps, b, sq, h, ctx, topk=K, q_dtype=None, n_sets=2):
    """The inputs of an ``mla_decode_*`` workload: an fp8_ds_mla cache of ``b`` requests
    of ``ctx`` tokens on shuffled pages (valid records), and ``n_sets`` pairs (q
    [b * sq, h, 576] of bf16-exact float16 values, or ``q_dtype``; global slots of
    ``topk`` distinct positions a row)."""
    t, pages = b * sq, ctx // BS
    cache = cps.MLAKVCache(b * pages, BS, 512, 64, xp=cp)
    _fill_mla(cp, cache.records())
    table = cp.random.permutation(b * pages).astype(cp.int32).reshape(b, pages)
    req = cp.repeat(cp.arange(b, dtype=cp.int32), sq)
    sets = []
    for _ in range(n_sets):
        q = _bf16_f16(cp, (t, h, D_QK))
        sets.append((q if q_dtype is None else q.astype(q_dtype),
                     cps.local_to_global_slots(_positions(cp, t, ctx, topk), req, table, BS)))
    return cache, sets


def _io(s, w, sets):
    """(cpsparse's sets, out_dtype, out bytes a value, the shapes' dtype note) of an MLA
    workload: its float16 sets as they are and a float32 out, or for a ``_bf16io`` row
    the same values as CuPy bfloat16 arrays (exact: they are bf16 values) and a bfloat16
    out, FlashMLA's dtypes."""
    if w.get("io") != "bf16io":
        return sets, None, 4, "bf16 values as float16 to cpsparse, float32 out"
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16
    conv = [tuple(a.astype(bf16) if a.dtype == s.cp.float16 else a for a in x) for x in sets]
    return conv, "bfloat16", 2, "bfloat16 in and out on both sides"


def run_mla_decode(s, w):
    cp, cps, torch = s.cp, s.cps, s.torch
    b, sq, h, ctx = w["B"], w["s_q"], w["H"], w["ctx"]
    t = b * sq
    cache, sets = mla_decode_inputs(cp, cps, b, sq, h, ctx)
    scale = cps.softmax_scale(128, 64)
    ours, out_dtype, out_bytes, dtypes = _io(s, w, sets)

    def make_peer(fm):
        tsets = [(torch.from_dlpack(q).to(torch.bfloat16).view(b, sq, h, D_QK),
                  torch.from_dlpack(sl).view(b, sq, K)) for q, sl in sets]
        return _flashmla_decode(s, fm, cache, scale), tsets, _flashmla_compare(s, True)
    got = _side_by_side(s, lambda q, sl: cps.sparse_mla_attention(q, cache, sl, scale,
                                                                  out_dtype=out_dtype),
                        ours, 10, [t * h * D_V * out_bytes, t * h * 4], ["flash_mla"],
                        make_peer)
    shapes = dict(B=b, s_q=sq, H=h, topk=K, ctx=ctx, cache="fp8_ds_mla", dtype=dtypes)
    return [make_row(w["name"], w["peer"], shapes, flops=2.0 * t * h * K * (D_QK + D_V), **got)]


def _model1_view(s, cache):
    """FlashMLA's [num_blocks, block_size, 1, 584] float8 view of a MODEL1 cache's pages."""
    torch, nb, bs = s.torch, cache.num_blocks, cache.block_size
    pages = torch.from_dlpack(cache.data).view(torch.float8_e4m3fn)
    return pages.as_strided((nb, bs, 1, 584), (pages.stride(0), 584, 584, 1))


def mla_model1_inputs(cp, cps, b, h, k, win, ctx, n_sets=2):
    """The inputs of an ``mla_model1_decode_*`` workload: a MODEL1 cache of ``b``
    requests of ``ctx`` tokens on shuffled pages, a window cache of ``win`` tokens a
    request (slots ``win * r .. win * r + win - 1``), and ``n_sets`` pairs (q [b, h, 512]
    of bf16-exact float16 values, global slots of ``k`` distinct positions a row).
    Returns (cache, window, window slots [b, win], sets)."""
    pages = ctx // BS
    cache = cps.MLAKVCache(b * pages, BS, layout="model1", xp=cp)
    window = cps.MLAKVCache(b * win // BS, BS, layout="model1", xp=cp)
    _fill_model1(cp, cache)
    _fill_model1(cp, window)
    table = cp.random.permutation(b * pages).astype(cp.int32).reshape(b, pages)
    req = cp.arange(b, dtype=cp.int32)
    w_slots = (win * req[:, None] + cp.arange(win, dtype=cp.int32)[None, :]).astype(cp.int32)
    sets = [(_bf16_f16(cp, (b, h, 512)),
             cps.local_to_global_slots(_positions(cp, b, ctx, k), req, table, BS))
            for _ in range(n_sets)]
    return cache, window, w_slots, sets


def run_mla_model1_decode(s, w):
    """DeepSeek-V4 decode: a MODEL1 cache of 32K-token requests (top-k slots) and a
    128-token sliding-window cache (its own slots), one softmax over both; the same
    pages and slots for FlashMLA (extra_k_cache / extra_indices_in_kvcache)."""
    cp, cps, torch = s.cp, s.cps, s.torch
    b, h, k, win, ctx = w["B"], w["H"], w["topk"], w["window"], w["ctx"]
    cache, window, w_slots, sets = mla_model1_inputs(cp, cps, b, h, k, win, ctx)
    scale = 512 ** -0.5

    def call(q, sl):
        return cps.sparse_mla_attention(q, cache, sl, scale, extra_kv_cache=window,
                                        extra_indices=w_slots)

    def make_peer(fm):
        tk, tw = _model1_view(s, cache), _model1_view(s, window)
        tws = torch.from_dlpack(w_slots).view(b, 1, win)
        tsets = [(torch.from_dlpack(q).to(torch.bfloat16).view(b, 1, h, 512),
                  torch.from_dlpack(sl).view(b, 1, k)) for q, sl in sets]
        meta = fm.get_mla_metadata()[0]

        def pcall(q, sl):
            return fm.flash_mla_with_kvcache(q, tk, None, None, D_V, meta, None,
                                             softmax_scale=scale, causal=False,
                                             is_fp8_kvcache=True, indices=sl,
                                             extra_k_cache=tw, extra_indices_in_kvcache=tws)
        return pcall, tsets, _flashmla_compare(s, True)
    got = _side_by_side(s, call, sets, 10, [b * h * D_V * 4, b * h * 4], ["flash_mla"],
                        make_peer)
    shapes = dict(B=b, s_q=1, H=h, topk=k, window=win, ctx=ctx, cache="model1")
    return [make_row(w["name"], w["peer"], shapes, flops=2.0 * b * h * (k + win) * (512 + D_V),
                     **got)]


def mla_prefill_inputs(cp, t, h, rows, n_sets=2):
    """kv rows [rows, 576] and (q [t, h, 576], top-k positions [t, K]) sets: bf16 values
    stored as float16 (the mla_prefill rows; benchmarks.profile_attention prefill)."""
    kv = _bf16_f16(cp, (rows, D_QK))
    return kv, [(_bf16_f16(cp, (t, h, D_QK)), _positions(cp, t, rows, K))
                for _ in range(n_sets)]


def run_mla_prefill(s, w):
    cp, cps, torch = s.cp, s.cps, s.torch
    t, h, rows = w["T"], w["H"], w["S"]
    kv, sets = mla_prefill_inputs(cp, t, h, rows)
    scale = cps.softmax_scale(128, 64)
    ours, out_dtype, out_bytes, dtypes = _io(s, w, sets)
    [(ours_kv,)], _, _, _ = _io(s, w, [(kv,)])

    def make_peer(fm):
        tkv = torch.from_dlpack(kv).to(torch.bfloat16).view(rows, 1, D_QK)
        tsets = [(torch.from_dlpack(q).to(torch.bfloat16), torch.from_dlpack(i).view(t, 1, K))
                 for q, i in sets]
        return (lambda q, i: fm.flash_mla_sparse_fwd(q, tkv, i, scale, D_V), tsets,
                _flashmla_compare(s, False))
    got = _side_by_side(s, lambda q, i: cps.sparse_mla_attention(q, ours_kv, i, scale,
                                                                 out_dtype=out_dtype),
                        ours, 2, [t * h * D_V * out_bytes, t * h * 4], ["flash_mla"], make_peer)
    if out_dtype is None:
        got["notes"].append("cpsparse's times include its bf16 pre-pass of the kv rows")
    shapes = dict(T=t, H=h, topk=K, kv_rows=rows, dtype=dtypes)
    return [make_row(w["name"], w["peer"], shapes, flops=2.0 * t * h * K * (D_QK + D_V), **got)]


def run_indexer_prefill(s, w):
    cp, cps, torch = s.cp, s.cps, s.torch
    t, n = w["T"], w["S"]
    ks = cp.zeros(t, cp.int32)
    ke = cp.arange(n - t + 1, n + 1, dtype=cp.int32)          # one request, prefix n - t
    sets = [(_codes(cp, (t, H_IDX, D)), _codes(cp, (n, D)),
             _ue8m0_scales(cp, (n,)),
             cp.random.standard_normal((t, H_IDX), dtype=cp.float32)) for _ in range(2)]
    pairs = t * (n - t) + t * (t + 1) // 2
    raw = {}

    def make_peer(dg):
        f8, tks, tke = torch.float8_e4m3fn, torch.from_dlpack(ks), torch.from_dlpack(ke)
        tsets = [(torch.from_dlpack(q).view(f8), torch.from_dlpack(k).view(f8),
                  torch.from_dlpack(sk), torch.from_dlpack(wt)) for q, k, sk, wt in sets]

        def pcall(q, k, sk, wt, clean=True):
            return dg.fp8_fp4_mqa_logits((q, None), (k, sk), wt, tks, tke, clean_logits=clean)
        raw["eager"], raw["graph"], _ = s.time(lambda *a: pcall(*a, clean=False), tsets, 4,
                                               torch_clock=True)
        return pcall, tsets, lambda o, p: _logits_check(cp, o, _t2c(s, p))
    got = _side_by_side(s, lambda q, k, sk, wt: cps.mqa_logits(q, k, sk, wt, ks, ke), sets, 4,
                        [t * n * 4], ["deep_gemm"], make_peer)
    if raw and got["check"] is not None:
        got["check"]["peer_clean_logits_false_ms"] = raw["eager"]["median_ms"]
        got["check"]["peer_clean_logits_false_kernel_ms"] = \
            raw["graph"]["median_ms"] if raw["graph"] else None
        got["notes"].append("peer with clean_logits=True (-inf outside the windows, as "
                            "cpsparse writes); check.peer_clean_logits_false_*: without")
    shapes = dict(T=t, S=n, prefix=n - t, H=H_IDX, D=D, pairs=pairs)
    return [make_row(w["name"], w["peer"], shapes, flops=2.0 * H_IDX * D * pairs, **got)]


def _deepgemm_paged(s, dg, cache, lens, ctx):
    """DeepGEMM's paged logits on the bytes of ``cache`` ([nb, bs, 1, D + 4] view), 2-D
    lengths, clean_logits=False; its schedule made once here (it depends on lens only)."""
    torch = s.torch
    tkv = torch.from_dlpack(cache.data).view(cache.num_blocks, BS, 1, D + 4)
    tlens = torch.from_dlpack(lens)
    meta = dg.get_paged_mqa_logits_metadata(tlens, BS, dg.get_num_sms())
    return lambda q, wt, tab: dg.fp8_fp4_paged_mqa_logits((q, None), tkv, wt, tlens, tab, meta,
                                                          ctx, clean_logits=False)


def run_indexer_decode(s, w):
    cp, cps, torch = s.cp, s.cps, s.torch
    b, ctx, nn = w["B"], w["ctx"], w["next_n"]
    fp4 = w.get("keys") == "mxfp4"
    pages = b * (ctx // BS)
    nsets = 3 if pages * BS * (D + 4) < (256 << 20) else 1    # rotate past the L2
    cache = cps.IndexerKCache(nsets * pages, BS, D, xp=cp)    # fp8: the peer's keys
    ours_cache = cache
    if fp4:
        ours_cache = cps.IndexerKCache(nsets * pages, BS, D, xp=cp, dtype="mxfp4")
        _fill_indexer_mxfp4(cp, ours_cache.data, cache.data)
    else:
        _fill_indexer(cp, cache.data)
    perm = cp.random.permutation(nsets * pages).astype(cp.int32)
    mixed = w.get("lens") == "mixed"
    lens = _mixed_decode_lens(cp, b, ctx, nn) if mixed else _decode_lens(cp, b, ctx, nn)
    sets = [(_codes(cp, (b, nn, H_IDX, D)),
             cp.random.standard_normal((b * nn, H_IDX), dtype=cp.float32),
             cp.ascontiguousarray(perm[j * pages:(j + 1) * pages].reshape(b, -1)))
            for j in range(nsets)]

    def make_peer(dg):
        tsets = [(torch.from_dlpack(q).view(torch.float8_e4m3fn), torch.from_dlpack(wt),
                  torch.from_dlpack(tab)) for q, wt, tab in sets]
        visible = cp.arange(ctx, dtype=cp.int32)[None, :] < lens.reshape(-1, 1)
        return (_deepgemm_paged(s, dg, cache, lens, ctx), tsets,
                lambda o, p: _logits_check(cp, o, _t2c(s, p), visible, ours_clean=False))
    # Both sides clean_logits=False: nothing past a row's window is written (what a
    # decode step's top-k, which reads only the windows, needs).
    got = _side_by_side(s, lambda q, wt, tab: cps.paged_mqa_logits(q, ours_cache, wt, lens, tab,
                                                                   ctx, clean_logits=False),
                        sets, 10, [b * nn * ctx * 4], ["deep_gemm"], make_peer)
    keys_read = int(lens[:, -1].sum())          # each request's keys, read once
    shapes = dict(B=b, ctx=ctx, next_n=nn, H=H_IDX, D=D, page_sets=nsets,
                  keys="mxfp4" if fp4 else "fp8", lens="mixed" if mixed else "full",
                  mean_context=keys_read / b, clean_logits=False)
    key_bytes = (D // 2 + 4) if fp4 else (D + 4)
    if fp4:
        got["notes"].append("cpsparse reads MXFP4 pages (68 bytes a key), the peer "
                            "DeepGEMM's fp8 kernel the same keys as fp8 pages (132 bytes; "
                            "DeepGEMM's MXFP4 kernel is SM100 only); queries fp8 on both")
    got["notes"].append("both sides clean_logits=False: positions past a row's window are "
                        "not written (cpsparse's default, clean_logits=True, writes -inf "
                        "there); bytes: the keys read and the windows written")
    row = make_row(w["name"], w["peer"], shapes,
                   nbytes=keys_read * key_bytes + int(lens.sum()) * 4, **got)
    row["copy_tbs"] = _copy_tbs(s)
    if row.get("cpsparse_kernel_tbs"):
        row["cpsparse_fraction_of_copy"] = row["cpsparse_kernel_tbs"] / row["copy_tbs"]
    return [row]


def _topk_logits(cp, mode, m, width, variant):
    if variant == "_low10bits":
        bits = cp.random.randint(0, 1024, (m, width), dtype=cp.int32).astype(cp.uint32)
        x = (bits | cp.uint32(0x3F900000)).view(cp.float32)
    else:
        x = cp.random.standard_normal((m, width), dtype=cp.float32)
        x = x + cp.float32(100) if variant == "_shift100" else x
        x = x * cp.float32(1e-8) if variant == "_scale1e-8" else x
    if mode == "prefill":                         # row i sees [0, i]; -inf elsewhere
        x = cp.where(cp.arange(width)[None, :] <= cp.arange(m)[:, None], x,
                     cp.float32(-cp.inf))
    return cp.ascontiguousarray(x)


def run_topk(s, w):
    cp, cps = s.cp, s.cps
    mode, m, width = w["mode"], w["rows"], w["width"]
    sets = [(_topk_logits(cp, mode, m, width, w["variant"]),) for _ in range(3)]
    out = cp.empty((m, K), cp.int32)
    if mode == "prefill":
        starts, lens = cp.zeros(m, cp.int32), cp.arange(1, m + 1, dtype=cp.int32)
        call = lambda x: cps.topk_per_row(x, starts, lens, K, out=out)  # noqa: E731
    else:
        lens = cp.full(m, width, cp.int32)
        call = lambda x: cps.topk_per_row_decode(x, lens, 1, K, out=out)  # noqa: E731

    def make_peer(torch):
        tsets = [(torch.from_dlpack(x),) for (x,) in sets]
        return (lambda x: torch.topk(x, K, dim=-1), tsets,
                lambda o, p: _topk_check(cp, sets[0][0], lens, o, _t2c(s, p.values)))
    got = _side_by_side(s, call, sets, 5 if mode == "prefill" else 20,
                        lambda: out.fill(1 << 30), ["torch"], make_peer)   # no row has 2**30
    shapes = dict(rows=m, width=width, k=K, mode=mode, variant=w["variant"] or "normal")
    return [make_row(w["name"], w["peer"], shapes, nbytes=m * width * 4 + m * K * 4, **got)]


def run_decode_step(s, w):
    cp, cps, torch = s.cp, s.cps, s.torch
    b, ctx, nn = w["B"], w["ctx"], w["next_n"]
    t, pages = b * nn, ctx // BS
    icache = cps.IndexerKCache(b * pages, BS, D, xp=cp)
    _fill_indexer(cp, icache.data)
    mcache = cps.MLAKVCache(b * pages, BS, 512, 64, xp=cp)
    _fill_mla(cp, mcache.records())
    table = cp.random.permutation(b * pages).astype(cp.int32).reshape(b, pages)
    lens = _decode_lens(cp, b, ctx, nn)
    buf = cp.full((t, K), -1, cp.int32)
    sets = [(_codes(cp, (b, nn, H_IDX, D)),
             cp.random.standard_normal((t, H_IDX), dtype=cp.float32),
             _bf16_f16(cp, (t, 128, D_QK))) for _ in range(2)]
    scale = cps.softmax_scale(128, 64)

    def step(q8, wt, qm):
        logits = cps.paged_mqa_logits(q8, icache, wt, lens, table, ctx, clean_logits=False)
        slots = cps.topk_per_row_decode(logits, lens, nn, K, out=buf, block_table=table,
                                        block_size=BS)          # slot mapping fused
        return cps.sparse_mla_attention(qm, mcache, slots, scale)

    def make_peer(dg, fm):
        logits_of = _deepgemm_paged(s, dg, icache, lens, ctx)
        attend = _flashmla_decode(s, fm, mcache, scale)
        ttab = torch.from_dlpack(table)
        bt_rows = ttab.long().repeat_interleave(nn, dim=0)       # [T, pages]
        hidden = None                 # the peer's logits past a row's length are not -inf
        if int(lens.min()) < ctx:
            hidden = torch.arange(ctx, device="cuda")[None, :] >= torch.from_dlpack(
                lens).reshape(-1, 1)
        tsets = [(torch.from_dlpack(q8).view(torch.float8_e4m3fn), torch.from_dlpack(wt),
                  torch.from_dlpack(qm).to(torch.bfloat16).view(b, nn, 128, D_QK))
                 for q8, wt, qm in sets]

        def pstep(q8, wt, qm):
            logits = logits_of(q8, wt, ttab)
            if hidden is not None:
                logits.masked_fill_(hidden, float("-inf"))
            idx = torch.topk(logits, K, dim=-1).indices
            slots = (torch.gather(bt_rows, 1, idx // BS) * BS + idx % BS).to(torch.int32)
            return attend(qm, slots.view(b, nn, K))
        return pstep, tsets, _flashmla_compare(s, True)
    got = _side_by_side(s, step, sets, 4, [t * 128 * D_V * 4, t * 128 * 4],
                        ["deep_gemm", "flash_mla"], make_peer)
    got["notes"].append("peer: DeepGEMM paged logits (clean_logits=False; -inf past the "
                        "lengths by masked_fill where a row is shorter), torch.topk, torch "
                        "slot arithmetic, FlashMLA decode; schedules made once, untimed")
    ours, ours_g = got.pop("ours"), got.pop("ours_kernel")
    theirs, theirs_g = got.pop("theirs"), got.pop("theirs_kernel")
    shapes = dict(B=b, ctx=ctx, next_n=nn, index_heads=H_IDX, mla_heads=128, topk=K)
    return [make_row(w["name"], w["peer"], dict(shapes, timing="cuda_graph"), ours_g, ours_g,
                     theirs_g, theirs_g, **got),
            make_row(w["name"] + "_eager", w["peer"], dict(shapes, timing="eager"), ours,
                     ours_g, theirs, theirs_g, **got)]


RUNNERS = {"mla_decode": run_mla_decode, "mla_model1_decode": run_mla_model1_decode,
           "mla_prefill": run_mla_prefill,
           "indexer_prefill": run_indexer_prefill, "indexer_decode": run_indexer_decode,
           "topk": run_topk, "decode_step": run_decode_step}
KERNEL_MODULES = {"mla_decode": ["attention"], "mla_model1_decode": ["attention"],
                  "mla_prefill": ["attention"],
                  "indexer_prefill": ["indexer"], "indexer_decode": ["indexer"],
                  "topk": ["topk"], "decode_step": ["indexer", "topk", "attention"]}


# ---- main -------------------------------------------------------------------------------

def _f(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def compare_runs(base, new):
    """Rows of an A/B of two ``bench_peers`` payloads (``base``: the tree before a change,
    ``new``: after it; each timed against the peer in its own process): per workload both
    in either, the kernel medians, their ratio (> 1: the change is faster) and each side's
    kernel speedup over the peer (the ratio that the peer's own drift between the two
    processes cancels out of)."""
    old = {r["workload"]: r for r in base.get("rows", [])}
    rows = []
    for r in new.get("rows", []):
        b = old.get(r["workload"])
        if b is None:
            continue
        ms_b, ms_n = b.get("cpsparse_kernel_ms"), r.get("cpsparse_kernel_ms")
        rows.append({"workload": r["workload"], "base_kernel_ms": ms_b, "new_kernel_ms": ms_n,
                     "speedup": ms_b / ms_n if ms_b and ms_n else None,
                     "base_vs_peer": b.get("kernel_speedup"),
                     "new_vs_peer": r.get("kernel_speedup")})
    return rows


def _reexec_with_preload(argv, module="benchmarks.bench_peers"):
    """Start ``python3 -m module argv`` again with the system libstdc++ preloaded
    (DeepGEMM's JIT needs it); the preload must be in place before the process starts, so
    this replaces the process."""
    if "libstdc++" in os.environ.get("LD_PRELOAD", "") or not os.path.exists(LIBSTDCXX) \
            or os.environ.get("CPSPARSE_PEERS_REEXEC") or "--no-peers" in argv \
            or "--list" in argv or "--compare" in argv:
        return
    env = dict(os.environ, CPSPARSE_PEERS_REEXEC="1",
               LD_PRELOAD=" ".join(p for p in (LIBSTDCXX, os.environ.get("LD_PRELOAD")) if p),
               PYTHONPATH=os.pathsep.join(p for p in (str(harness.ROOT),
                                                      os.environ.get("PYTHONPATH")) if p))
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", module] + argv, env)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.bench_peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="PREFIX", help="workload name prefixes")
    p.add_argument("--quick", action="store_true", help="fewer timed iterations")
    p.add_argument("--peers-dir", default=os.environ.get("CPSPARSE_PEERS_DIR", "/tmp/peers"))
    p.add_argument("--wait", type=float, default=240.0, help="seconds to wait for the build")
    p.add_argument("--no-peers", action="store_true", help="cpsparse side only")
    p.add_argument("--fresh", action="store_true", help="do not merge with the existing "
                   "benchmarks/results/peers.json rows")
    p.add_argument("--list", action="store_true", help="print the selected names and exit")
    p.add_argument("--peer-first", action="store_true", help="time the peer before cpsparse "
                   "in each workload (an order check: the default times cpsparse first)")
    p.add_argument("--compare", nargs=2, metavar=("BASE", "NEW"), help="print the A/B of "
                   "two peers.json files (compare_runs) and exit")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="time both sides N times, alternating which goes first (ABBA for "
                   "2), each side's figures pooled: the side timed first reads faster on "
                   "compute-bound rows")
    return p.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.compare:
        base, new = (json.loads(pathlib.Path(f).read_text()) for f in args.compare)
        harness.print_table(compare_runs(base, new),
                            ["workload", "base_kernel_ms", "new_kernel_ms", "speedup",
                             "base_vs_peer", "new_vs_peer"])
        return 0
    chosen = select(args.only)
    if args.list or not chosen:
        print("\n".join(w["name"] for w in chosen) or f"no workload matches {args.only}")
        return 0 if chosen else 2
    s = Session(args)
    info = harness.device_info()
    kinds = {w["kind"] for w in chosen}
    try:
        s.cps.precompile(sorted({m for k in kinds for m in KERNEL_MODULES[k]}))
    except Exception as exc:  # noqa: BLE001 - first calls compile instead
        print(f"precompile: {type(exc).__name__}: {exc}", flush=True)
    ceilings = timing.measure_ceilings(s.cp)
    print(f"{info['device']}: " + ", ".join(f"{k} {v:.4g}" for k, v in ceilings.items()),
          flush=True)
    if not args.no_peers:
        # Nothing is timed while the peers' build runs beside it: the eager rows time the
        # host too (topk_decode_4x131072 read 27.4 us a call during the build, 23.5 us
        # in a run without it).
        s._wait_built()
    rows = []
    for w in chosen:
        t0 = time.time()
        try:
            got = RUNNERS[w["kind"]](s, w)
        except Exception as exc:  # noqa: BLE001 - record it, keep the other workloads
            error = f"error: {type(exc).__name__}: {str(exc)[:400]}"
            got = [make_row(n, w["peer"], {}, notes=[error]) for n in _names(w)]
        s.free()
        for r in got:
            rows.append(r)
            print(f"{r['workload']}: cpsparse {_f(r['cpsparse_ms'])} ms (kernel "
                  f"{_f(r['cpsparse_kernel_ms'])}), {r['peer']} {_f(r['peer_ms'])} ms "
                  f"(kernel {_f(r['peer_kernel_ms'])}), speedup {_f(r['speedup'])}, kernel "
                  f"{_f(r['kernel_speedup'])}, err {_f(r['max_rel_err_vs_peer'])} "
                  f"[{time.time() - t0:.1f} s]" + "".join(f"\n    {n}" for n in
                                                      r.get("notes", [])), flush=True)
    torch = s.torch
    payload = {"device": info["device"], "device_info": info,
               "date": datetime.date.today().isoformat(),
               "command": " ".join(["python3 -m benchmarks.bench_peers"] + argv),
               "ceilings": ceilings, "method": METHOD, "cpsparse": s.cps.__version__,
               "torch": None if torch is None else torch.__version__,
               "peers": {"dir": str(s.dir), "built": s.built, "unavailable": s.why,
                         "versions": {k: getattr(m, "__version__", None)
                                      for k, m in s.mods.items() if m is not None}},
               "rows": rows}
    path = harness.RESULTS_DIR / "peers.json"
    if not args.fresh and path.exists():
        try:
            payload = merge_payload(json.loads(path.read_text()), payload)
        except (ValueError, KeyError, TypeError) as exc:
            print(f"not merged with {path}: {exc}", flush=True)
    harness.write_results("peers", payload)
    harness.print_table(rows, ["workload", "peer", "cpsparse_ms", "cpsparse_kernel_ms",
                               "peer_ms", "peer_kernel_ms", "speedup", "kernel_speedup",
                               "max_rel_err_vs_peer"])
    return 0


if __name__ == "__main__":
    _reexec_with_preload(sys.argv[1:])
    sys.exit(main())
