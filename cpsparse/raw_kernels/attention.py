"""Sparse / dense MLA attention and slot mapping on CUDA (CuPy arrays).

Launchers of ``attention.cu`` beside this file. The public ops in
:mod:`cpsparse.attention` validate, check :func:`supports` and then call these
(the op decides what to do with a shape the kernel does not cover).

Covered: head dim 576 (= 512 latent + 64 RoPE), ``d_v`` even and <= 512, any
number of heads (groups of 64 per CTA, the last one partial), any top-k; and
DeepSeek-V4's MODEL1 cache (head dim 512 = 448 NoPE + 64 RoPE, the key is the
value) with FlashMLA's extras in the same kernel: per-token list lengths, an
extra cache (the sliding window) in the same softmax, the attention sink
(:func:`sparse_mla_attention_model1`).

Split-KV decoding: when the (token, head group) units would leave SMs idle (small
decode batches), each unit's key tiles are shared among several CTAs
(:func:`choose_splits`, a function of the shapes and the SM count: graph-safe),
whose partial rows and lse are merged by ``cps_mla_combine_few_rows`` (few rows: every
load in flight at once) or ``cps_mla_combine`` (:func:`combine_kernel_name`); B=1, H=128
runs 32 CTAs instead of 2 (126 us -> 25 us on the H200, ``benchmarks/bench_splits.py``;
15 us since the few-rows merge).

Precision: queries and keys enter the tensor cores as bf16 (round to nearest
even), products accumulate in fp32, probabilities are rounded to bf16 for P V.
q may be bfloat16 (CuPy >= 14, ml_dtypes' dtype: read as is), float16 or float32
(rounded to bf16 as the kernel loads it; float64 is cast to float32 first); a
dense workspace is used as is when bfloat16, else rounded to bf16 once, in a
pre-pass over the rows (``to_bf16``); the fp8_ds_mla cache is dequantized tile by
tile inside the kernel (code * scale rounded to bf16, RoPE bf16 as stored). out
is written float32, bfloat16 or float16 (``out_dtype``: rounded once from the
float32 row, in the epilogue of the kernel's ``_out_bf16`` / ``_out_f16`` twin or the
split-KV merge's);
lse is float32.
"""

import math
from typing import Any

import numpy

from cpsparse import paging, raw_kernels
from cpsparse.paging import INT32_MAX
from cpsparse.raw_kernels import index_i32
from cpsparse.reference import cache as cache_layout

D_QK = 576
D_V_MAX = 512
# fp8_ds_mla: 512 codes + 4 float32 scales + 64 bf16 (ATT_REC_BYTES)
RECORD_BYTES = cache_layout.mla_token_bytes(512, 64)
HEADS_PER_CTA = 64
THREADS = 256                   # the grid-stride kernels (conversions, slot mapping)
# The attention kernels (ATT_WS_THREADS): two math warpgroups and one producer warpgroup
# that fills the K tiles (gathers bf16 rows, or reads and dequantizes fp8 records).
WS_THREADS = 384
# The fp8 decode kernel (ATT_DEC_THREADS) runs two producer warpgroups of 8 rows a warp.
DEC_THREADS = 512
# Dynamic shared memory of a CTA (ATT_SMEM_BYTES): the tiles attention.cu lays out
# (Q, two K tiles, P, row max / sum, key validity: 230912 bytes, checked there by a
# static_assert) plus 1024 bytes to align them to the 1024-byte swizzle atoms.
SMEM_BYTES = 230912 + 1024
# Split-KV decoding: when few (token, head group) units would leave SMs idle, each
# unit's key tiles are shared among up to MAX_SPLITS CTAs of at least
# MIN_TILES_PER_SPLIT tiles (64 keys) each: a CTA's fixed cost (Q load, pipeline fill,
# epilogue) is a few tiles' worth, so shorter shares stop paying.
MAX_SPLITS = 64                 # ATT_MAX_SPLITS
MIN_TILES_PER_SPLIT = 2
# The split-KV merge: one CTA a (token, head) row (ATT_COMBINE_THREADS), one kernel
# body with 16 splits' loads in flight (cps_mla_combine_few_rows, up to
# COMBINE_FEW_ROWS_PER_SM rows an SM) or 8 and at most 64 registers (cps_mla_combine,
# past it). Attention + merge replayed in a graph on an H100, 128 heads, each kernel
# forced: within 1% of each other from B=1 to B=16 (14.6, 15.9, 21.0, 28.0, 41.0 us),
# B=32 69.7 against 70.5 (docs/performance.md, "The split-KV merge's weights"). The
# pick by rows stays: the body with 16 splits' loads for every row count, in a peer A/B
# on an H100, took B=8 from 26.4 to 28.2 us (2026-12-06, "Where an fp8 decode CTA's
# time goes").
COMBINE_THREADS = 128           # ATT_COMBINE_THREADS
COMBINE_FEW_ROWS_PER_SM = 4
# The formats of q and out the kernels take (ATT_FMT_*): q's is the kernels' int q_fmt
# argument; out's is a kernel's own (its name's suffix, OUT_SUFFIX): on a runtime out
# format the compiler copied the row store once a format, and the fp8 kernel holding the
# copies ran 5-7% slower (B=128, H100; docs/performance.md).
FORMATS = {"float32": 0, "float16": 1, "bfloat16": 2}
OUT_SUFFIX = {"float32": "", "float16": "_out_f16", "bfloat16": "_out_bf16"}

raw_kernels.register_module(
    "attention", ["common.cuh", "hopper.cuh", "attention.cu"], capabilities=raw_kernels.exactly((9, 0)),
    ops=("sparse_mla_attention", "dense_mla_attention", "local_to_global_slots"),
    needs="Hopper wgmma, compiled for sm_90a", pdl=True,
    defines=dict(ATT_WS_THREADS=WS_THREADS, ATT_DEC_THREADS=DEC_THREADS, ATT_SMEM_BYTES=SMEM_BYTES,
                 ATT_MAX_SPLITS=MAX_SPLITS, ATT_COMBINE_THREADS=COMBINE_THREADS,
                 ATT_REC_BYTES=RECORD_BYTES, ATT_FMT_F32=FORMATS["float32"],
                 ATT_FMT_F16=FORMATS["float16"], ATT_FMT_BF16=FORMATS["bfloat16"],
                 # the MODEL1 page layout (cpsparse.reference.cache owns it)
                 ATT_M1_NOPE=cache_layout.MODEL1_NOPE, ATT_M1_ROW=cache_layout.MODEL1_ROW,
                 ATT_M1_SCALE_BYTES=cache_layout.MODEL1_SCALES + 1))

# C parameter lists (raw_kernels.Kernel letters).
# cps_sparse_mla_*: q, q_fmt, kv, indices, topk, num_slots, row_start, row_len
# (the causal range's length, or with indices the per-token list length), out, lse, H,
# d_v, scale_log2, splits, part_out (the partial rows, then the partial lse), sink
ATTENTION_ARGS = "P i P P ii PPPP ii f i PP"
# cps_mla_combine: part_out, out, lse, sink, splits, d_v, H
COMBINE_ARGS = "PPPP iii"
# cps_sparse_mla_model1: q, q_fmt, then per cache (main, extra) data, indices,
# lengths, topk, block_size, page_stride, num_slots; then sink, out, lse, H, d_v,
# scale_log2, splits, part_out
MODEL1_ARGS = "P i PPP ii q i PPP ii q i PPP ii f i P"
MODEL1_D_QK = 512
TO_BF16_ARGS = "PP q"                            # x, y, n
# cps_local_to_global_slots: indices, req_ids, block_table, num_reqs, max_blocks, topk,
# n, block_size, out
SLOTS_ARGS = "PPP iii q i P"


def _kernel_name(base, out_name):
    """The kernel ``base`` of an out of dtype name ``out_name`` ("float32", "float16" or
    "bfloat16"; see OUT_SUFFIX)."""
    return base + OUT_SUFFIX[out_name]


def supports(q_shape, d_v):
    """True when the kernels cover queries of ``q_shape`` [T, H, D] and this d_v."""
    return (len(q_shape) == 3 and q_shape[2] == D_QK and 0 < d_v <= D_V_MAX
            and d_v % 2 == 0)


def _aligned(cp, a):
    """``a`` itself when its data is 16-byte aligned, else an aligned copy."""
    return a if a.data.ptr % 16 == 0 else cp.array(a, copy=True)


def _q_operand(cp, q):
    """(q as the kernel reads it: 16-byte aligned, float64 cast to float32; its format)."""
    if q.dtype == cp.float64:
        q = q.astype(cp.float32)
    return _aligned(cp, q), FORMATS[q.dtype.name]


def to_bf16(cp, x):
    """bf16 bit patterns (uint16, same shape) of a float16/32/64 or bfloat16 array (a
    contiguous bfloat16 array is only viewed)."""
    if x.dtype.name == "bfloat16":
        return cp.ascontiguousarray(x).view(cp.uint16)
    if x.dtype == cp.float64:
        x = x.astype(cp.float32)
    x = cp.ascontiguousarray(x)
    y = cp.empty(x.shape, dtype=cp.uint16)
    n = x.size
    if n:
        name = "cps_f16_to_bf16" if x.dtype == cp.float16 else "cps_f32_to_bf16"
        fn = raw_kernels.kernel("attention", name, TO_BF16_ARGS)
        fn((raw_kernels.grid_stride_blocks(n, THREADS),), (THREADS,), (x, y, n))
    return y


def choose_splits(units, tiles, sms):
    """CTAs per (token, head group) unit: 1 when the units fill the GPU, else enough to
    fill it, each with at least MIN_TILES_PER_SPLIT of the ``tiles`` key tiles (and no
    empty split). A function of the shapes and the SM count only, so a captured graph
    replays the same schedule."""
    if units <= 0 or tiles < 2 * MIN_TILES_PER_SPLIT or 2 * units > sms:
        return 1
    splits = min(MAX_SPLITS, sms // units, tiles // MIN_TILES_PER_SPLIT)
    per_split = -(-tiles // splits)
    return -(-tiles // per_split)


def combine_kernel_name(rows, sms):
    """The split-KV merge kernel for ``rows`` (token, head) rows on ``sms`` SMs (see
    COMBINE_FEW_ROWS_PER_SM; a 16-bit out takes its twin, :func:`_kernel_name`)."""
    return "cps_mla_combine_few_rows" if rows <= COMBINE_FEW_ROWS_PER_SM * sms \
        else "cps_mla_combine"


_PLANS: dict[Any, Any] = {}


def _plan(tokens, heads, topk, kind, dense, sm_scale, splits, out_name="float32"):
    """(units, splits, attention kernel, combine kernel or None, log2-domain scale) of
    a launch shape on the current device, memoized (a function of the shapes only).
    ``kind``: "fp8", "bf16" or "model1"; ``topk``: the key tiles' worth of keys (both
    lists of MODEL1, each padded to whole tiles); ``out_name``: the out's dtype name."""
    key = (raw_kernels.current_device(), tokens, heads, topk, kind, dense, sm_scale, splits,
           out_name)
    plan = _PLANS.get(key)
    if plan is None:
        units = tokens * -(-heads // HEADS_PER_CTA)
        if splits is None:                 # the dense route's ranges differ per token: 1
            splits = 1 if dense else choose_splits(units, -(-topk // 64),
                                                   raw_kernels.device_facts().sms)
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"Invalid splits: expected 1 <= splits <= {MAX_SPLITS}, "
                             f"got {splits}")
        combine = None if splits == 1 else raw_kernels.kernel(
            "attention", _kernel_name(combine_kernel_name(
                tokens * heads, raw_kernels.device_facts().sms), out_name), COMBINE_ARGS)
        # Split, the attention kernel writes float32 partials whatever out is (the merge
        # writes out): the float32 kernel. A 16-bit-out kernel has its own 16-bit
        # epilogue only (attention.cu att_write_rows: it must run unsplit).
        fn = raw_kernels.kernel("attention",
                                _kernel_name(f"cps_sparse_mla_{kind}",
                                             out_name if splits == 1 else "float32"),
                                MODEL1_ARGS if kind == "model1" else ATTENTION_ARGS,
                                SMEM_BYTES)
        plan = (units, splits, fn, combine, float(numpy.float32(sm_scale * math.log2(math.e))))
        if len(_PLANS) > 1024:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


_LAUNCHES: dict[Any, Any] = {}


def prepare(cp, tokens, heads, topk, fp8, dense, sm_scale, d_v, splits=None,
            out_dtype=numpy.dtype(numpy.float32)):
    """The fp8 / bf16 rows kernel's launch of one call shape on the current device,
    memoized: ``run(q, q_fmt, kv, num_slots, indices, row_start, row_len, sink) ->
    (out, lse)`` on operands already in the kernel's form (16-byte aligned q and kv,
    int32 indices or ranges; :func:`_launch` makes them so; ``q_fmt``: q's FORMATS
    code). The plan (:func:`_plan`), grids, scalars and the dtype of out (float32,
    float16 or bfloat16) are fixed here; a call allocates out, lse and the split-KV
    partials, launches the attention kernel and, where the plan splits, the combine.
    Needs tokens, heads and topk (or the dense ranges) non-empty."""
    key = (raw_kernels.current_device(), tokens, heads, topk, fp8, dense, sm_scale, d_v,
           splits, out_dtype.name)
    known = _LAUNCHES.get(key)
    if known is not None:
        return known
    units, splits, fn, combine, scale_log2 = _plan(tokens, heads, topk,
                                                   "fp8" if fp8 else "bf16", dense,
                                                   sm_scale, splits, out_dtype.name)
    launch = fn.launcher((units * splits,), (DEC_THREADS if fp8 else WS_THREADS,),
                         SMEM_BYTES)
    merge = None if combine is None else combine.launcher((tokens * heads,), (COMBINE_THREADS,))
    out_shape, lse_shape = (tokens, heads, d_v), (tokens, heads)

    def run(q, q_fmt, kv, num_slots, indices, row_start, row_len, sink):
        out = raw_kernels.empty(cp, out_shape, out_dtype)
        lse = raw_kernels.empty(cp, lse_shape, cp.float32)
        part = _partials(cp, tokens, heads, splits, d_v)
        launch((q, q_fmt, kv, indices, topk, num_slots, row_start, row_len, out, lse,
                heads, d_v, scale_log2, splits, part, sink))
        if merge is not None:
            merge((part, out, lse, sink, splits, d_v, heads))
        return out, lse
    if len(_LAUNCHES) > 1024:
        _LAUNCHES.clear()
    _LAUNCHES[key] = run
    return run


def _no_keys(cp, tokens, heads, d_v, out_dtype):
    """(out, lse) of rows with no key at all: out 0, lse -inf."""
    out = raw_kernels.empty(cp, (tokens, heads, d_v), out_dtype)
    lse = raw_kernels.empty(cp, (tokens, heads), cp.float32)
    if tokens and heads:
        out.fill(0)
        lse.fill(-numpy.inf)
    return out, lse


def _launch(cp, q, kv, fp8, *, indices=None, row_start=None, row_len=None, sm_scale, d_v,
            splits=None, sink=None, out_dtype=numpy.dtype(numpy.float32)):
    tokens, heads, _ = q.shape
    topk = 0 if indices is None else indices.shape[1]
    if tokens == 0 or heads == 0 or (indices is not None and topk == 0):
        return _no_keys(cp, tokens, heads, d_v, out_dtype)   # (maybe no buffer behind indices)
    run = prepare(cp, tokens, heads, topk, fp8, indices is None, sm_scale, d_v, splits,
                  out_dtype)
    qq, q_fmt = _q_operand(cp, q)
    num_slots = kv.shape[0]                   # every slot outside [0, num_slots) is masked
    if num_slots == 0:                        # every index is -1: never read, but keep
        kv = cp.zeros((1,) + kv.shape[1:], dtype=kv.dtype)   # the pointer valid
    return run(qq, q_fmt, _aligned(cp, kv), num_slots, indices, row_start, row_len, sink)


def call_launch(cp, q, data, rows, indices, sm_scale, d_v, out_dtype):
    """``(device, run)`` for the public op's call memo (see
    :func:`cpsparse.raw_kernels.topk.call_launch`): the fp8_ds_mla kernel's prepared
    launch (:func:`prepare`) of this call's shape on the current device, or None where
    the call takes more than that launch (float64 queries or int64 indices: converted
    first; dense rows: converted to bf16 first; an empty call or pool; a shape the kernel
    does not take).

    ``data`` is the cache's own array and ``rows`` its record view [num_slots, 656] (the
    same bytes: C-contiguous ``data``, else None). ``run(q, data, indices)`` takes arrays
    of this call's layouts ([T, topk] indices) and returns (out, lse), or None when q or
    the cache is not 16-byte aligned (a view's offset: the layouts do not say it; the
    checked path copies them).
    """
    tokens, heads, _ = q.shape
    topk, num_slots = indices.shape[1], rows.shape[0]
    if not (supports(q.shape, d_v) and supports_rows(rows, True)) or q.dtype == cp.float64 \
            or indices.dtype != cp.int32 or not tokens * heads * topk * num_slots \
            or rows.data.ptr != data.data.ptr or not data.flags.c_contiguous:
        return None
    run = prepare(cp, tokens, heads, topk, True, False, sm_scale, d_v, None, out_dtype)
    q_fmt = FORMATS[q.dtype.name]

    def run_call(q, data, indices):
        if q.data.ptr % 16 or data.data.ptr % 16:
            return None
        return run(q, q_fmt, data, num_slots, indices, None, None, None)
    return raw_kernels.current_device(), run_call


def _partials(cp, tokens, heads, splits, d_v):
    """Scratch of split-KV partials: rows [T, H, splits, d_v], then lse [T, H, splits]
    (None when splits == 1)."""
    if splits == 1:
        return None
    return raw_kernels.empty(cp, (tokens * heads * splits * (d_v + 1),), cp.float32)


def _combine(cp, combine, part, out, lse, sink, splits, d_v, heads):
    if combine is not None:
        combine((out.shape[0] * heads,), (COMBINE_THREADS,),
                (part, out, lse, sink, splits, d_v, heads))


def supports_model1(q_shape, d_v):
    """True when the MODEL1 kernel covers queries of ``q_shape`` [T, H, 512] and d_v."""
    return (len(q_shape) == 3 and q_shape[2] == MODEL1_D_QK and 0 < d_v <= D_V_MAX
            and d_v % 2 == 0)


def _model1_pages(cp, data, block_size):
    """(pages, page stride in bytes) the kernel reads: ``data`` itself when its pages
    start 16-byte aligned (the rows are 16-byte loads), else the used bytes of each page
    copied into fresh pages of ``page_bytes`` (a copy of the whole cache every call:
    correct, slow; MLAKVCache's own pages and FlashMLA's views are aligned)."""
    page = cache_layout.model1_page_bytes(block_size)
    stride = data.strides[0] if data.shape[0] > 1 else page
    if data.data.ptr % 16 == 0 and stride % 16 == 0:
        return data, stride
    used = block_size * cache_layout.MODEL1_TOKEN_BYTES
    pages = cp.zeros((data.shape[0], page), dtype=cp.uint8)
    pages[:, :used] = data[:, :used]
    return pages, page


def sparse_mla_attention_model1(cp, q, caches, sm_scale, d_v, attn_sink=None, splits=None,
                                out_dtype=numpy.dtype(numpy.float32)):
    """out [T, H, d_v] (of ``out_dtype``), lse [T, H] over MODEL1 caches, in one softmax.

    ``caches``: one or two (pages uint8 [num_blocks, >= block_size * 584] with the
    page stride of the layout, block_size, indices [T, topk], lengths [T] or None)
    tuples: the main cache, then the extra one (the sliding window). Row t attends to
    the first ``lengths[t]`` (all when None, clamped to [0, topk]) slots of each list.
    ``attn_sink`` float32 [H] (C-contiguous, as the public op checks it) or None. The
    caller checked :func:`supports_model1`.
    """
    tokens, heads, _ = q.shape
    if tokens == 0 or heads == 0:
        return _no_keys(cp, tokens, heads, d_v, out_dtype)
    lists = []
    for data, block_size, indices, lengths in caches:
        pages, stride = _model1_pages(cp, data, block_size)
        num_slots = min(data.shape[0] * block_size, INT32_MAX)
        if num_slots == 0:                   # every index is masked: keep the pointer valid
            pages = cp.zeros((1, 16), dtype=cp.uint8)
        idx = index_i32(cp, indices)
        if idx.size == 0:
            # An empty list has no buffer (pointer 0); the kernel never reads it, but a
            # null main list would send att_share down its causal-range branch.
            idx = cp.full((1,), -1, dtype=cp.int32)
        lists.append((pages, idx, index_i32(cp, lengths), indices.shape[1], block_size,
                      stride, num_slots))
    if len(lists) == 1:
        lists.append((None, None, None, 0, 1, 0, 0))
    tiles = sum(-(-entry[3] // 64) for entry in lists)      # entry[3]: the list's topk
    if tiles == 0:
        return _no_keys(cp, tokens, heads, d_v, out_dtype)
    units, splits, fn, combine, scale_log2 = _plan(tokens, heads, 64 * tiles, "model1", False,
                                                   sm_scale, splits, out_dtype.name)
    qq, q_fmt = _q_operand(cp, q)
    out = raw_kernels.empty(cp, (tokens, heads, d_v), out_dtype)
    lse = raw_kernels.empty(cp, (tokens, heads), cp.float32)
    part = _partials(cp, tokens, heads, splits, d_v)
    (ka, ia, la, topk_a, bs_a, st_a, n_a), (kb, ib, lb, topk_b, bs_b, st_b, n_b) = lists
    fn((units * splits,), (WS_THREADS,),
       (qq, q_fmt, ka, ia, la, topk_a, bs_a, st_a, n_a, kb, ib, lb, topk_b, bs_b, st_b, n_b,
        attn_sink, out, lse, heads, d_v, scale_log2, splits, part), shared_mem=SMEM_BYTES)
    _combine(cp, combine, part, out, lse, attn_sink, splits, d_v, heads)
    return out, lse


def supports_scale(sm_scale, fp8):
    """True when the kernel takes this softmax scale: the dense-rows kernel masks a key
    (S = -inf) before scaling and takes the row max of the unscaled scores, which holds
    for sm_scale > 0 only (the fp8 and MODEL1 kernels scale first)."""
    return fp8 or sm_scale > 0


def supports_rows(rows, fp8):
    """True when the kernel reads these key rows (fp8_ds_mla records of 656 bytes, or
    any dense float workspace)."""
    return not fp8 or (rows.ndim == 2 and rows.shape[1] == RECORD_BYTES)


def sparse_mla_attention(cp, q, rows, indices, sm_scale, d_v, fp8, splits=None,
                         lengths=None, attn_sink=None, out_dtype=numpy.dtype(numpy.float32)):
    """out [T, H, d_v] (of ``out_dtype``: float32, float16 or bfloat16), lse [T, H]
    over ``rows[indices[t]]``.

    ``rows`` is the fp8_ds_mla record view uint8 [num_slots, 656] (``fp8``) or a
    dense float workspace [S, 576]. The caller checked :func:`supports` and
    :func:`supports_rows`. ``splits`` forces the split-KV factor (tests, benchmarks);
    None chooses it from the shapes (:func:`choose_splits`). ``lengths`` [T] (or
    None): row t attends to its first ``lengths[t]`` indices (clamped to [0, topk]);
    ``attn_sink`` float32 [H] (or None) scales out by exp(lse) / (exp(lse) +
    exp(sink)), in the kernel's epilogue or in the split-KV combine. Both are
    C-contiguous, as the public op checks them.
    """
    kv = rows if fp8 else to_bf16(cp, rows)
    return _launch(cp, q, kv, fp8, indices=index_i32(cp, indices),
                   row_len=index_i32(cp, lengths), sm_scale=sm_scale, d_v=d_v,
                   splits=splits, sink=attn_sink, out_dtype=out_dtype)


def dense_mla_attention(cp, q, kv, sm_scale, d_v, cu_q, cu_k, key_ranges=None,
                        out_dtype=numpy.dtype(numpy.float32)):
    """Causal attention per request with the sparse kernel over key ranges.

    Query i of a request sees keys ``[k0, k0 + k_len - q_len + i + 1)``: the
    kernel walks that range directly (no index array), so the cost is the
    causal FLOPs, not the full square. ``cu_q``/``cu_k`` are host int64. The
    caller checked :func:`supports`.
    """
    if key_ranges is None:
        start, visible = (cp.asarray(a) for a in paging.causal_key_ranges(cu_q, cu_k))
    else:
        start, visible = key_ranges       # device arrays of the batch metadata: no upload
    return _launch(cp, q, to_bf16(cp, kv), False, row_start=start, row_len=visible,
                   sm_scale=sm_scale, d_v=d_v, out_dtype=out_dtype)


def local_to_global_slots(cp, indices, req_ids, block_table, block_size):
    """``block_table[req, pos // B] * B + pos % B`` elementwise; -1 stays -1."""
    out = raw_kernels.empty(cp, indices.shape, cp.int32)
    n = indices.size
    if n:
        fn = raw_kernels.kernel("attention", "cps_local_to_global_slots", SLOTS_ARGS)
        fn((raw_kernels.grid_stride_blocks(n, THREADS),), (THREADS,),
           (index_i32(cp, indices), index_i32(cp, req_ids), index_i32(cp, block_table),
            block_table.shape[0], block_table.shape[1], indices.shape[1], n, block_size, out))
    return out
