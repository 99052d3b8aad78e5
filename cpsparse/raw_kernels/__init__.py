"""CUDA C++ sources of cpsparse's kernels (``.cu``/``.cuh`` files beside this
module) and the loader that compiles them with ``cupy.RawModule``.
"""
