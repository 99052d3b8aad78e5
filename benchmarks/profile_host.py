"""Where the host time of a public op call goes (a diagnostic, not a benchmark).

Run on a GPU machine from the repository root::

    PYTHONPATH=$PWD python3 -m benchmarks.profile_host

For each op of :class:`cpsparse.bench.DecodeStep` (B=1, 32K context, value
checks off) it runs the call under :mod:`cProfile` and prints the functions
with the most own time, then times the building blocks every launcher uses
(``cupy.empty``, a RawKernel launch by argument count and type, ``flags``),
so that a change to the call path can be aimed at what costs. Output goes to
stdout (and ``$OUT/profile_host.txt`` when set).
"""

import cProfile
import io
import os
import pstats
import sys
import numpy

from benchmarks import harness
from cpsparse import _validation as V
from cpsparse import timing

CALLS = 2000


def _per_call_us(fn, n=CALLS):
    """Median host time of back-to-back calls (no synchronize between them:
    :func:`cpsparse.timing.time_cpu`), in microseconds."""
    return timing.time_cpu(fn, None, warmup=1, iters=n)["median_ms"] * 1e3


def cprofile_report(fn, calls, xp=numpy, warmup=50, top=22):
    """(Python function calls a call of ``fn``, the report of the ``top`` functions by own
    time) of ``calls`` calls under :mod:`cProfile`, after ``warmup`` calls and a
    synchronize (CuPy: the device idle at the start and the end)."""
    for _ in range(warmup):
        fn()
    timing.synchronize(xp)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    timing.synchronize(xp)
    s = io.StringIO()
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(top)
    return stats.total_calls / calls, s.getvalue()


def _profile(name, fn, out):
    _, report = cprofile_report(fn, CALLS, harness.cupy())
    print(f"==== {name}: {_per_call_us(fn):.1f} us per call (back to back, not profiled)",
          file=out)
    print(report, file=out)


def _blocks(out):
    cp = harness.cupy()
    src = r'''
    extern "C" __global__ void k1(int* a) { if (threadIdx.x == 1000) a[0] = 1; }
    extern "C" __global__ void k16(int* a, const int* b, const int* c, const int* d,
        int e, int f, int g, int h, int i, int j, int k, int l, int m, int n, int o, int p)
    { if (threadIdx.x == 1000) a[0] = b[0] + e; }
    '''
    mod = cp.RawModule(code=src)
    k1, k16 = mod.get_function("k1"), mod.get_function("k16")
    from cpsparse import raw_kernels
    fast16 = raw_kernels.Kernel(k16, "k16", "PPPP" + "i" * 12).bind(cp)
    fast1 = raw_kernels.Kernel(k1, "k1", "P").bind(cp)
    a = cp.zeros(16, cp.int32)
    n32 = [numpy.int32(i) for i in range(12)]
    py = list(range(12))
    rows = {
        "cupy.empty((1, 2048), int32)": lambda: cp.empty((1, 2048), cp.int32),
        "cupy.empty((128, 512), float32)": lambda: cp.empty((128, 512), cp.float32),
        "raw_kernels.empty (cupy.ndarray)": lambda: raw_kernels.empty(cp, (1, 2048), cp.int32),
        "layouts() of 4 arrays": lambda: V.layouts(a, a, a, a),
        "launch 1 pointer": lambda: k1((1,), (32,), (a,)),
        "launch 4 pointers + 12 numpy.int32": lambda: k16((1,), (32,), (a, a, a, a, *n32)),
        "launch 4 pointers + 12 python int": lambda: k16((1,), (32,), (a, a, a, a, *py)),
        "launch 16 args, shared_mem=1024": lambda: k16((1,), (32,), (a, a, a, a, *n32),
                                                       shared_mem=1024),
        "raw_kernels.Kernel launch, 16 args": lambda: fast16((1,), (32,), (a, a, a, a, *py)),
        "raw_kernels.Kernel launch, 1 arg": lambda: fast1((1,), (32,), (a,)),
        "a.flags.c_contiguous": lambda: a.flags.c_contiguous,
        "a.data.ptr": lambda: a.data.ptr,
        "a.reshape(4, 4)": lambda: a.reshape(4, 4),
        "a[2:10] (slice view)": lambda: a[2:10],
        "cupy.cuda.runtime.getDevice()": cp.cuda.runtime.getDevice,
        "cupy.cuda.get_current_stream()": cp.cuda.get_current_stream,
        "stream.is_capturing()": lambda: cp.cuda.get_current_stream().is_capturing(),
        "numpy.int32(7)": lambda: numpy.int32(7),
        "isinstance(a, cupy.ndarray)": lambda: isinstance(a, cp.ndarray),
        "a.dtype == cupy.int32": lambda: a.dtype == cp.int32,
        "a.dtype.name": lambda: a.dtype.name,
    }
    print("==== building blocks (us per call, back to back)", file=out)
    for name, fn in rows.items():
        print(f"{_per_call_us(fn):8.2f}  {name}", file=out)
    cp.cuda.Device().synchronize()
    print("==== host time after a synchronize (timing.time_host: the 'idle GPU' figure)",
          file=out)
    for name, fn in [("RawKernel launch 16 args", rows["launch 16 args, shared_mem=1024"]),
                     ("raw_kernels.Kernel launch 16 args",
                      rows["raw_kernels.Kernel launch, 16 args"]),
                     ("cupy.empty((1, 2048), int32)", rows["cupy.empty((1, 2048), int32)"])]:
        t = timing.time_host(fn, None, xp=cp, warmup=20, iters=300)
        print(f"{t['median_us']:8.2f}  {name} (p10 {t['p10_us']:.2f}, p90 {t['p90_us']:.2f})",
              file=out)


def main():
    cp = harness.cupy()
    import cpsparse
    from cpsparse.bench import DecodeStep, sizes

    out = io.StringIO()
    previous = cpsparse.set_device_value_checks(False)
    try:
        cpsparse.precompile()
        s = sizes(cp)
        d = DecodeStep(cp, numpy.random.default_rng(0), 1, 32768, s, sets=2)
        _blocks(out)
        for name, fn in [("paged_mqa_logits", d.scoring), ("topk_per_row_decode", d.topk),
                         ("local_to_global_slots", d.slots),
                         ("topk_per_row_decode(block_table=)", d.topk_slots),
                         ("sparse_mla_attention", d.attention), ("decode step", d.step)]:
            _profile(name, lambda fn=fn: fn(0), out)
    finally:
        cpsparse.set_device_value_checks(previous)
    text = out.getvalue()
    sys.stdout.write(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "profile_host.txt"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
