"""The array module of an array, for the array-generic reference code."""

import numpy

from cpsparse import _backend


def xp_of(a):
    """``cupy`` for a CuPy array, else ``numpy``."""
    return _backend.cupy_module() if _backend.is_cupy_array(a) else numpy


def to_host(a):
    """A NumPy view or copy of a NumPy or CuPy array (the reference's loop bounds)."""
    return a.get() if _backend.is_cupy_array(a) else numpy.asarray(a)
