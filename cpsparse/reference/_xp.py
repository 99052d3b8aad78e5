"""The array module of an array, for the array-generic reference code."""

from __future__ import annotations

from typing import Any

import numpy

from cpsparse import _backend


xp_of = _backend.xp_of          # one definition (paging uses it too)


def to_host(a: Any) -> numpy.ndarray[Any, Any]:
    """A NumPy view or copy of a NumPy or CuPy array (the reference's loop bounds)."""
    return a.get() if _backend.is_cupy_array(a) else numpy.asarray(a)
