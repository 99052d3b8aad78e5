"""The array module of an array, for the array-generic reference code."""

import numpy

from cpsparse import _backend


def xp_of(a):
    """``cupy`` for a CuPy array, else ``numpy``."""
    return _backend.cupy_module() if _backend.is_cupy_array(a) else numpy
