"""Indexer scoring kernels (prefill ``mqa_logits`` and paged decode ``paged_mqa_logits``).

Launchers of ``cpsparse/raw_kernels/indexer.cu``. Both ops take validated CuPy
arrays (:mod:`cpsparse.indexer` validates) and never synchronise with the host,
so they can be captured in a CUDA graph (after a first call has compiled the
module and set the kernels' shared-memory limit).

Two tensor-core paths compute the same thing from the same shared-memory
layout: ``"wgmma"`` (Hopper sm_90a, the default there) and ``"mma"``
(``mma.sync`` e4m3, sm_89+). Shapes the kernels do not cover (head_dim != 128,
more than 128 heads, a page size that is not a power of two >= 4, unaligned
pointers) run the array-generic reference on the GPU instead.
"""

import os

import numpy

from cpsparse import raw_kernels
from cpsparse.kernels import i32, index_i32
from cpsparse.reference import indexer as _ref

D = 128                  # head_dim the kernels are written for
TILE = 64                # keys per tile (one page of 64 in decode)
THREADS = 128            # one warpgroup per CTA
STAGES = 4               # key tiles in the ring of a prefill CTA (CPS_IDX_STAGES)
DECODE_STAGES = (3, 4)   # ring depths compiled for the wgmma decode kernels
DEFAULT_DECODE_STAGES = {"n64": 3, "n128": 3, "n128m": 3}   # measured best (H200)
MAX_ROWS = 64            # query rows per CTA (CPS_IDX_MAX_ROWS)
BT_CAP = 256             # page ids per decode piece (CPS_IDX_BT_CAP)
MAX_QROWS = 512          # next_n * hp columns per decode CTA
MAX_PIECE_TILES = 128
SM_SMEM = 233472         # shared memory per SM (H100/H200), bytes

PATHS = ("wgmma", "mma")
# "wgmma" or "mma"; CPSPARSE_INDEXER_PATH overrides (wgmma needs compute capability 9.0).
DEFAULT_PATH = os.environ.get("CPSPARSE_INDEXER_PATH", "wgmma")

_KERNELS = {}


def smem_bytes(q_rows, stages=STAGES):
    """Dynamic shared memory of one CTA (cps_idx_smem_bytes in indexer.cu)."""
    return (1024 + q_rows * D + stages * (TILE * D + TILE * 4) + q_rows * 4
            + 2 * MAX_ROWS * 4 + BT_CAP * 4)


_HAS_WGMMA = {}


def _pick_path(cp, path):
    path = DEFAULT_PATH if path is None else path
    if path not in PATHS:
        raise ValueError(f"Invalid path: expected one of {PATHS}, got {path!r}")
    if path == "wgmma":
        dev = cp.cuda.runtime.getDevice()
        ok = _HAS_WGMMA.get(dev)
        if ok is None:
            cc = raw_kernels.parse_capability(cp.cuda.Device(dev).compute_capability)
            ok = _HAS_WGMMA[dev] = cc == (9, 0)
        if not ok:
            path = "mma"
    return path


def _kernel(cp, name, smem):
    """The RawKernel ``name`` with its dynamic shared-memory limit raised to ``smem``."""
    key = (cp.cuda.runtime.getDevice(), name)
    fn, limit = _KERNELS.get(key, (None, 0))
    if fn is None:
        fn = raw_kernels.get_function("indexer", name)
        fn.preferred_shared_memory_carveout = 100     # all of the unified L1 as smem
    if limit < smem:
        fn.max_dynamic_shared_size_bytes = int(smem)
        limit = int(smem)
    _KERNELS[key] = (fn, limit)
    return fn


def _aligned(*arrays):
    return all(a.data.ptr % 16 == 0 for a in arrays)


def _round8(h):
    return -(-int(h) // 8) * 8


def mqa_logits(cp, q_codes, k_codes, k_scales, weights, ks, ke, out=None, path=None):
    """float32 [M, N] logits; ``-inf`` outside ``[ks, ke)`` (see cpsparse.indexer)."""
    m, heads, dim = q_codes.shape
    n = k_codes.shape[0]
    if out is None:
        out = cp.empty((m, n), dtype=cp.float32)
    if m == 0 or n == 0:
        out.fill(-numpy.inf)
        return out
    hp = _round8(heads)
    if dim != D or hp > 128 or not _aligned(q_codes, k_codes):
        out[...] = _ref.mqa_logits(q_codes, k_codes, k_scales, weights, ks, ke)
        return out
    ks, ke = index_i32(cp, ks), index_i32(cp, ke)
    rows = 128 // hp
    nblocks = -(-m // rows)
    smem = smem_bytes(128)
    fn = _kernel(cp, f"cps_mqa_logits_{_pick_path(cp, path)}", smem)
    fn((nblocks,), (THREADS,),
       (q_codes, k_codes, k_scales, weights, ks, ke, out, i32(m), i32(n), i32(heads), i32(hp),
        i32(nblocks)), shared_mem=smem)
    return out


def _sm_count(cp):
    dev = cp.cuda.runtime.getDevice()
    n = _SMS.get(dev)
    if n is None:
        n = _SMS[dev] = cp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"]
    return n


_SMS = {}


def decode_plan(batch, next_n, heads, width, block_size, sms=132, stages=None):
    """Launch shape of the paged kernel, or None when it does not cover the case.

    Returns (variant, nc, nch, hp, stages, piece_tiles, pieces): kernel variant
    ("n64", "n128" or "n128m"), column chunk (64 or 128) and count, padded heads,
    ring depth, tiles (64 keys) per piece and pieces per request.

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
    variant = "n64" if nc == 64 else ("n128" if nch == 1 else "n128m")
    stages = DEFAULT_DECODE_STAGES[variant] if stages is None else int(stages)
    per_sm = SM_SMEM // (smem_bytes(nch * nc, stages) + 1024)
    if variant != "n64":
        per_sm = min(per_sm, 4)                     # registers
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


def paged_mqa_logits(cp, q_codes, cache, weights, context_lens, block_table, max_context_len,
                     out=None, path=None, piece_tiles=None, stages=None):
    """float32 [B * next_n, max_context_len] decode logits over the paged key cache.

    ``piece_tiles`` (64-key tiles per CTA) and ``stages`` (3 or 4 tiles in the ring, wgmma)
    override the launch plan (benchmarks).
    """
    batch, next_n, heads, dim = q_codes.shape
    width = int(max_context_len)
    if out is None:
        out = cp.empty((batch * next_n, width), dtype=cp.float32)
    if batch * next_n == 0 or width == 0:
        out.fill(-numpy.inf)
        return out
    path = _pick_path(cp, path)
    if path == "mma" or (stages is not None and int(stages) not in DECODE_STAGES):
        stages = 4
    plan = decode_plan(batch, next_n, heads, width, cache.block_size, _sm_count(cp), stages)
    if (plan is None or dim != D or cache.head_dim != D
            or not _aligned(q_codes, cache.data)):
        out[...] = _ref.paged_mqa_logits(q_codes, cache.data, cache.block_size, weights,
                                         context_lens, block_table, width)
        return out
    variant, nc, nch, hp, stages, pt, pieces = plan
    if piece_tiles is not None:
        pt = max(1, min(int(piece_tiles), (BT_CAP - 1) * cache.block_size // TILE))
        tiles_w = -(-width // TILE)
        pieces = -(-tiles_w // pt)
    smem = smem_bytes(nch * nc, stages)
    fn = _kernel(cp, f"cps_paged_mqa_logits_{path}_{variant}_s{stages}", smem)
    context_lens = index_i32(cp, context_lens)
    block_table = index_i32(cp, block_table)
    lens_2d = i32(context_lens.ndim == 2)
    bs_shift = i32(int(cache.block_size).bit_length() - 1)
    bt_cols = i32(block_table.shape[1])
    num_blocks = i32(cache.num_blocks)        # page ids outside [0, num_blocks) are masked
    consts = (i32(width), i32(next_n), i32(heads), i32(hp), i32(nch), bs_shift, i32(pt))
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
