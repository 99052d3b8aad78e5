"""FP8 quantization and indexer key cache kernels (insert, gather)."""

import numpy

from cpsparse import raw_kernels
from cpsparse.kernels import WARPS_PER_BLOCK, blocks_for, f32, i32, i64, index_i32

MAX_GROUP = 32 * 4 * 8          # CPS_MAX_VEC in quant.cu


def supports_group(size):
    return size % 4 == 0 and size <= MAX_GROUP


def quantize_fp8(cp, x, block_size, scale_fmt, eps):
    """codes uint8 x.shape, scales float32 [..., L // block_size] (float32 x)."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    codes = cp.empty(x.shape, dtype=cp.uint8)
    scales = cp.empty(x.shape[:-1] + (x.shape[-1] // block_size,), dtype=cp.float32)
    n_groups = scales.size
    if n_groups:
        fn = raw_kernels.get_function("quant", "cps_quantize_fp8")
        fn((blocks_for(n_groups, WARPS_PER_BLOCK),), (32 * WARPS_PER_BLOCK,),
           (x, codes, scales, i64(n_groups), i32(block_size), f32(numpy.float32(eps)),
            i32(scale_fmt == "ue8m0")))
    return codes, scales


def indexer_insert(cp, cache, k, slot_mapping, eps):
    n = k.shape[0]
    if n == 0:
        return
    k = cp.ascontiguousarray(k, dtype=cp.float32)
    fn = raw_kernels.get_function("quant", "cps_indexer_k_quant_and_cache")
    fn((blocks_for(n, WARPS_PER_BLOCK),), (32 * WARPS_PER_BLOCK,),
       (k, index_i32(cp, slot_mapping), cache.data, i64(cache.num_slots), i64(n),
        i32(cache.head_dim), i32(cache.block_size),
        f32(numpy.float32(eps)), i32(cache.scale_fmt == "ue8m0")))


def indexer_gather(cp, cache, block_table, cu_seq_lens, cu_host):
    n = int(cu_host[-1])
    codes = cp.empty((n, cache.head_dim), dtype=cp.uint8)
    scales = cp.empty((n,), dtype=cp.float32)
    if n == 0:
        return codes, scales
    lens = numpy.diff(cu_host)
    req_of_row = cp.asarray(numpy.repeat(numpy.arange(lens.size, dtype=numpy.int32), lens))
    fn = raw_kernels.get_function("quant", "cps_indexer_k_gather")
    fn((blocks_for(n, WARPS_PER_BLOCK),), (32 * WARPS_PER_BLOCK,),
       (cache.data, i32(cache.num_blocks), index_i32(cp, block_table),
        i32(block_table.shape[1]), index_i32(cp, cu_seq_lens), req_of_row,
        codes, scales, i64(n), i32(cache.head_dim), i32(cache.block_size)))
    return codes, scales
