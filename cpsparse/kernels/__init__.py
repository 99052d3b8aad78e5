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
