"""Array backends: NumPy (the reference) and CuPy (CUDA kernels).

Every public op dispatches on the type of its array arguments. Importing
cpsparse never requires CuPy, and CuPy installed without a GPU or driver is
fine: ``cupy`` imports, only device calls fail, and they are never made for
NumPy inputs.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any

import numpy

if TYPE_CHECKING:
    from types import ModuleType

    from cpsparse._typing import ModuleLike

__all__ = ["get_array_module", "backend_module", "cupy_module", "is_cupy_array", "xp_of",
           "gpu_available",
           "is_stream_capturing", "KernelFallbackWarning", "warn_fallback"]


@functools.lru_cache(maxsize=None)
def cupy_module():
    """Return the ``cupy`` module, or None when it cannot be imported.

    A broken CuPy install (wrong CUDA wheel, missing libraries) must not break
    ``import cpsparse``: any exception at import time counts as "no CuPy".
    """
    try:
        import cupy
    except Exception:  # noqa: BLE001 - any failure means "no usable CuPy"
        return None
    return cupy


def is_cupy_array(a: object) -> bool:
    cp = cupy_module()
    return cp is not None and isinstance(a, cp.ndarray)


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device.

    Examples
    --------
    >>> import cpsparse
    >>> isinstance(cpsparse.gpu_available(), bool)
    True
    """
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver / no device
        return False


def backend_module(spec: ModuleLike, name: str = "xp") -> ModuleType:
    """``numpy`` or ``cupy`` from a module or its name; ``"auto"`` picks CuPy with a GPU.

    Raises ValueError naming ``name`` for anything else (or ``"cupy"`` without CuPy).
    """
    if spec is numpy or spec == "numpy":
        return numpy
    cp = cupy_module()
    if spec == "auto":
        return cp if gpu_available() else numpy
    if cp is not None and (spec is cp or spec == "cupy"):
        return cp
    raise ValueError(f"Invalid {name}: expected numpy or cupy (the module or its name), "
                     f"got {spec!r}")


def xp_of(a: object) -> ModuleType:
    """``cupy`` for a CuPy array, else ``numpy`` (the array-generic code's module)."""
    return cupy_module() if is_cupy_array(a) else numpy


# type -> "numpy", "cupy" or None (every op call asks)
_BACKEND_OF_TYPE: dict[type, str | None] = {}


def _backend_name(a):
    t = type(a)
    try:
        return _BACKEND_OF_TYPE[t]
    except KeyError:
        pass
    name = "numpy" if isinstance(a, numpy.ndarray) else ("cupy" if is_cupy_array(a) else None)
    _BACKEND_OF_TYPE[t] = name
    return name


def get_array_module(*args: object, **arrays: object) -> ModuleType:
    """Return ``numpy`` or ``cupy`` for the given arrays; refuse to mix them.

    Called like CuPy's ``cupy.get_array_module(*args)``: positional arguments
    that are not arrays (scalars, None, lists) are ignored and the answer is
    ``cupy`` when any of them is a CuPy array. The keyword form names the
    arguments of an op, and there every non-None value must be an array.

    Parameters
    ----------
    *args
        Any objects (CuPy's signature).
    **arrays
        Array arguments by name (``None`` values are ignored).

    Returns
    -------
    module
        ``numpy``, or ``cupy`` when any array is a CuPy array.

    Raises
    ------
    TypeError
        If a named argument is not a NumPy or CuPy array, or if NumPy and CuPy
        arrays are mixed (cpsparse never copies between host and device
        behind the caller's back).

    Examples
    --------
    >>> import numpy as np, cpsparse
    >>> cpsparse.get_array_module(np.zeros(3), 1.0) is np
    True
    >>> cpsparse.get_array_module(logits=np.zeros(3), out=None) is np
    True
    """
    found: dict[str, str] = {}
    for i, a in enumerate(args):
        backend = _backend_name(a)
        if backend is not None:
            found.setdefault(backend, f"argument {i}")
    for name, a in arrays.items():
        if a is None:
            continue
        backend = _backend_name(a)
        if backend is None:
            raise TypeError(
                f"Invalid type of {name}: expected numpy.ndarray or cupy.ndarray, "
                f"got {type(a).__module__}.{type(a).__qualname__}")
        found.setdefault(backend, name)
    if len(found) > 1:
        raise TypeError(
            "Mixed array backends: {} is a numpy.ndarray but {} is a cupy.ndarray; "
            "move both to the same device first".format(found["numpy"], found["cupy"]))
    if found.get("cupy") is not None:
        return cupy_module()
    return numpy


def is_stream_capturing(xp):
    """True when the current CuPy stream is capturing a CUDA graph.

    Host synchronisation (reading a device value) is illegal during capture,
    so value checks and data-dependent early returns consult this first.
    """
    if xp is numpy:
        return False
    try:
        return bool(xp.cuda.get_current_stream().is_capturing())
    except Exception:  # noqa: BLE001 - older CuPy without capture support
        return False


_KERNELS_ENABLED = [True]


def use_kernels(xp):
    """True when a CuPy input should run the CUDA kernels.

    False for NumPy, and for CuPy when :func:`set_kernels_enabled` turned them
    off (then the array-generic reference runs on the GPU: slow, exact; handy
    to bisect a kernel bug).
    """
    return xp is not numpy and _KERNELS_ENABLED[0]


def set_kernels_enabled(enabled: bool) -> bool:
    """Switch CuPy inputs between the CUDA kernels (True) and the generic reference.

    Parameters
    ----------
    enabled : bool
        True: CuPy inputs run the CUDA kernels; False: they run the
        array-generic reference on the GPU (slow, exact; handy to bisect).

    Returns
    -------
    bool
        The previous setting.

    Examples
    --------
    >>> import cpsparse
    >>> previous = cpsparse.set_kernels_enabled(False)   # CuPy runs the reference
    >>> cpsparse.set_kernels_enabled(previous)
    False
    """
    previous = _KERNELS_ENABLED[0]
    _KERNELS_ENABLED[0] = bool(enabled)
    return previous


class KernelFallbackWarning(UserWarning):
    """A CuPy call ran the float64 reference on the GPU: no kernel covers its shape."""


_FALLBACKS_WARNED: set[tuple[str, Any]] = set()


def warn_fallback(op, shape, why):
    """Warn, once per (op, shape), that a CuPy call of ``op`` runs the reference.

    The op decides to fall back (a launcher never does); the fallback is exact
    but slow, and never silent.
    """
    key = (op, shape)
    if key in _FALLBACKS_WARNED:
        return
    _FALLBACKS_WARNED.add(key)
    warnings.warn(f"cpsparse.{op}: no CUDA kernel covers {why} (shape {shape}); running "
                  f"the float64 reference on the GPU instead (exact, slow)",
                  KernelFallbackWarning, stacklevel=3)
