"""Indexer scoring kernels (prefill ``mqa_logits`` and paged decode ``paged_mqa_logits``).

Launchers of ``indexer.cu`` beside this file. Both ops take validated CuPy
arrays (:mod:`cpsparse.indexer` validates) and never synchronise with the host,
so they can be captured in a CUDA graph (after a first call has compiled the
module and set the kernels' shared-memory limit).

Two tensor-core paths compute the same thing from the same shared-memory
layout: ``"wgmma"`` (Hopper sm_90a, the default there) and ``"mma"``
(``mma.sync`` e4m3). On the wgmma path, prefill and the decode of 1 or 2 query
rows of 64 padded heads over pages of 64 keys (fp8 or MXFP4) run persistent
warp-specialized kernels (:func:`uses_ws_decode`). :func:`supports_prefill` and :func:`decode_plan` say which
shapes the kernels cover (head_dim 128, at most 128 heads, a page size that is a
power of two >= 4, 16-byte aligned codes); the op decides what to do with the
others (it runs the reference, and warns).
"""

import os
from typing import Any

import numpy

from cpsparse import raw_kernels
from cpsparse.raw_kernels import index_i32
from cpsparse.reference import cache as cache_layout

# Constants of indexer.cu, owned here and emitted into the source as #defines.
D = 128                  # head_dim the kernels are written for        (CPS_IDX_D)
TILE = 64                # keys per tile (one page of 64 in decode)     (CPS_IDX_TILE)
THREADS = 128            # one warpgroup per CTA                        (CPS_IDX_THREADS)
STAGES = 4               # key tiles in the ring of a prefill CTA       (CPS_IDX_STAGES)
DECODE_STAGES = 3        # key tiles in the ring of a wgmma decode CTA (measured best, H200)
MMA_STAGES = 4           # ... of an mma.sync decode CTA
MAX_ROWS = 64            # query rows per CTA                           (CPS_IDX_MAX_ROWS)
BT_CAP = 256             # page ids per decode piece                    (CPS_IDX_BT_CAP)
WS_MATH = 4              # math warpgroups of the warp-specialized prefill CTA (CPS_IDX_WS_MATH)
WS_STAGES = 4            # key stages (64 * WS_MATH keys) in its ring         (CPS_IDX_WS_STAGES)
WSD_FP4_STAGES = 8       # ... of the warp-specialized decode CTA with MXFP4 keys, whose
                         # stages take half the bytes (CPS_IDX_WSD_FP4_STAGES)
WS_THREADS = 128 * WS_MATH + 128    # ... and a producer warpgroup
WS_PRODUCER_REGS = 32    # setmaxnreg split of its 640 x 96 launch registers (CPS_IDX_WS_PREGS)
WS_MATH_REGS = 112       #                                                    (CPS_IDX_WS_MREGS)
WSD_PRODUCER_REGS = 64   # ... of the warp-specialized decode CTA (CPS_IDX_WSD_PREGS): its
WSD_MATH_REGS = 104      # producer holds a stage's page ids and addresses (CPS_IDX_WSD_MREGS)
                         # and a full batch's cuts beside the share's: the whole 640 x 96
                         # pool (at 56 the next_n 2 producers spilled 4-8 bytes)
WSD_META_BYTES = 24      # a Q slot's work item in the ws decode CTA (CPS_IDX_WSD_META_BYTES)
WSD_KEY_WEIGHT = 16      # a stage with keys against one of only -inf to write, when the ws
                         # decode CTAs share a batch (CPS_IDX_WSD_KEY_WEIGHT): 33 KB of fp8
                         # keys read (MXFP4: 17 KB) against 1 KB a row written
MAX_QROWS = 512          # next_n * hp columns per decode CTA
N128M_CTAS_PER_SM = 5    # launch bounds of the 128-column decode kernels (CPS_IDX_N128M_MINB)
N128M_CTAS_PER_SM_FP4 = 4   # ... with MXFP4 keys (CPS_IDX_N128M_FP4_MINB)
# The _h64 kernels keep more of the epilogue's weights in flight: at the generic kernels'
# bounds (5 and 6 CTAs an SM) these two spilled a register.
N128M_H64_CTAS_PER_SM = 4   # (CPS_IDX_N128M_H64_MINB)
N64_FP4_H64_CTAS_PER_SM = 5   # (CPS_IDX_N64_FP4_H64_MINB)
MAX_PIECE_TILES = 128


def smem_bytes(q_rows, stages=STAGES):
    """Dynamic shared memory of one CTA (cps_idx_smem_bytes in indexer.cu, which a
    static_assert holds to this)."""
    return (1024 + q_rows * D + stages * (TILE * D + TILE * 4) + q_rows * 4
            + 2 * MAX_ROWS * 4 + BT_CAP * 4)


def ws_smem_bytes(stages=WS_STAGES, math=WS_MATH):
    """Dynamic shared memory of the warp-specialized prefill CTA (CPS_IDX_WS_SMEM, which
    a static_assert holds to this): 2 query slots, the key ring and its scales, 2 weight
    slots, 2 metadata records (36 ints), 4 + 2 * stages mbarriers, the 1024-byte
    alignment slack."""
    keys = TILE * math
    return (1024 + 2 * 128 * D + stages * keys * (D + 4) + 2 * 128 * 4 + 2 * 36 * 4
            + (4 + 2 * stages) * 8)


def ws_decode_smem_bytes(fp4=False, stages=None, math=WS_MATH):
    """Dynamic shared memory of the warp-specialized decode CTA (indexer.cu's
    CpsWsdLayout): the 1024-byte alignment slack, 2 query slots, ``stages`` stages of fp8
    or MXFP4 codes (default WS_STAGES or WSD_FP4_STAGES) and their scales, 2 weight
    slots, 2 work items, 4 + 2 * stages mbarriers, a missing-page mask a stage, the
    page ids of an item and the rows' window ends of up to WS_THREADS requests."""
    if stages is None:
        stages = WSD_FP4_STAGES if fp4 else WS_STAGES
    keys = TILE * math
    return (1024 + 2 * 128 * D + stages * keys * ((D // 2 if fp4 else D) + 4) + 2 * 128 * 4
            + 2 * WSD_META_BYTES + (4 + 2 * stages) * 8 + 4 * stages + 4 * BT_CAP
            + 4 * 2 * WS_THREADS)


# The ws decode kernels' launch shared memory by key format (fp4: MXFP4), their rings at
# their compiled depth (indexer.cu's static_assert holds the kernel's layout to these).
WSD_SMEM = {False: ws_decode_smem_bytes(), True: ws_decode_smem_bytes(fp4=True)}


raw_kernels.register_module(
    "indexer", ["common.cuh", "hopper.cuh", "indexer.cu"], capabilities=raw_kernels.exactly((9, 0)),
    ops=("mqa_logits", "paged_mqa_logits"), needs="Hopper wgmma, compiled for sm_90a",
    pdl=True,
    defines=dict(CPS_IDX_D=D, CPS_IDX_TILE=TILE, CPS_IDX_THREADS=THREADS,
                 CPS_IDX_STAGES=STAGES, CPS_IDX_MAX_ROWS=MAX_ROWS, CPS_IDX_BT_CAP=BT_CAP,
                 CPS_IDX_WS_MATH=WS_MATH, CPS_IDX_WS_STAGES=WS_STAGES,
                 CPS_IDX_WS_PREGS=WS_PRODUCER_REGS, CPS_IDX_WS_MREGS=WS_MATH_REGS,
                 CPS_IDX_WS_SMEM_LAUNCH=ws_smem_bytes(),
                 CPS_IDX_SMEM_Q64_S3=smem_bytes(64, 3), CPS_IDX_SMEM_Q128_S4=smem_bytes(128, 4),
                 CPS_IDX_SMEM_Q512_S4=smem_bytes(512, 4),
                 CPS_IDX_WSD_SMEM_LAUNCH=WSD_SMEM[False],
                 CPS_IDX_WSD_FP4_STAGES=WSD_FP4_STAGES,
                 CPS_IDX_WSD_FP4_SMEM_LAUNCH=WSD_SMEM[True],
                 CPS_IDX_WSD_PREGS=WSD_PRODUCER_REGS, CPS_IDX_WSD_MREGS=WSD_MATH_REGS,
                 CPS_IDX_WSD_META_BYTES=WSD_META_BYTES,
                 CPS_IDX_WSD_KEY_WEIGHT=WSD_KEY_WEIGHT,
                 CPS_IDX_N128M_MINB=N128M_CTAS_PER_SM,
                 CPS_IDX_N128M_FP4_MINB=N128M_CTAS_PER_SM_FP4,
                 CPS_IDX_N128M_H64_MINB=N128M_H64_CTAS_PER_SM,
                 CPS_IDX_N64_FP4_H64_MINB=N64_FP4_H64_CTAS_PER_SM))

# C parameter lists (raw_kernels.Kernel letters).
# cps_mqa_logits_mma: q, kc, ksc, w, ks, ke, out, M, N, H, hp, nblocks
MQA_ARGS = "PPPPPPP iiiii"
# cps_mqa_logits_ws[_h64]: w, ks, ke, out, M, N, H, hp, nblocks, and the tensor maps of the
# query codes, the key codes and the key scales (prefill_map_encoders)
MQA_WS_ARGS = "PPPP iiiii TTT"
# cps_paged_mqa_logits_*: q, cache, w, lens, lens_2d, bt, bt_cols, num_blocks, out, width,
# next_n, H, hp, nch, bs_shift, piece_tiles
PAGED_ARGS = "PPPP i P ii P iiiiiii"
# cps_paged_mqa_logits_[fp4_]ws_h64n*: q, cache, w, lens, lens_2d, bt, bt_cols, num_blocks, out,
# width, H, batch, piece_stages, clean, l2_stream
PAGED_WS_ARGS = "PPPP i P ii P iiiiii"
# The warp-specialized decode kernels copy the pages under an L2 evict-first policy
# (l2_stream) when a batch's pages (batch x width keys, at most the cache's: an upper
# bound) exceed this part of the L2: each page is read once, and the policy keeps the
# queries, weights, page table and logits in L2 instead. On an H100 (bench_peers, two
# rounds) it took the indexer_decode rows of 36-553 MB of pages 0.5-2.5% faster (B=64 x
# 32K 101.6 -> 99.6 us; MXFP4 B=4 x 128K, 36 MB, 22.1 -> 21.8; MXFP4 next_n 2, issue
# bound, unchanged) and B=1 x 32K (4 MB, which a replayed call finds in L2) 3-4% slower.
L2_STREAM_FRACTION = 0.5

PATHS = ("wgmma", "mma")
# "wgmma" or "mma"; CPSPARSE_INDEXER_PATH overrides (wgmma needs compute capability 9.0).
DEFAULT_PATH = os.environ.get("CPSPARSE_INDEXER_PATH", "wgmma")


def _pick_path(path):
    path = DEFAULT_PATH if path is None else path
    if path not in PATHS:
        raise ValueError(f"Invalid path: expected one of {PATHS}, got {path!r}")
    if path == "wgmma" and raw_kernels.device_facts().capability != (9, 0):
        path = "mma"
    return path


def _kernel(name, signature, smem):
    """The kernel ``name``, all of the unified L1 as shared memory, limit >= smem."""
    return raw_kernels.kernel("indexer", name, signature, smem, carveout=100)


def _aligned(*arrays):
    return all(a.data.ptr % 16 == 0 for a in arrays)


def _round8(h):
    return -(-int(h) // 8) * 8


def _prefill_shape(q_codes):
    return q_codes.shape[2] == D and _round8(q_codes.shape[1]) <= 128


def supports_prefill(q_codes, k_codes):
    """True when the prefill kernel covers these queries and keys (else None's reason)."""
    return _prefill_shape(q_codes) and _aligned(q_codes, k_codes)


_PREFILL_LAUNCHES: dict[Any, Any] = {}


def prefill_map_encoders(m, heads, n):
    """The encoders (:class:`raw_kernels.TensorMapEncoder`) of the ws prefill kernels' three
    ``CUtensorMap`` parameters for ``m`` queries of ``heads`` heads over ``n`` keys, the
    codes under the 128-byte swizzle of the kernel's shared memory: the query codes as
    uint8 [m][heads][D] in boxes of a query block (D x hp x 128 // hp: heads past
    ``heads`` and rows past ``m`` land as zeros), the key codes as uint8 [n][D] in boxes
    of a stage's keys (D x TILE * WS_MATH), their float32 scales [n] in boxes of a
    stage."""
    keys, hp = TILE * WS_MATH, _round8(heads)
    swizzle, u8 = raw_kernels.TMAP_SWIZZLE_128B, raw_kernels.TMAP_UINT8
    return (raw_kernels.TensorMapEncoder(u8, (D, heads, m), (D, hp, 128 // hp), swizzle),
            raw_kernels.TensorMapEncoder(u8, (D, n), (D, keys), swizzle),
            raw_kernels.TensorMapEncoder(raw_kernels.TMAP_FLOAT32, (n,), (keys,)))


def prepare_prefill(cp, m, n, heads, path=None, ctas=None):
    """The prefill kernel's launch of one shape (m queries of ``heads`` heads over n keys,
    both non-zero) on the current device, memoized: ``run(q_codes, k_codes, k_scales,
    weights, ks, ke, out) -> out`` (int32 windows; ``out`` allocated when None). The path,
    grid and scalars are fixed here (see :func:`mqa_logits` for ``path`` and ``ctas``)."""
    path = _pick_path(path)
    if path != "wgmma":
        ctas = None                                # (the mma path's grid is the blocks)
    elif ctas is not None and int(ctas) < 1:
        raise ValueError(f"Invalid ctas: expected a positive CTA count, got {ctas}")
    key = (raw_kernels.current_device(), m, n, heads, path, ctas)
    known = _PREFILL_LAUNCHES.get(key)
    if known is not None:
        return known
    hp = _round8(heads)
    nblocks = -(-m // (128 // hp))
    shape = (m, n)
    if path == "wgmma":
        # Persistent: one CTA an SM over the query blocks (warp-specialized kernel).
        smem = ws_smem_bytes()
        fn = _kernel("cps_mqa_logits_ws_h64" if hp == 64 else "cps_mqa_logits_ws",
                     MQA_WS_ARGS, smem)
        grid = min(nblocks, raw_kernels.device_facts().sms if ctas is None else int(ctas))
        launch = fn.launcher((grid,), (WS_THREADS,), smem)
        query_map, codes_map, scales_map = prefill_map_encoders(m, heads, n)

        def run(q_codes, k_codes, k_scales, weights, ks, ke, out):
            if out is None:
                out = raw_kernels.empty(cp, shape, cp.float32)
            if k_scales.data.ptr % 16:         # (TMA reads from 16-byte aligned tensors)
                k_scales = k_scales.ravel().copy()
            launch((weights, ks, ke, out, m, n, heads, hp, nblocks, query_map(q_codes.data.ptr),
                    codes_map(k_codes.data.ptr), scales_map(k_scales.data.ptr)))
            return out
    else:
        smem = smem_bytes(128)                     # mma.sync: a CTA a query block
        fn = _kernel("cps_mqa_logits_mma", MQA_ARGS, smem)
        launch = fn.launcher((nblocks,), (THREADS,), smem)

        def run(q_codes, k_codes, k_scales, weights, ks, ke, out):
            if out is None:
                out = raw_kernels.empty(cp, shape, cp.float32)
            launch((q_codes, k_codes, k_scales, weights, ks, ke, out, m, n, heads, hp, nblocks))
            return out
    if len(_PREFILL_LAUNCHES) > 1024:
        _PREFILL_LAUNCHES.clear()
    _PREFILL_LAUNCHES[key] = run
    return run


def mqa_logits(cp, q_codes, k_codes, k_scales, weights, ks, ke, out=None, path=None,
               ctas=None):
    """float32 [M, N] logits; ``-inf`` outside ``[ks, ke)`` (see cpsparse.indexer).

    The caller checked :func:`supports_prefill`. ``ctas`` (wgmma path): CTAs of the
    persistent kernel, default one an SM (tests use fewer, so each CTA runs through
    many query blocks and wraps its rings many times).
    """
    m, heads, dim = q_codes.shape
    n = k_codes.shape[0]
    if out is None:
        out = raw_kernels.empty(cp, (m, n), cp.float32)
    if m == 0 or n == 0:
        out.fill(-numpy.inf)
        return out
    run = prepare_prefill(cp, m, n, heads, path, ctas)
    return run(q_codes, k_codes, k_scales, weights, index_i32(cp, ks), index_i32(cp, ke), out)


def prefill_call_launch(cp, q_codes, k_codes, k_scales, ks, ke):
    """``(device, run)`` for :func:`cpsparse.indexer.mqa_logits`'s call memo (see
    :func:`cpsparse.raw_kernels.topk.call_launch`): the prefill kernel's prepared launch
    (:func:`prepare_prefill`) of this call's shape on the current device, or None where
    the call takes more than that launch (int64 windows: copied to int32 first; MXFP4
    keys: the reference; an empty output; a shape the kernel does not take).

    ``run(q_codes, k_codes, k_scales, weights, ks, ke)`` returns the new logits, or None
    when the queries or keys are not 16-byte aligned (the checked path falls back to the
    reference, with its warning).
    """
    m, n = q_codes.shape[0], k_codes.shape[0]
    if not m or not n or not _prefill_shape(q_codes) or k_scales.dtype != cp.float32 \
            or q_codes.dtype != cp.uint8 or ks.dtype != cp.int32 or ke.dtype != cp.int32:
        return None
    run = prepare_prefill(cp, m, n, q_codes.shape[1])

    def run_call(q_codes, k_codes, k_scales, weights, ks, ke):
        if q_codes.data.ptr % 16 or k_codes.data.ptr % 16:
            return None
        return run(q_codes, k_codes, k_scales, weights, ks, ke, None)
    return raw_kernels.current_device(), run_call


def decode_plan(batch, next_n, heads, width, block_size, sms, smem_per_sm, stages=DECODE_STAGES,
                fp4=False, fixed=False):
    """Launch shape of the paged kernel, or None when it does not cover the case.

    Returns (variant, nc, nch, hp, stages, piece_tiles, pieces): kernel variant
    ("n64" or "n128m"), column chunk (64 or 128) and count, padded heads,
    ring depth, tiles (64 keys) per piece and pieces per request. Pure function of
    the shapes and the device (``sms``, ``smem_per_sm``): the op caches it per shape.
    ``fixed``: the kernel built for these padded heads runs (:func:`paged_kernel_name`),
    whose launch bounds differ.

    Each request's context is cut into equal pieces, one CTA each, so that the
    grid fills whole waves of resident CTAs: a CTA has a fixed start-up cost
    (lengths, page ids, query block), so fewer, longer pieces win as long as every
    SM stays busy; long and short contexts then cost in proportion to their pages.
    """
    hp = _round8(heads)
    bs = int(block_size)
    if hp > 128 or next_n > MAX_ROWS or bs < 4 or bs & (bs - 1):
        return None
    cols = next_n * hp
    nc = 64 if cols <= 64 else 128
    rpc = nc // hp
    nch = -(-next_n // rpc)
    if nch * nc > MAX_QROWS:
        return None
    # 128 columns: the weights in shared memory (n128m), not in registers: 90 registers a
    # thread instead of 115, so 5 CTAs an SM instead of 4 (wgmma; B=64 x 32K, next_n 2 on
    # the H200: 121.1 vs 122.6 us fp8, bit-identical; measured before the MXFP4 kernel's
    # register fragments, which hold it at 4)
    variant = "n64" if nc == 64 else "n128m"
    per_sm = smem_per_sm // (smem_bytes(nch * nc, stages) + 1024)
    if variant != "n64":
        # registers: launch bounds 5, or 4 with MXFP4 keys (their expanded A fragments
        # live in registers beside the 128-column accumulator: 113 a thread; at 5 CTAs an
        # SM, 96, they spilled) or in the _h64 kernel
        per_sm = min(per_sm, N128M_CTAS_PER_SM_FP4 if fp4 else
                     N128M_H64_CTAS_PER_SM if fixed else N128M_CTAS_PER_SM)
    elif fp4 and fixed:
        per_sm = min(per_sm, N64_FP4_H64_CTAS_PER_SM)
    slots = max(1, sms * per_sm)
    tiles_w = -(-int(width) // TILE)
    cap = max(1, min(MAX_PIECE_TILES, (BT_CAP - 1) * bs // TILE))
    waves = 1
    while True:
        per_req = max(1, (waves * slots) // batch)
        pt = -(-tiles_w // per_req)
        if pt <= cap:
            break
        waves += 1
    pt = max(1, min(pt, cap))
    return variant, nc, nch, hp, stages, pt, -(-tiles_w // pt)


# Padded head counts with decode kernels built for them (indexer.cu's _h64: the epilogue's
# row ends at compile time); the wgmma path only.
PAGED_HP_KERNELS = (64,)


def has_fixed_head_kernel(path, hp):
    """True where ``path`` has per-page decode kernels built for ``hp`` padded heads."""
    return path == "wgmma" and hp in PAGED_HP_KERNELS


def paged_kernel_name(path, variant, hp, stages, fp4=False, fixed=None):
    """The per-page decode kernel of a plan:
    ``cps_paged_mqa_logits_[fp4_]{path}_{variant}[_hHP]_s{stages}``. ``fixed``: the kernel
    built for ``hp`` heads (``_h64``); None picks it wherever it exists
    (:func:`has_fixed_head_kernel`), False names the one that takes hp at run time."""
    if fixed is None:
        fixed = has_fixed_head_kernel(path, hp)
    return (f"cps_paged_mqa_logits_{'fp4_' if fp4 else ''}{path}_{variant}"
            f"{f'_h{hp}' if fixed else ''}_s{stages}")


def ws_decode_plan(batch, width, sms, fp4=False):
    """Launch shape of the warp-specialized decode kernels (:func:`uses_ws_decode`): the
    plan tuple of :func:`decode_plan` with variant ``"ws"``, its stages the kernel's ring
    depth (``fp4``: MXFP4 keys, a deeper ring of half-size stages).

    The persistent CTAs (one an SM, at most one a stage of the batch: :func:`ws_grid`)
    share the batch's stages (4 pages) at run time, from the context lengths on the device
    (indexer.cu's ``cps_wsd_share``: equal shares of work whatever the lengths, a stage
    with keys weighing ``WSD_KEY_WEIGHT`` times one past every row's context), so the plan
    depends on the shapes alone. A CTA walks its share in items of one request, at most
    ``BT_CAP`` pages each (piece_tiles; ``pieces``: a row's width in such items, the
    plan tuple's last field, unused by the launch).
    """
    stages_w = -(-int(width) // (TILE * WS_MATH))
    return ("ws", 128, 1, 64, WSD_FP4_STAGES if fp4 else WS_STAGES, BT_CAP,
            -(-stages_w // (BT_CAP // WS_MATH)))


def ws_grid(batch, width, sms):
    """CTAs of a warp-specialized decode launch: one an SM, at most one a stage (4 pages of
    the output row) of the batch, at least 1."""
    return max(1, min(int(sms), int(batch) * -(-int(width) // (TILE * WS_MATH))))


# next_n with a warp-specialized decode kernel (indexer.cu's
# cps_paged_mqa_logits_[fp4_]ws_h64n*)
WS_DECODE_NEXT_N = (1, 2)


def uses_ws_decode(path, next_n, heads, dim, block_size):
    """True where a warp-specialized decode kernel covers the shape (Hopper, 1 or 2 query
    rows of 57-64 heads, pages of 64 keys; fp8 and MXFP4 alike: :func:`ws_kernel_name`)."""
    return (path == "wgmma" and next_n in WS_DECODE_NEXT_N and _round8(heads) == 64
            and dim == D and block_size == TILE)


def ws_kernel_name(next_n, fp4=False):
    """The warp-specialized decode kernel of a shape :func:`uses_ws_decode` covers:
    ``cps_paged_mqa_logits_[fp4_]ws_h64n{next_n}``."""
    return f"cps_paged_mqa_logits_{'fp4_' if fp4 else ''}ws_h64n{next_n}"


_PLANS: dict[Any, Any] = {}


def paged_plan(batch, next_n, heads, dim, width, block_size, path=None, fp4=False):
    """(path, plan, kernel) of a decode shape on the current device, memoized: plan
    and kernel None when the kernel does not cover it (see :func:`decode_plan`); a
    :func:`ws_decode_plan` where :func:`uses_ws_decode`. ``fp4``: MXFP4 keys, which the
    wgmma kernels read from pages of >= 64 keys."""
    dev = raw_kernels.current_device()
    key = (dev, batch, next_n, heads, dim, width, block_size, path, fp4)
    hit = _PLANS.get(key)
    if hit is None:
        facts = raw_kernels.device_facts()
        path_ = _pick_path(path)
        stages = DECODE_STAGES if path_ == "wgmma" else MMA_STAGES
        covered = dim == D and (not fp4 or (path_ == "wgmma" and block_size >= TILE))
        plan = fn = None
        if uses_ws_decode(path_, next_n, heads, dim, block_size):
            plan = ws_decode_plan(batch, width, facts.sms, fp4)
            fn = _kernel(ws_kernel_name(next_n, fp4), PAGED_WS_ARGS, WSD_SMEM[fp4])
        elif covered:
            fixed = has_fixed_head_kernel(path_, _round8(heads))
            plan = decode_plan(batch, next_n, heads, width, block_size, facts.sms,
                               facts.smem_per_sm, stages, fp4, fixed)
            if plan is not None:
                variant, nc, nch, hp = plan[:4]
                fn = _kernel(paged_kernel_name(path_, variant, hp, stages, fp4, fixed),
                             PAGED_ARGS, smem_bytes(nch * nc, stages))
        hit = _PLANS[key] = (path_, plan, fn)
    return hit


def supports_paged(q_codes, cache_data, plan):
    return plan is not None and _aligned(q_codes, cache_data)


def paged_mqa_logits(cp, q_codes, cache, weights, context_lens, block_table, max_context_len,
                     out=None, path=None, piece_tiles=None, plan=None, ctas=None,
                     clean_logits=True):
    """float32 [B * next_n, max_context_len] decode logits over the paged key cache.

    The caller checked :func:`supports_paged`. ``piece_tiles`` (64-key tiles per CTA;
    the warp-specialized kernels round it up to whole 4-tile stages) overrides the launch
    plan (benchmarks, tests). ``ctas``: CTAs of the persistent
    warp-specialized kernel (:func:`uses_ws_decode`), default one an SM (tests use fewer,
    so that each CTA runs through many pieces and wraps its rings many times).
    ``clean_logits`` False: the warp-specialized kernels leave positions past every row's
    window end unwritten (the other kernels write ``-inf`` there still).
    """
    batch, next_n, heads, dim = q_codes.shape
    width = int(max_context_len)
    if out is None:
        out = raw_kernels.empty(cp, (batch * next_n, width), cp.float32)
    if batch * next_n == 0 or width == 0:
        out.fill(-numpy.inf)
        return out
    if plan is None:
        plan = paged_plan(batch, next_n, heads, dim, width, cache.block_size, path,
                          cache.dtype == "mxfp4")
    path, plan, fn = plan
    variant, nc, nch, hp, stages, pt, pieces = plan
    if variant == "ws":
        return _paged_ws(cp, q_codes, cache, weights, context_lens, block_table, width, out,
                         fn, pt, piece_tiles, ctas, clean_logits)
    if piece_tiles is not None:
        pt = max(1, min(int(piece_tiles), (BT_CAP - 1) * cache.block_size // TILE))
        tiles_w = -(-width // TILE)
        pieces = -(-tiles_w // pt)
    smem = smem_bytes(nch * nc, stages)
    context_lens = index_i32(cp, context_lens)
    block_table = index_i32(cp, block_table)
    lens_2d = int(context_lens.ndim == 2)
    bs_shift = int(cache.block_size).bit_length() - 1
    bt_cols = block_table.shape[1]
    num_blocks = cache.num_blocks             # page ids outside [0, num_blocks) are masked
    consts = (width, next_n, heads, hp, nch, bs_shift, pt)
    if batch <= 65535:
        fn((pieces, batch), (THREADS,), (q_codes, cache.data, weights, context_lens, lens_2d,
                                         block_table, bt_cols, num_blocks, out) + consts,
           shared_mem=smem)
        return out
    for b0 in range(0, batch, 65535):
        b1 = min(batch, b0 + 65535)
        fn((pieces, b1 - b0), (THREADS,),
           (q_codes[b0:b1], cache.data, weights[b0 * next_n:b1 * next_n],
            context_lens[b0:b1], lens_2d, block_table[b0:b1], bt_cols, num_blocks,
            out[b0 * next_n:b1 * next_n]) + consts, shared_mem=smem)
    return out


def _ws_launch(cp, fn, batch, next_n, heads, width, fp4, piece_stages, lens_2d, cols,
               num_blocks, ctas=None, clean_logits=True):
    """``launch(q_codes, cache_data, weights, context_lens, block_table, out=None) -> out``:
    the warp-specialized decode kernel ``fn`` (:func:`ws_decode_plan`) with every argument
    that follows from the shapes fixed (int32 index arrays; ``out`` None: allocated), items
    of at most ``piece_stages`` stages. :func:`ws_grid` CTAs, or ``ctas``.
    ``clean_logits`` False: positions past every row's window end are left unwritten."""
    facts = raw_kernels.device_facts()
    grid = ws_grid(batch, width, facts.sms) if ctas is None else int(ctas)
    stream = int(l2_streams(batch, width, fp4, facts.l2_bytes, num_blocks * TILE))
    launch = fn.launcher((grid,), (WS_THREADS,), WSD_SMEM[fp4])
    shape = (batch * next_n, width)

    def run(q_codes, cache_data, weights, context_lens, block_table, out=None):
        if out is None:
            out = raw_kernels.empty(cp, shape, cp.float32)
        launch((q_codes, cache_data, weights, context_lens, lens_2d, block_table, cols,
                num_blocks, out, width, heads, batch, piece_stages, int(clean_logits), stream))
        return out
    return run


def l2_streams(batch, width, fp4, l2_bytes, cache_keys):
    """True when a decode launch's pages (``batch`` requests of up to ``width`` keys, fp8
    or MXFP4 ``fp4``, at most the ``cache_keys`` keys of the cache: a padded width over a
    small cache, or requests sharing pages, read no more) exceed L2_STREAM_FRACTION of an
    L2 of ``l2_bytes``: the warp-specialized kernels then copy them under an L2
    evict-first policy."""
    code, scale = cache_layout.indexer_layout(D, "mxfp4" if fp4 else "fp8")
    keys = min(int(batch) * int(width), int(cache_keys))
    return keys * (code + scale) > L2_STREAM_FRACTION * int(l2_bytes)


def call_launch(cp, q_codes, cache, context_lens, block_table, width, clean_logits=True):
    """``(device, run)`` for the public op's call memo (see
    :func:`cpsparse.raw_kernels.topk.call_launch`): the warp-specialized decode launch of
    this call's shape on the current device (:func:`_ws_launch`), or None where the call
    takes more than that launch (another kernel path, int32 copies of int64 indices, an
    empty output, codes that are not uint8).

    ``run(q_codes, cache_data, weights, context_lens, block_table)`` returns the new
    logits, or None when an operand's address is not 16-byte aligned (a view's offset:
    the layouts do not say it; the checked path falls back to the reference, with its
    warning).
    """
    batch, next_n, heads, dim = q_codes.shape
    if batch * next_n == 0 or width == 0 or q_codes.dtype != cp.uint8 \
            or context_lens.dtype != cp.int32 or block_table.dtype != cp.int32:
        return None
    fp4 = cache.dtype == "mxfp4"
    _, plan, fn = paged_plan(batch, next_n, heads, dim, width, cache.block_size, None, fp4)
    if plan is None or plan[0] != "ws":
        return None
    launch = _ws_launch(cp, fn, batch, next_n, heads, width, fp4, plan[5] // WS_MATH,
                        int(context_lens.ndim == 2), block_table.shape[1], cache.num_blocks,
                        clean_logits=clean_logits)

    def run(q_codes, cache_data, weights, context_lens, block_table):
        if q_codes.data.ptr % 16 or cache_data.data.ptr % 16:
            return None
        return launch(q_codes, cache_data, weights, context_lens, block_table)
    return raw_kernels.current_device(), run


def _paged_ws(cp, q_codes, cache, weights, context_lens, block_table, width, out, fn, pt,
              piece_tiles=None, ctas=None, clean_logits=True):
    """The warp-specialized decode launch (plan of :func:`ws_decode_plan`: items of ``pt``
    tiles at most, or ``piece_tiles``)."""
    if ctas is not None and int(ctas) < 1:
        raise ValueError(f"Invalid ctas: expected a positive CTA count, got {ctas}")
    batch, next_n, heads = q_codes.shape[:3]
    piece_stages = pt // WS_MATH
    if piece_tiles is not None:
        piece_stages = max(1, min(-(-int(piece_tiles) // WS_MATH), BT_CAP // WS_MATH))
    context_lens = index_i32(cp, context_lens)
    block_table = index_i32(cp, block_table)
    launch = _ws_launch(cp, fn, batch, next_n, heads, width, cache.dtype == "mxfp4",
                        piece_stages, int(context_lens.ndim == 2), block_table.shape[1],
                        cache.num_blocks, ctas, clean_logits)
    return launch(q_codes, cache.data, weights, context_lens, block_table, out)
