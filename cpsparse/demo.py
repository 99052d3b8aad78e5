"""The demo behind ``python -m cpsparse``: every DSA op on random data."""

import argparse
import time

import numpy

import cpsparse
from cpsparse import _backend


def _pick_backend(name):
    if name == "auto":
        name = "cupy" if _backend.gpu_available() else "numpy"
    if name == "cupy" and not _backend.gpu_available():
        raise SystemExit("error: --backend cupy needs CuPy and a CUDA device")
    return _backend.cupy_module() if name == "cupy" else numpy


def run_ops(xp, tokens=256, heads=16, topk=64, seed=0):
    """Indexer scoring -> top-k -> sparse MLA on one random request; returns a report."""
    rng = numpy.random.default_rng(seed)
    dev = (lambda a: xp.asarray(a)) if xp is not numpy else (lambda a: a)
    report = []

    def step(name, fn):
        t0 = time.perf_counter()
        result = fn()
        if xp is not numpy:
            xp.cuda.get_current_stream().synchronize()
        report.append((name, time.perf_counter() - t0))
        return result

    q = dev(rng.standard_normal((tokens, heads, 128)).astype(numpy.float32))
    k = dev(rng.standard_normal((tokens, 128)).astype(numpy.float32))
    q8, qs = step("quantize_fp8 (q)", lambda: cpsparse.quantize_fp8(q, eps=1e-10))
    w = cpsparse.fold_weights(dev(rng.standard_normal((tokens, heads)).astype(numpy.float32)),
                              qs)
    cache = cpsparse.IndexerKCache(num_blocks=-(-tokens // 64), xp=xp)
    slots = dev(numpy.arange(tokens, dtype=numpy.int32))
    step("IndexerKCache.insert", lambda: cache.insert(k, slots))
    table = dev(numpy.arange(cache.num_blocks, dtype=numpy.int32)[None])
    cu = dev(numpy.array([0, tokens], numpy.int32))
    k8, ks = step("IndexerKCache.gather", lambda: cache.gather(table, cu))
    zeros = dev(numpy.zeros(tokens, numpy.int32))
    ends = dev(numpy.arange(1, tokens + 1, dtype=numpy.int32))
    logits = step("mqa_logits", lambda: cpsparse.mqa_logits(q8, k8, ks, w, zeros, ends))
    idx = step("topk_per_row", lambda: cpsparse.topk_per_row(logits, zeros, ends, topk))
    mla = cpsparse.MLAKVCache(num_blocks=cache.num_blocks, xp=xp)
    step("MLAKVCache.insert", lambda: mla.insert(
        dev(rng.standard_normal((tokens, 512)).astype(numpy.float32)),
        dev(rng.standard_normal((tokens, 64)).astype(numpy.float32)), slots))
    qa = dev(rng.standard_normal((tokens, heads, 576)).astype(numpy.float32))
    out, lse = step("sparse_mla_attention", lambda: cpsparse.sparse_mla_attention(
        qa, mla, idx, cpsparse.softmax_scale()))
    assert bool(xp.isfinite(out).all()) and bool(xp.isfinite(lse).all())
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m cpsparse", description=__doc__)
    parser.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--topk", type=int, default=64)
    args = parser.parse_args(argv)
    xp = _pick_backend(args.backend)
    print(f"cpsparse {cpsparse.__version__}: backend {xp.__name__}, {args.tokens} tokens, "
          f"{args.heads} index heads, topk {args.topk}")
    for name, seconds in run_ops(xp, args.tokens, args.heads, args.topk):
        print(f"  {name:<24} {seconds * 1e3:9.2f} ms")
    print("ok")
    return 0
