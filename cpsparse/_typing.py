"""Type aliases of the public API's annotations (for type checkers; no runtime cost).

Every op takes and returns NumPy or CuPy arrays: ``Array`` is their union for a
type checker. CuPy ships no type information, so its half reads as ``Any``
(and CuPy is imported only by the type checker, never at run time). At run time
every alias here is a plain object: the modules use ``from __future__ import
annotations``, so no annotation is ever evaluated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

__all__ = ["Array", "IntLike", "FloatLike", "ScaleFormat", "ModuleLike", "DTypeLike"]

if TYPE_CHECKING:
    from types import ModuleType
    from typing import TypeAlias

    import cupy
    import numpy

    #: A NumPy array or a CuPy array.
    Array: TypeAlias = Union[numpy.ndarray[Any, Any], cupy.ndarray]
    #: What the int arguments accept (checked as ``numbers.Integral``, bool refused).
    IntLike: TypeAlias = Union[int, numpy.integer[Any]]
    #: What the float arguments accept (a real number, NumPy floats included).
    FloatLike: TypeAlias = Union[float, numpy.floating[Any]]
    #: An FP8 scale format: ``"ue8m0"`` (power-of-two scales) or ``None`` (float32),
    #: checked at run time (a ``str``, so a config field can carry it).
    ScaleFormat: TypeAlias = Optional[str]
    #: ``numpy``, ``cupy``, or one of the names ``"numpy"``, ``"cupy"``, ``"auto"``.
    ModuleLike: TypeAlias = Union[ModuleType, str]
    #: A dtype argument: a name (``"bfloat16"``), a NumPy/ml_dtypes scalar type or a dtype.
    DTypeLike: TypeAlias = Union[str, type, numpy.dtype[Any]]
else:
    Array = IntLike = FloatLike = ScaleFormat = ModuleLike = DTypeLike = Any
