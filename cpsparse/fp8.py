"""FP8 (OCP e4m3fn) group quantization.

See the contract page of the docs (``docs/contract.md``, "FP8 quantization") and
:mod:`cpsparse.reference.fp8` for the exact arithmetic (bit for bit what the CUDA
kernels reproduce).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cpsparse import _backend
from cpsparse import _validation as V
from cpsparse.raw_kernels import quant as _kquant
from cpsparse.reference import fp8 as _ref

if TYPE_CHECKING:
    from cpsparse._typing import Array, FloatLike, IntLike, ScaleFormat

__all__ = ["quantize_fp8", "dequantize_fp8", "E4M3_MAX"]

E4M3_MAX = _ref.E4M3_MAX
SCALE_FORMATS = ("ue8m0", None)


def quantize_fp8(x: Array, block_size: IntLike = 128, scale_fmt: ScaleFormat = "ue8m0",
                 eps: FloatLike = 1e-4) -> tuple[Array, Array]:
    """Quantize the last axis of ``x`` to e4m3fn codes in groups of ``block_size``.

    Parameters
    ----------
    x : ndarray of float16, float32, float64 or bfloat16, shape [..., L]
        ``L`` must be a multiple of ``block_size``.
    block_size : int
        Values per scale (``quant_block_size``), 128 in DeepSeek-V3.2.
    scale_fmt : {"ue8m0", None}
        ``"ue8m0"`` rounds every scale up to a power of two (what the indexer
        uses); ``None`` keeps the plain float32 scale ``max(amax, eps) / 448``.
    eps : float
        Floor of ``amax`` (1e-4 for indexer keys, 1e-10 for queries); it must
        be positive and finite in float32.

    Notes
    -----
    NaN values are ignored by ``amax`` (and encode as NaN); an infinite value
    makes its group's scale infinite (finite values then encode as 0).

    Returns
    -------
    codes : ndarray of uint8, same shape as ``x``
        e4m3fn bit patterns (CuPy has no fp8 dtype; view them as
        ``ml_dtypes.float8_e4m3fn`` on the host if you like).
    scales : ndarray of float32, shape [..., L // block_size]

    Examples
    --------
    >>> import numpy as np, cpsparse
    >>> x = np.array([[0.5, -1.0, 2.0, 3.5]], dtype=np.float32)
    >>> codes, scales = cpsparse.quantize_fp8(x, block_size=4)
    >>> scales           # 3.5 / 448 rounded up to a power of two
    array([[0.0078125]], dtype=float32)
    >>> cpsparse.dequantize_fp8(codes, scales, block_size=4)
    array([[ 0.5, -1. ,  2. ,  3.5]], dtype=float32)
    """
    xp = _backend.get_array_module(x=x)
    block_size = V.check_positive_int("block_size", block_size)
    V.check_array("x", x, dtype=V.FLOAT_DTYPES)
    if x.ndim < 1:
        raise ValueError(f"Invalid shape of x: expected at least 1 dimension, got {x.shape}")
    V.check_block_multiple("x", x.shape[-1], block_size)
    V.check_choice("scale_fmt", scale_fmt, SCALE_FORMATS)
    V.check_float32_positive("eps", eps)
    if _backend.use_kernels(xp):
        if _kquant.supports_group(block_size):
            return _kquant.quantize_fp8(xp, x, block_size, scale_fmt, eps)
        _backend.warn_fallback("quantize_fp8", (block_size,), "this block_size")
    return _ref.quantize_groups(x, block_size, scale_fmt, eps)


def dequantize_fp8(codes: Array, scales: Array, block_size: IntLike = 128) -> Array:
    """Decode e4m3fn ``codes`` and multiply each group by its scale.

    Parameters
    ----------
    codes : ndarray of uint8, shape [..., L]
    scales : ndarray of float32, shape [..., L // block_size]
    block_size : int

    Returns
    -------
    ndarray of float32, shape [..., L]

    Examples
    --------
    >>> import numpy as np, cpsparse
    >>> codes = np.array([[0x38, 0xB8]], dtype=np.uint8)   # +1.0 and -1.0
    >>> cpsparse.dequantize_fp8(codes, np.array([[0.25]], np.float32), block_size=2)
    array([[ 0.25, -0.25]], dtype=float32)
    """
    _backend.get_array_module(codes=codes, scales=scales)
    block_size = V.check_positive_int("block_size", block_size)
    codes = V.check_codes("codes", codes)
    if codes.ndim < 1:
        raise ValueError(f"Invalid shape of codes: expected at least 1 dimension, "
                         f"got {codes.shape}")
    V.check_block_multiple("codes", codes.shape[-1], block_size)
    groups = codes.shape[-1] // block_size
    V.check_array("scales", scales, dtype="float32", shape=codes.shape[:-1] + (groups,),
                  shape_desc="[..., L // block_size]")
    return _ref.dequantize_groups(codes, scales, block_size)
