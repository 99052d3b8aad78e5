"""CUDA C++ sources of cpsparse's kernels and the one loader that compiles them.

Sources live beside this module as ``.cu`` (kernels) and ``.cuh`` (shared
device helpers) files. A *module* is a named list of those files; the loader
concatenates them into one source string (CuPy's disk cache keys on the
source string, not on included files, so nothing is ``#include``-d) and
compiles it once per (device, module, options) with ``cupy.RawModule``.

* :func:`get_function` is thread-safe: concurrent first calls compile once.
* :func:`precompile` warms every module on the current device.
* :func:`module_source` / :data:`MODULES` are what the CPU-side NVRTC compile
  test uses, so CI catches compile errors and spills without a GPU.

CuPy's cache directory (``CUPY_CACHE_DIR``) is honoured: compiled cubins are
reused across processes.
"""

import pathlib
import threading

from cpsparse import _backend

__all__ = ["MODULES", "module_source", "compile_options", "get_function", "precompile",
           "require_device", "MIN_COMPUTE_CAPABILITY", "KernelUnavailable"]

SOURCE_DIR = pathlib.Path(__file__).resolve().parent

# Compute capability the kernels are written for: FP8 mma.sync needs sm_89+
# and the Hopper-only paths (wgmma) sm_90a.
MIN_COMPUTE_CAPABILITY = (9, 0)

# module name -> (source files in order, extra NVRTC options)
MODULES = {}

BASE_OPTIONS = ("-std=c++17",)


class KernelUnavailable(RuntimeError):
    """The GPU (or CuPy) cannot run cpsparse's kernels."""


def register_module(name, files, options=()):
    """Declare a kernel module: its source files (``.cuh`` first) and options."""
    for f in files:
        if not (SOURCE_DIR / f).is_file():
            raise FileNotFoundError(f"kernel source {f} of module {name} is missing")
    MODULES[name] = (tuple(files), tuple(options))


def module_source(name):
    """The single source string of a module (its files concatenated in order)."""
    files, _ = MODULES[name]
    parts = []
    for f in files:
        parts.append(f"// ---- {f} ----\n")
        parts.append((SOURCE_DIR / f).read_text())
        parts.append("\n")
    return "".join(parts)


def compile_options(name, arch="sm_90a"):
    """NVRTC options of a module for ``arch`` (what CuPy and the CPU test pass)."""
    _, extra = MODULES[name]
    return BASE_OPTIONS + extra + (f"-arch={arch}",)


_LOCK = threading.Lock()
_COMPILED = {}


def require_device(cp):
    """Raise KernelUnavailable unless the current device can run the kernels."""
    try:
        dev = cp.cuda.Device()
        major, minor = (int(c) for c in dev.compute_capability)
    except Exception as exc:  # noqa: BLE001 - no driver, no device
        raise KernelUnavailable(f"no usable CUDA device: {exc}") from exc
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        raise KernelUnavailable(
            f"cpsparse kernels need compute capability >= "
            f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} (Hopper), got "
            f"{major}.{minor}; use NumPy arrays for the reference backend")
    return dev.id, (major, minor)


def _arch_for(cc):
    # 'a' targets enable wgmma/setmaxnreg; they only run on exactly that chip.
    return f"sm_{cc[0]}{cc[1]}a" if cc == (9, 0) else f"sm_{cc[0]}{cc[1]}"


def get_module(name):
    """The compiled ``cupy.RawModule`` of ``name`` on the current device."""
    cp = _backend.cupy_module()
    if cp is None:
        raise KernelUnavailable("CuPy is not installed")
    device, cc = require_device(cp)
    key = (device, name)
    mod = _COMPILED.get(key)
    if mod is not None:
        return mod
    with _LOCK:
        mod = _COMPILED.get(key)
        if mod is None:
            mod = cp.RawModule(code=module_source(name),
                               options=compile_options(name, _arch_for(cc)))
            mod.compile()
            _COMPILED[key] = mod
    return mod


def get_function(module, kernel):
    """A ``cupy.RawKernel`` by module and ``extern "C"`` name, compiled on first use."""
    return get_module(module).get_function(kernel)


def precompile(modules=None):
    """Compile every kernel module (or the named ones) on the current device.

    Returns the names compiled. Call it at start-up to keep NVRTC out of the
    first forward pass (and out of CUDA graph capture).

    Raises
    ------
    KernelUnavailable
        Without CuPy or a CUDA device of compute capability 9.0 or newer.

    Examples
    --------
    >>> import cpsparse
    >>> cpsparse.precompile()          # doctest: +SKIP
    ['quant', 'indexer', 'topk', 'attention']
    """
    names = list(MODULES) if modules is None else list(modules)
    for name in names:
        get_module(name)
    return names


# ---- registry ----------------------------------------------------------------
# Kernel issues add their modules here, e.g.
#   register_module("indexer", ["common.cuh", "indexer.cu"])
register_module("quant", ["common.cuh", "quant.cu"])
register_module("indexer", ["common.cuh", "indexer.cu"])
register_module("topk", ["common.cuh", "topk.cu"], options=("-default-device",))
register_module("attention", ["common.cuh", "attention.cu"])
