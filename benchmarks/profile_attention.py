"""Which part of the fp8 sparse decode kernel costs what (a diagnostic, not a benchmark).

Run on a GPU machine from the repository root::

    PYTHONPATH=$PWD python3 -m benchmarks.profile_attention [VARIANT ...]

It compiles ``attention.cu`` with one part switched off at a time (a text
substitution in the module source, never written to disk) and times the
``mla_decode_*`` shapes of DESIGN section 12 as CUDA-graph replays, so the
difference to ``base`` is what that part adds to the critical path:

- ``nommas``: no QK^T and no PV wgmma (the producer and the softmax remain);
- ``noqk`` / ``nopv``: one of the two products removed;
- ``nodeq``: the e4m3 -> bf16 conversion replaced by a copy of the codes;
- ``localslots``: every row reads one of 64 records (L1/L2 hits, no HBM traffic).

The outputs of the variants are wrong by construction; only the times mean something.
Results: stdout and ``$OUT/profile_attention.json`` when set.
"""

import json
import os
import sys

from benchmarks import harness

# (variant, [(text in attention.cu, replacement)]); tests/test_profile_attention.py checks
# every text still occurs exactly once, so the tool cannot silently time the base kernel.
_QK = ("    for (int ks = 0; ks < 36; ++ks) {", "    for (int ks = 0; ks < 0; ++ks) {")
_PV = ("    for (int ks = 0; ks < 4; ++ks) {\n        att_wgmma_m64n256_kmn",
       "    for (int ks = 0; ks < 0; ++ks) {\n        att_wgmma_m64n256_kmn")
_DQ = "__device__ __forceinline__ void att_dequant4(u32 w, float scale, u32& out01, u32& out23) {"
VARIANTS = {
    "base": [],
    "nommas": [_QK, _PV],
    "noqk": [_QK],
    "nopv": [_PV],
    "nodeq": [(_DQ, _DQ + " out01 = w; out23 = w ^ __float_as_uint(scale); return;")],
    "localslots": [("    const int slot = irow != nullptr ? __ldg(irow + j) : rbase + j;",
                    "    const int slot = irow != nullptr ? (j & 63) : rbase + j;")],
}
SHAPES = [(128, 1, 128), (64, 2, 64), (8, 1, 128), (1, 1, 128)]   # (B, s_q, H)
CTX, TOPK = 32768, 2048


def variant_source(source, name):
    """``source`` with the substitutions of variant ``name`` applied."""
    for old, new in VARIANTS[name]:
        if source.count(old) != 1:
            raise ValueError(f"variant {name}: expected one occurrence of {old!r} in "
                             f"attention.cu, got {source.count(old)}")
        source = source.replace(old, new)
    return source


def main(names=None):
    cp = harness.cupy()
    import cpsparse
    from benchmarks.bench_peers import mla_decode_inputs
    from cpsparse import raw_kernels, timing
    from cpsparse.raw_kernels import attention as katt

    def forget_compiled():
        """Drop the compiled modules, bound kernels and launch plans (the next launch
        compiles the current source)."""
        raw_kernels._COMPILED.clear()
        raw_kernels._KERNELS.clear()
        katt._PLANS.clear()

    names = names or list(VARIANTS)
    original = raw_kernels.module_source
    base = original("attention")
    scale = cpsparse.softmax_scale(128, 64)
    inputs = []
    for b, sq, h in SHAPES:
        cache, sets = mla_decode_inputs(cp, cpsparse, b, sq, h, CTX, TOPK)
        inputs.append((f"B{b}_sq{sq}_H{h}", cache.records(), sets))
    results = {}
    try:
        for name in names:
            src = variant_source(base, name)
            raw_kernels.module_source = (
                lambda module, src=src: src if module == "attention" else original(module))
            forget_compiled()
            for key, recs, sets in inputs:
                def call(q, slots, recs=recs):
                    return katt.sparse_mla_attention(cp, q, recs, slots, scale, 512, True)
                g = timing.time_graph(call, sets, reps=4, warmup=2, iters=15)
                results.setdefault(key, {})[name] = g["median_ms"] * 1e3
                print(f"{name:10s} {key:14s} {g['median_ms'] * 1e3:8.1f} us "
                      f"({g['p10_ms'] * 1e3:.1f}-{g['p90_ms'] * 1e3:.1f})", flush=True)
    finally:
        raw_kernels.module_source = original
        forget_compiled()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "profile_attention.json"), "w") as f:
            json.dump({"device": harness.device_info(), "graph_us": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
