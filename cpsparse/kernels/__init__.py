"""Launchers of cpsparse's CUDA kernels for CuPy arrays.

Each function here takes already-validated CuPy arrays (the public ops in
:mod:`cpsparse` validate), allocates outputs, and launches a kernel from
:mod:`cpsparse.raw_kernels` on CuPy's current stream. Nothing here runs for
NumPy inputs.
"""

import numpy

WARPS_PER_BLOCK = 8


def blocks_for(n, per_block):
    return max(1, -(-int(n) // per_block))


i32 = numpy.int32
i64 = numpy.int64
f32 = numpy.float32


def index_i32(cp, a):
    """``a`` as the int32 the kernels take: itself if int32, else a saturating copy.

    int64 index arrays (vLLM's ``slot_mapping``, NumPy's and torch's default
    integers) cost one elementwise pass; a value outside int32 saturates to
    -2**31 or 2**31 - 1, which every kernel treats as out of range (masked or
    skipped), never wrapping onto a valid index.
    """
    if a is None or a.dtype == cp.int32:
        return a
    from cpsparse import raw_kernels
    a = cp.ascontiguousarray(a)
    out = cp.empty(a.shape, dtype=cp.int32)
    n = a.size
    if n:
        fn = raw_kernels.get_function("quant", "cps_index_to_i32")
        fn((min(blocks_for(n, 256), 132 * 16),), (256,), (a, out, i64(n)))
    return out

