"""Reporting shared by the benchmarks: device facts, result files, tables.

Timing is not here: every script times through :mod:`cpsparse.timing` (CUDA
events, warm-up, medians with p10/p90 over rotating fresh inputs, CUDA-graph
replay, host time) and measures its ceilings there (copy bandwidth, bf16 and
fp8 GEMM rates), the same way ``python -m cpsparse.bench`` does.
"""

import contextlib
import datetime
import importlib.util
import json
import os
import pathlib
import platform

from cpsparse.bench import table_lines

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"


def _timing_module():
    """``cpsparse.timing``; for an older cpsparse tree without it (bench_bounds times
    ``.baseline/`` too: tools/gpu_check.sh bounds), this repository's file, so both
    trees are timed the same way (it imports nothing of cpsparse)."""
    try:
        from cpsparse import timing as module
    except ImportError:
        spec = importlib.util.spec_from_file_location("cpsparse_timing",
                                                      ROOT / "cpsparse" / "timing.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


timing = _timing_module()
cupy, torch_or_none = timing.cupy, timing.torch_or_none      # the scripts' backends


def substitute(source, substitutions, what):
    """``source`` with each (old, new) of ``substitutions`` applied, every ``old``
    required to occur exactly once (a ValueError naming ``what`` otherwise): a profile's
    variant or trace cannot silently leave the kernel as it was."""
    for old, new in substitutions:
        if source.count(old) != 1:
            raise ValueError(f"{what}: expected one occurrence of {old!r}, got "
                             f"{source.count(old)}")
        source = source.replace(old, new)
    return source


@contextlib.contextmanager
def module_source_override(module, src, *plan_caches):
    """Launches inside compile ``src`` as kernel module ``module``'s source (never
    written to disk): the compiled modules, bound kernels and the launcher's memoized
    plans (``plan_caches``, dicts) are dropped on entry and exit, so the next launch
    compiles the source in force. The public ops' call memos are emptied too (the top-k,
    paged scoring and sparse attention ops keep the prepared launch of a call there). The profiles' ablations and traces use
    it."""
    from cpsparse import raw_kernels
    from cpsparse import _validation

    def forget_compiled():
        raw_kernels._COMPILED.clear()
        raw_kernels._KERNELS.clear()
        for cache in plan_caches:
            cache.clear()
        _validation.CallMemo.clear_all()

    original = raw_kernels.module_source
    raw_kernels.module_source = (
        lambda name: src if name == module else original(name))
    forget_compiled()
    try:
        yield
    finally:
        raw_kernels.module_source = original
        forget_compiled()


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
