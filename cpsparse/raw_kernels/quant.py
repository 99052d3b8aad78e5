"""FP8 quantization, indexer key cache (insert, gather) and fp8_ds_mla cache insert
kernels, launchers of ``quant.cu`` beside this file; also the int64 -> int32 index
conversion and the timing module's stream hold."""

import numpy

from cpsparse import raw_kernels
from cpsparse.raw_kernels import WARPS_PER_BLOCK, blocks_for, index_i32
from cpsparse.reference import cache as cache_layout

MAX_VEC = 8                     # float4 vectors a lane holds (CPS_MAX_VEC)
MAX_GROUP = 32 * 4 * MAX_VEC    # largest quantization group (one warp)
# The fp8_ds_mla record cps_mla_quant_and_cache writes (cpsparse.reference.cache owns it).
MLA_LORA, MLA_ROPE = 512, 64
MLA_RECORD_BYTES = cache_layout.mla_token_bytes(MLA_LORA, MLA_ROPE)
# The scale floor of its groups, as the float32 the kernel takes.
MLA_EPS = float(numpy.float32(cache_layout.MLA_SCALE_EPS))

raw_kernels.register_module(
    "quant", ["common.cuh", "quant.cu"], capabilities=raw_kernels.at_least(8, 0),
    ops=("quantize_fp8", "IndexerKCache.insert", "IndexerKCache.gather", "MLAKVCache.insert"),
    needs="portable CUDA",
    defines=dict(CPS_MAX_VEC=MAX_VEC, CPS_MLA_LORA=MLA_LORA,
                 CPS_MLA_GROUP=cache_layout.MLA_QUANT_BLOCK, CPS_MLA_ROPE=MLA_ROPE,
                 CPS_MLA_RECORD_BYTES=MLA_RECORD_BYTES))


# C parameter lists of quant.cu's kernels (raw_kernels.Kernel: P pointer, i int32,
# q int64, f float32).
QUANTIZE_ARGS = "PPP q i f i"       # x, codes, scales, n_groups, group, eps, ue8m0
INSERT_ARGS = "PPP q q i i f i"     # k, slots, cache, num_slots, n, D, block, eps, ue8m0
GATHER_ARGS = "P i P i PPPP q i i"  # cache, nb, table, cols, cu, req, codes, scales, n, D, bs
SCATTER_ARGS = "PPP q q i"          # records, slots, data, num_slots, n, record_bytes
# cps_mla_quant_and_cache: kv_c, kv row stride, k_pe, k_pe row stride, slots, data,
# num_slots, n, eps
MLA_INSERT_ARGS = "P q P q PP q q f"
INDEX_TO_I32_ARGS = "PP q"          # src, dst, n
HOLD_ARGS = "q"                     # ns


def supports_group(size):
    return size % 4 == 0 and size <= MAX_GROUP


def quantize_fp8(cp, x, block_size, scale_fmt, eps):
    """codes uint8 x.shape, scales float32 [..., L // block_size] (float32 x)."""
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    codes = cp.empty(x.shape, dtype=cp.uint8)
    scales = cp.empty(x.shape[:-1] + (x.shape[-1] // block_size,), dtype=cp.float32)
    n_groups = scales.size
    if n_groups:
        fn = raw_kernels.kernel("quant", "cps_quantize_fp8", QUANTIZE_ARGS)
        fn((blocks_for(n_groups, WARPS_PER_BLOCK),), (32 * WARPS_PER_BLOCK,),
           (x, codes, scales, n_groups, block_size, eps, int(scale_fmt == "ue8m0")))
    return codes, scales


def indexer_insert(cp, cache, k, slot_mapping, eps):
    n = k.shape[0]
    if n == 0:
        return
    k = cp.ascontiguousarray(k, dtype=cp.float32)
    fn = raw_kernels.kernel("quant", "cps_indexer_k_quant_and_cache", INSERT_ARGS)
    fn((blocks_for(n, WARPS_PER_BLOCK),), (32 * WARPS_PER_BLOCK,),
       (k, index_i32(cp, slot_mapping), cache.data, cache.num_slots, n, cache.head_dim,
        cache.block_size, eps, int(cache.scale_fmt == "ue8m0")))


def indexer_gather(cp, cache, block_table, cu_seq_lens, num_keys, key_req_ids):
    """codes uint8 [num_keys, D], scales float32 [num_keys] of a packed batch; row n of
    request ``key_req_ids[n]`` is position ``n - cu_seq_lens[r]`` (no host reads)."""
    n = int(num_keys)
    codes = cp.empty((n, cache.head_dim), dtype=cp.uint8)
    scales = cp.empty((n,), dtype=cp.float32)
    if n == 0:
        return codes, scales
    fn = raw_kernels.kernel("quant", "cps_indexer_k_gather", GATHER_ARGS)
    fn((blocks_for(n, WARPS_PER_BLOCK),), (32 * WARPS_PER_BLOCK,),
       (cache.data, cache.num_blocks, index_i32(cp, block_table), block_table.shape[1],
        index_i32(cp, cu_seq_lens), index_i32(cp, key_req_ids), codes, scales, n,
        cache.head_dim, cache.block_size))
    return codes, scales


def scatter_records(cp, data, records, slot_mapping):
    """Write records uint8 [N, T] into ``data`` [num_blocks, B, T] at their slots (T a
    multiple of 4, 4-byte aligned); slot -1 and out-of-range slots are skipped."""
    n = records.shape[0]
    if n == 0:
        return
    num_slots = data.shape[0] * data.shape[1]
    fn = raw_kernels.kernel("quant", "cps_scatter_records", SCATTER_ARGS)
    fn((blocks_for(n, WARPS_PER_BLOCK),), (32 * WARPS_PER_BLOCK,),
       (cp.ascontiguousarray(records), index_i32(cp, slot_mapping), data, num_slots, n,
        records.shape[1]))


def supports_mla_insert(cache):
    """True when :func:`mla_insert` writes ``cache``'s records: an fp8_ds_mla cache of
    512 latent and 64 RoPE values a token, its data 4-byte aligned."""
    return (cache.kv_lora_rank, cache.rope_dim, cache.token_bytes) == \
        (MLA_LORA, MLA_ROPE, MLA_RECORD_BYTES) and cache.data.data.ptr % 4 == 0


def _rows_f32(cp, x, width):
    """x as float32 rows the kernel reads by 16-byte loads: itself when it already is
    (last dim contiguous, rows and base 16-byte aligned: a slice of a wider projection
    output qualifies), else a contiguous float32 copy. Returns (rows, row stride)."""
    if x.dtype == cp.float32 and x.ndim == 2 and x.shape[1] == width and x.strides[1] == 4 \
            and x.strides[0] % 16 == 0 and x.data.ptr % 16 == 0:
        return x, x.strides[0] // 4
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    return x, width


def mla_insert(cp, cache, kv_c, k_pe, slot_mapping):
    """Encode and store fp8_ds_mla records (:func:`cpsparse.reference.cache.mla_encode`
    then :func:`~cpsparse.reference.cache.mla_insert`, bit for bit) in one launch:
    kv_c [N, 512], k_pe [N, 64] (any float dtype, row strides allowed), slot -1 and
    out-of-range slots skipped."""
    n = kv_c.shape[0]
    if n == 0:
        return
    kv, kv_stride = _rows_f32(cp, kv_c, MLA_LORA)
    pe, pe_stride = _rows_f32(cp, k_pe, MLA_ROPE)
    fn = raw_kernels.kernel("quant", "cps_mla_quant_and_cache", MLA_INSERT_ARGS)
    fn((blocks_for(n, WARPS_PER_BLOCK),), (32 * WARPS_PER_BLOCK,),
       (kv, kv_stride, pe, pe_stride, index_i32(cp, slot_mapping), cache.data,
        cache.num_slots, n, MLA_EPS))


def hold_stream(cp, ms):
    """Keep the current stream busy for ``ms`` milliseconds of GPU time (one thread
    sleeping on the GPU's global timer): what is enqueued next waits behind it."""
    fn = raw_kernels.kernel("quant", "cps_hold_ns", HOLD_ARGS)
    fn((1,), (1,), (int(ms * 1e6),))
