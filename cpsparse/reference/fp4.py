"""MXFP4 (OCP e2m1 with one ue8m0 scale per 32 values) for the indexer key cache,
array-generic (NumPy or CuPy, integer and float64 operations only).

Arithmetic contract (DeepGEMM's ``per_token_cast_to_fp4`` with ue8m0 scales and
gran_k 32, what a kernel must reproduce bit for bit):

* ``amax = max|v|`` over a group of 32 (NaN ignored, as the FP8 quantizer does);
* ``s = 2 ** ceil(log2(fl32(max(amax, 1e-4) / 6)))``, its byte ``log2(s) + 127``;
* ``code = e2m1(fl32(v / s))``: the magnitude code counts the midpoints
  0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 that ``|v / s|`` exceeds (round to nearest,
  ties toward zero; saturating at 6), bit 3 is the sign (never on a zero);
* two codes a byte, the even element in the low nibble.

Every e2m1 value times a power of two is exact in float64, so decoding is exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy

from cpsparse.reference import fp8
from cpsparse.reference._xp import xp_of

if TYPE_CHECKING:
    from cpsparse._typing import Array

GROUP = 32
E2M1_MAX = 6.0
AMAX_FLOOR = 1e-4
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_encode(x: Array) -> Array:
    """uint8 codes (0..15) of float values (already divided by their scale)."""
    xp = xp_of(x)
    mag = xp.abs(x.astype(xp.float64))
    code = xp.zeros(x.shape, dtype=xp.uint8)
    for m in _MIDPOINTS:
        code += (mag > m).astype(xp.uint8)            # NaN exceeds nothing: code 0
    neg = (x < 0) & (code != 0)
    return code | (neg.astype(xp.uint8) << 3)


def e2m1_decode(codes: Array) -> Array:
    """float64 values of uint8 codes (0..15)."""
    xp = xp_of(codes)
    table = xp.asarray(numpy.array(E2M1_VALUES + tuple(-v for v in E2M1_VALUES)))
    return table[codes.astype(xp.int64) & 0xF]


def scale_bytes(x: Array) -> Array:
    """uint8 ue8m0 bytes [..., D / 32] of the groups of x [..., D]."""
    xp = xp_of(x)
    x32 = fp8.to_float32(x)
    g = x32.reshape(x32.shape[:-1] + (x32.shape[-1] // GROUP, GROUP))
    mag = xp.abs(g)
    mag = xp.where(xp.isnan(mag), xp.float32(0), mag)
    amax = mag.max(axis=-1) if g.size else xp.zeros(g.shape[:-1], xp.float32)
    s = xp.maximum(amax, xp.float32(AMAX_FLOOR)) / xp.float32(E2M1_MAX)      # float32
    return xp.clip(fp8.ceil_log2(s) + 127, 1, 254).astype(xp.uint8)


def quantize(x: Array) -> tuple[Array, Array]:
    """(packed uint8 [..., D / 2], scale bytes uint8 [..., D / 32]) of x [..., D]."""
    xp = xp_of(x)
    x32 = fp8.to_float32(x)
    sb = scale_bytes(x32)
    lead, d = x32.shape[:-1], x32.shape[-1]
    g = x32.reshape(lead + (d // GROUP, GROUP)).astype(xp.float64)
    scale = fp8.ue8m0_value(sb)
    with numpy.errstate(invalid="ignore", over="ignore"):
        scaled = (g / scale[..., None]).astype(xp.float32)
    codes = e2m1_encode(scaled).reshape(lead + (d,))
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(xp.uint8), sb


def dequantize(packed: Array, sb: Array) -> Array:
    """float64 [..., D] of packed codes [..., D / 2] and scale bytes [..., D / 32]."""
    xp = xp_of(packed)
    lead, half = packed.shape[:-1], packed.shape[-1]
    codes = xp.zeros(lead + (2 * half,), dtype=xp.uint8)
    codes[..., 0::2] = packed & 0xF
    codes[..., 1::2] = packed >> 4
    vals = e2m1_decode(codes).reshape(lead + (2 * half // GROUP, GROUP))
    return (vals * fp8.ue8m0_value(sb)[..., :2 * half // GROUP, None]).reshape(
        lead + (2 * half,))
