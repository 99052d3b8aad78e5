"""The NumPy reference of every DSA op: the CPU backend and the test oracle.

Every function here is array-generic (NumPy or CuPy), accumulates in float64
and stores float32. These functions do **not** validate their inputs: call
the public ops (:mod:`cpsparse`, :mod:`cpsparse.indexer`) for that. Use this
package directly when you validate a kernel of your own and want the exact
formula with no dispatch in between.
"""

from cpsparse.reference import attention, cache, fp4, fp8, indexer  # noqa: F401
