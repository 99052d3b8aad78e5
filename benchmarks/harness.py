"""Timing and reporting shared by the benchmarks (METHOD.md: CUDA events,
warm-up, medians, rotating fresh random inputs, peers measured in the same run).
"""

import datetime
import json
import os
import pathlib
import platform
import statistics

from cpsparse.bench import table_lines

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"


def cupy():
    import cupy as cp
    return cp


def torch_or_none():
    try:
        import torch
    except Exception:  # noqa: BLE001 - the peer is optional
        return None
    return torch if torch.cuda.is_available() else None


def time_cuda(fn, inputs, *, warmup=3, iters=30):
    """Median / p10 / p90 milliseconds of ``fn(*inputs[i % len(inputs)])``.

    ``inputs`` is a list of argument tuples, rotated so that repeated runs do
    not just measure the L2 cache. Times each call with CUDA events on the
    current CuPy stream (torch peers run on the same device; both sync).
    """
    cp = cupy()
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    cp.cuda.get_current_stream().synchronize()
    times = []
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for i in range(iters):
        args = inputs[i % len(inputs)]
        start.record()
        fn(*args)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    times.sort()
    return {"median_ms": statistics.median(times), "p10_ms": times[len(times) // 10],
            "p90_ms": times[(9 * len(times)) // 10], "iters": iters}


def time_graph(fn, inputs, *, reps=10, warmup=2, iters=30):
    """Per-call median / p10 / p90 ms of ``reps`` calls of ``fn`` (rotating ``inputs``)
    captured in one CUDA graph and replayed: kernel time, no Python launch overhead.
    """
    cp = cupy()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for args in inputs:
            fn(*args)                        # compile, set smem limits, fill the pool
        stream.synchronize()
        stream.begin_capture()
        for i in range(reps):
            fn(*inputs[i % len(inputs)])
        graph = stream.end_capture()
        t = time_cuda(lambda: graph.launch(stream), [()], warmup=warmup, iters=iters)
    return {k: (v / reps if k.endswith("_ms") else v) for k, v in t.items()}


def time_torch(fn, inputs, *, warmup=3, iters=30):
    """Like :func:`time_cuda` for torch code (torch's own events and stream)."""
    torch = torch_or_none()
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        args = inputs[i % len(inputs)]
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return {"median_ms": statistics.median(times), "p10_ms": times[len(times) // 10],
            "p90_ms": times[(9 * len(times)) // 10], "iters": iters}


def copy_bandwidth_tbs(nbytes=2 << 30):
    """Measured device-to-device copy rate, TB/s counting bytes read + written."""
    cp = cupy()
    a = cp.empty(nbytes // 4, dtype=cp.float32)
    a[:] = 1.0
    b = cp.empty_like(a)
    t = time_cuda(lambda: b.__setitem__(slice(None), a), [()], warmup=2, iters=10)
    del a, b
    return 2 * nbytes / (t["median_ms"] * 1e-3) / 1e12


def fp8_gemm_tflops(n=8192):
    """torch._scaled_mm e4m3 -> bf16 rate (TFLOP/s), or None without torch."""
    torch = torch_or_none()
    if torch is None or not hasattr(torch, "_scaled_mm"):
        return None
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    t = time_torch(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                            out_dtype=torch.bfloat16), [()], iters=10)
    return 2 * n ** 3 / (t["median_ms"] * 1e-3) / 1e12


def bf16_gemm_tflops(n=8192):
    torch = torch_or_none()
    if torch is None:
        return None
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = time_torch(lambda: a @ b, [()], iters=10)
    return 2 * n ** 3 / (t["median_ms"] * 1e-3) / 1e12


def device_info():
    cp = cupy()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {"device": name, "sms": props["multiProcessorCount"],
            "cupy": cp.__version__, "python": platform.python_version()}


def write_results(name, payload, out_dir=None):
    """Write ``benchmarks/results/<name>.json`` (and a copy under $OUT if set)."""
    payload = dict(payload)
    payload.setdefault("date", datetime.date.today().isoformat())
    text = json.dumps(payload, indent=2, sort_keys=True)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(text + "\n")
    out = out_dir or os.environ.get("OUT")
    if out:
        pathlib.Path(out, f"{name}.json").write_text(text + "\n")
    return payload


def print_table(rows, columns):
    """Print rows (dicts) as an aligned text table of ``columns``."""
    print("\n".join(table_lines(rows, columns)))
