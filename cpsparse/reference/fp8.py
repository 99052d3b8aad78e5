"""FP8 (OCP e4m3fn) and bfloat16 codecs and group quantization, array-generic.

Written with integer bit operations only, so the same code runs on NumPy and
CuPy (which has no fp8 or bfloat16 dtype); the tests check it bit for bit
against ml_dtypes. Codes travel as ``uint8`` (e4m3) and ``uint16`` (bf16).

Arithmetic contract (what a kernel must reproduce bit for bit):

* ``amax = max|v|`` over a group (exact in float32);
* ``s = fl32(max(amax, fl32(eps)) / 448)`` (one correctly rounded division);
* ``ue8m0``: ``s = 2**ceil(log2 s)``, exact through ``frexp``;
* ``code = e4m3(fl32(v / s))``: correctly rounded float32 division, then
  round-to-nearest-even to e4m3, saturating to +-448; NaN stays NaN.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy

from cpsparse.reference._xp import xp_of

if TYPE_CHECKING:
    from cpsparse._typing import Array, FloatLike, ScaleFormat

E4M3_MAX = 448.0
FLT_MIN = float(numpy.finfo(numpy.float32).tiny)

_E4M3_TABLE = None


def _e4m3_table():
    """float32[256]: the value of every e4m3fn code (0x7F, 0xFF are NaN)."""
    global _E4M3_TABLE
    if _E4M3_TABLE is None:
        c = numpy.arange(256)
        sign = numpy.where(c & 0x80, -1.0, 1.0)
        exp = (c >> 3) & 0xF
        man = c & 0x7
        mag = numpy.where(exp == 0, man * 2.0 ** -9, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
        mag = numpy.where((exp == 15) & (man == 7), numpy.nan, mag)
        _E4M3_TABLE = (sign * mag).astype(numpy.float32)
    return _E4M3_TABLE


def e4m3_encode(x: Array) -> Array:
    """Round float32 values to e4m3fn codes (RNE, saturate to +-448, NaN -> 0x7F).

    Infinities saturate to +-448 like the CUDA ``satfinite`` conversion.
    """
    xp = xp_of(x)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    u = x.view(xp.uint32)
    sign = ((u >> 24) & 0x80).astype(xp.uint8)
    a = u & xp.uint32(0x7FFFFFFF)
    # Normal range (|x| >= 2**-6): round the 23-bit mantissa to 3 bits at
    # bit 20 with ties to even, then rebias the exponent from 127 to 7. A
    # mantissa carry correctly bumps the exponent.
    rounded = (a + xp.uint32(0x7FFFF) + ((a >> 20) & xp.uint32(1))) >> 20
    normal = rounded.astype(xp.int64) - ((127 - 7) << 3)
    normal = xp.minimum(normal, 0x7E)  # saturate: 0x7E is 448
    # Subnormal range: multiples of 2**-9; scaling by 512 is exact in float32,
    # rint rounds half to even. Gives 0..8 (8 is the smallest normal, 0x08).
    is_normal = a >= xp.uint32(0x3C800000)
    small = xp.where(is_normal, xp.float32(0), xp.abs(x))  # keeps inf/NaN out of the cast
    sub = xp.rint(small * xp.float32(512.0)).astype(xp.int64)
    code = xp.where(is_normal, normal, sub).astype(xp.uint8)
    code = xp.where(a > xp.uint32(0x7F800000), xp.uint8(0x7F), code)  # NaN
    return code | sign


_DEVICE_TABLES: dict[Any, Any] = {}


def e4m3_decode(codes: Array) -> Array:
    """float32 values of e4m3fn codes (uint8)."""
    xp = xp_of(codes)
    if xp is numpy:
        return _e4m3_table()[codes]
    # One copy of the table per device: no host-to-device upload per call.
    dev = xp.cuda.runtime.getDevice()
    table = _DEVICE_TABLES.get(dev)
    if table is None:
        table = _DEVICE_TABLES[dev] = xp.asarray(_e4m3_table())
    return table[codes]


def bf16_encode(x: Array) -> Array:
    """Round float32 values to bfloat16 bit patterns (uint16, RNE; NaN kept quiet)."""
    xp = xp_of(x)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    u = x.view(xp.uint32)
    rounded = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    nan = ((u >> 16) | xp.uint32(0x40)).astype(xp.uint16)
    return xp.where((u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000), nan, rounded)


def bf16_decode(bits: Array) -> Array:
    """float32 values of bfloat16 bit patterns (uint16)."""
    xp = xp_of(bits)
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def to_float32(x: Array) -> Array:
    """float32 copy of a float16/32/64 or ml_dtypes bfloat16 array."""
    xp = xp_of(x)
    return xp.asarray(x).astype(xp.float32)


def to_float64(x: Array) -> Array:
    xp = xp_of(x)
    return xp.asarray(x).astype(xp.float64)


def ceil_log2(s: Array) -> Array:
    """int32 ``ceil(log2(s))`` of positive finite floats, exactly (through ``frexp``):
    the exponent of the ue8m0 scale that rounds ``s`` up to a power of two."""
    xp = xp_of(s)
    with numpy.errstate(invalid="ignore"):
        mant, exp = xp.frexp(s.astype(xp.float64))
    # s = mant * 2**exp with mant in [0.5, 1): a power of two has mant 0.5.
    return xp.where(mant == 0.5, exp - 1, exp).astype(xp.int32)


def ue8m0_value(byte: Array) -> Array:
    """float64 ``2 ** (byte - 127)`` of ue8m0 scale bytes (exact)."""
    xp = xp_of(byte)
    return xp.ldexp(xp.ones(byte.shape, xp.float64), byte.astype(xp.int32) - 127)


def group_scales(amax: Array, eps: FloatLike, scale_fmt: ScaleFormat) -> Array:
    """float32 scales from float32 group maxima (see the module contract)."""
    xp = xp_of(amax)
    eps32 = float(numpy.float32(eps))
    s = (xp.maximum(amax.astype(xp.float64), eps32) / E4M3_MAX).astype(xp.float32)
    if scale_fmt == "ue8m0":
        up = xp.ldexp(xp.ones(s.shape, xp.float64), ceil_log2(s))
        s = xp.where(xp.isfinite(s), up, s.astype(xp.float64)).astype(xp.float32)
    return s                                             # (an inf scale stays inf)


def quantize_groups(x: Array, block_size: int, scale_fmt: ScaleFormat,
                    eps: FloatLike) -> tuple[Array, Array]:
    """codes uint8 x.shape, scales float32 [..., last // block_size]."""
    xp = xp_of(x)
    x32 = to_float32(x)
    lead = x32.shape[:-1]
    groups = x32.reshape(lead + (x32.shape[-1] // block_size, block_size))
    # NaN is ignored by the group maximum, as fmaxf does in the kernels.
    mag = xp.abs(groups)
    mag = xp.where(xp.isnan(mag), xp.float32(0), mag)
    amax = mag.max(axis=-1) if groups.size else xp.zeros(groups.shape[:-1], xp.float32)
    scales = group_scales(amax, eps, scale_fmt)
    with numpy.errstate(invalid="ignore", over="ignore"):
        q = (groups.astype(xp.float64) / scales[..., None].astype(xp.float64)).astype(
            xp.float32)
    return e4m3_encode(q).reshape(x32.shape), scales


def dequantize_groups(codes: Array, scales: Array, block_size: int) -> Array:
    xp = xp_of(codes)
    vals = e4m3_decode(codes).astype(xp.float64)
    lead = codes.shape[:-1]
    g = vals.reshape(lead + (codes.shape[-1] // block_size, block_size))
    return (g * scales[..., None].astype(xp.float64)).reshape(codes.shape).astype(xp.float32)
