"""Per-row top-k of float32 logits (radix select, ``raw_kernels/topk.cu``).

One launch per call, on CuPy's current stream, no host synchronisation (so a
call can be captured in a CUDA graph): short rows (``len <= k``) are written
``0..len-1, -1, ...`` without using logits (decode rows load their first units
before the window is known, within the row's width); longer rows get exactly k
positions of their k largest values, in no particular order.

Work split: rows of at most ``ROW_WIDTH`` values run one 256-thread CTA a row
with the whole row in shared memory (variant ``r256``, five CTAs an SM at width
8192); wider rows one 512-thread CTA a row when there are enough rows to fill the
GPU, otherwise a thread-block cluster of C CTAs (2, 4, 8, or 16 on Hopper, a
non-portable size) that splits each row and merges through distributed shared
memory. The choice depends only on the shapes (rows, width) and the device's SM
count and compute capability, never on values.
``benchmarks/bench_topk.py`` times every variant.
"""

from typing import Any

from cpsparse import raw_kernels
from cpsparse.paging import INT32_MAX
from cpsparse.raw_kernels import index_i32

# Candidates a buffer (topk.cu's CAND, emitted as #defines): one CTA a row holds fewer
# (its candidate buffers share the SM with a second CTA), a cluster's CTAs more.
CAND_ONE_CTA = 1024        # TK_CAND_ONE_CTA
CAND_CLUSTER = 8192        # TK_CAND_CLUSTER
# Compiled configurations (topk.cu's TK_KERNEL lines): name -> (CTAs a row, threads,
# candidates a buffer); the launch takes two buffers of 8-byte candidates as dynamic
# shared memory.
# The r* variants hold the whole row in shared memory (the launch sizes the buffer to the
# width: row_buffer_bytes) and keep no candidate buffers: those with 0 candidates.
VARIANTS = {"c1": (1, 512, CAND_ONE_CTA), "c1_t256": (1, 256, CAND_ONE_CTA),
            "c2": (2, 512, CAND_CLUSTER), "c4": (4, 512, CAND_CLUSTER),
            "c8": (8, 512, CAND_CLUSTER), "c16": (16, 512, CAND_CLUSTER),
            "r256": (1, 256, 0)}
ROW_VARIANTS = tuple(name for name, (_, _, cand) in VARIANTS.items() if cand == 0)
DEFAULT_VARIANT = {1: "c1", 2: "c2", 4: "c4", 8: "c8", 16: "c16"}
CLUSTERS = tuple(sorted(DEFAULT_VARIANT))
# 16 CTAs a cluster is a non-portable size: Hopper (compute capability 9.x) runs it
# where its GPCs have 16 free SMs; measured on the 132-SM part (H200). Smaller Hopper
# parts (H20: 78 SMs) may have none, and other devices stop at the portable 8.
NON_PORTABLE_CLUSTER_CAPABILITIES = (9,)
NON_PORTABLE_CLUSTER_MIN_SMS = 132
SHORT_WIDTH = 16384        # rows no wider than this never split
MIN_SLICE = 4096           # a CTA's share of a row is at least this many values
ROW_WIDTH = 16384          # rows no wider than this run with the row in shared memory
ROW_MAX_WIDTH = 32768      # the widest an r* variant takes (a 128 KB buffer, one CTA an SM)
# The kernel counts a row's 16-byte units in int32 from the aligned address at or below
# its start: up to 3 values before the row and 3 after it must fit too.
MAX_WIDTH = INT32_MAX - 7

MODE_ROWS, MODE_DECODE, MODE_DECODE_2D = 0, 1, 2
# cps_topk_* parameters: logits, width, row_starts, row_ends, context_lens, next_n, mode,
# k, out, block_table, bt_cols, bs_shift (raw_kernels.Kernel letters).
ARGS = "P q PPP i i i P P ii"

raw_kernels.register_module(
    "topk", ["common.cuh", "hopper.cuh", "topk.cu"], options=("-default-device",),
    capabilities=raw_kernels.at_least(9, 0), ops=("topk_per_row", "topk_per_row_decode"),
    needs="thread-block clusters and distributed shared memory", pdl=True,
    defines=dict(TK_CAND_ONE_CTA=CAND_ONE_CTA, TK_CAND_CLUSTER=CAND_CLUSTER))


def cand_buffer_bytes(cand):
    """Dynamic shared memory of a c* launch: two buffers of ``cand`` 8-byte candidates."""
    return 2 * cand * 8


def row_buffer_bytes(width):
    """Dynamic shared memory of an r* launch: the 16-byte units of a row of ``width``
    values read from the aligned address at or below its start (up to 3 values before
    the row and 3 after it)."""
    return 16 * ((width + 6) // 4)


def max_cluster(capability, sms):
    """The largest cluster the default plan uses on a device of ``capability`` with
    ``sms`` multiprocessors."""
    return CLUSTERS[-1] if capability[0] in NON_PORTABLE_CLUSTER_CAPABILITIES \
        and sms >= NON_PORTABLE_CLUSTER_MIN_SMS else raw_kernels.PORTABLE_CLUSTER


def choose_cluster(rows, width, sms, largest=CLUSTERS[-1]):
    """CTAs per row: 1 unless few rows would leave SMs idle and rows are long; at most
    ``largest`` (see :func:`max_cluster`)."""
    c = 1
    if width <= SHORT_WIDTH:
        return c
    # Double while the doubled grid still fits one wave (64 rows -> pairs: measured
    # faster than 4-CTA clusters, whose merge costs more than the extra SMs give).
    # 16-CTA clusters need 16 free SMs of one GPC each: the H200 ran 8 of them (128
    # CTAs) in two waves (8 x 131072: 23.4 us against 14.5 with 8-CTA clusters), 4 in
    # one, so a grid of them takes at most half the SMs.
    while c < largest and width // (2 * c) >= MIN_SLICE and \
            rows * 2 * c <= (sms if 2 * c <= raw_kernels.PORTABLE_CLUSTER else sms // 2):
        c *= 2
    return c


def default_cluster(rows, width):
    """:func:`choose_cluster` on the current device (the plan's choice): a non-portable
    cluster only where the device runs all ``rows`` of them at once
    (:func:`cluster_capacity`; a Hopper part whose GPCs have fewer than 16 SMs runs
    none)."""
    facts = raw_kernels.device_facts()
    c = choose_cluster(rows, width, facts.sms, max_cluster(facts.capability, facts.sms))
    while c > raw_kernels.PORTABLE_CLUSTER and rows > cluster_capacity(c):
        c //= 2
    return c


_CAPACITY: dict[Any, int] = {}


def cluster_capacity(cluster):
    """How many rows' clusters of ``DEFAULT_VARIANT[cluster]`` the current device runs at
    once (memoized a device; 0 when the driver does not say)."""
    key = (raw_kernels.current_device(), cluster)
    got = _CAPACITY.get(key)
    if got is None:
        variant = DEFAULT_VARIANT[cluster]
        _, threads, cand = VARIANTS[variant]
        smem = cand_buffer_bytes(cand)
        fn = raw_kernels.kernel("topk", f"cps_topk_{variant}", ARGS, smem=smem,
                                cluster=cluster)
        got = _CAPACITY[key] = raw_kernels.max_active_clusters(fn, cluster, threads, smem)
    return got


def _plan(rows, width, cluster, variant):
    """(kernel, CTAs per row, threads, dynamic shared bytes) of a launch shape on the
    current device (memoized by :func:`prepare`)."""
    if variant is None:
        if cluster is None:
            cluster = default_cluster(rows, width)
        if cluster not in DEFAULT_VARIANT:
            raise ValueError(f"Invalid cluster: expected one of {CLUSTERS}, got {cluster}")
        variant = DEFAULT_VARIANT[cluster]
        if cluster == 1 and width <= ROW_WIDTH:
            variant = "r256"             # the row in shared memory
    cluster, threads, cand = VARIANTS[variant]
    if variant in ROW_VARIANTS:
        if width > ROW_MAX_WIDTH:
            raise ValueError(f"Invalid variant: {variant} takes rows of at most "
                             f"{ROW_MAX_WIDTH} values, got width={width}")
        smem = row_buffer_bytes(width)
    else:
        smem = cand_buffer_bytes(cand)
    fn = raw_kernels.kernel("topk", f"cps_topk_{variant}", ARGS, smem=smem, cluster=cluster)
    return fn, cluster, threads, smem


_LAUNCHES: dict[Any, Any] = {}


def prepare(cp, rows, width, k, mode, next_n=1, table_cols=0, block_size=0, cluster=None,
            variant=None):
    """The launch of one call shape on the current device, memoized:
    ``run(logits, row_starts, row_ends, context_lens, out, block_table) -> out``.

    Everything that follows from the shapes (the variant, grid, shared memory, the
    scalar arguments) is fixed here, so that a call is one argument pack and one
    launch: the public ops keep ``run`` in their call memo (a serving loop's eager
    top-k is bound by host time). ``run`` takes int32 index arrays (see
    :func:`cpsparse.raw_kernels.index_i32`) and allocates ``out`` when it is None.
    ``block_table`` (decode modes; ``table_cols`` its columns, ``block_size`` a power
    of two) makes the rows global cache slots.
    """
    if (width > MAX_WIDTH or k > INT32_MAX) and rows and k:
        raise ValueError(f"Invalid shape of logits: the top-k kernel takes rows of at most "
                         f"{MAX_WIDTH} values and k below 2**31, got width={width}, k={k}")
    key = (raw_kernels.current_device(), rows, width, k, mode, next_n, table_cols, block_size,
           cluster, variant)
    run = _LAUNCHES.get(key)
    if run is not None:
        return run
    shape = (rows, k)
    if rows == 0 or k == 0:
        def run(logits, row_starts, row_ends, context_lens, out, block_table):
            return raw_kernels.empty(cp, shape, cp.int32) if out is None else out
    else:
        fn, cluster, threads, smem = _plan(rows, width, cluster, variant)
        launch = fn.launcher((rows * cluster,), (threads,), smem)
        shift = int(block_size).bit_length() - 1 if block_size else 0

        def run(logits, row_starts, row_ends, context_lens, out, block_table):
            if out is None:
                out = raw_kernels.empty(cp, shape, cp.int32)
            launch((logits, width, row_starts, row_ends, context_lens, next_n, mode, k, out,
                    block_table, table_cols, shift))
            return out
    if len(_LAUNCHES) > 1024:
        _LAUNCHES.clear()
    _LAUNCHES[key] = run
    return run


def _launch(cp, logits, row_starts, row_ends, context_lens, next_n, mode, k, out, cluster,
            variant=None, block_table=None, block_size=0):
    rows, width = logits.shape
    if block_table is None:
        cols, block_size = 0, 0
    else:
        cols = block_table.shape[1]
    run = prepare(cp, rows, width, k, mode, next_n, cols, block_size, cluster, variant)
    return run(logits, index_i32(cp, row_starts), index_i32(cp, row_ends),
               index_i32(cp, context_lens), out, index_i32(cp, block_table))


def call_launch(cp, logits, k, mode, next_n, indices, block_table=None, block_size=0):
    """``(device, run)`` for a public op's call memo: :func:`prepare` of this call's shape
    on the current device, or None where the call takes more than that one launch (an
    index array that is not int32: :func:`cpsparse.raw_kernels.index_i32` copies it;
    a ``block_table`` whose page size the kernel does not map)."""
    if any(a is not None and a.dtype != cp.int32 for a in indices + (block_table,)):
        return None
    if block_table is None:
        cols, block_size = 0, 0
    elif supports_slots(block_size):
        cols = block_table.shape[1]
    else:
        return None
    rows, width = logits.shape
    return raw_kernels.current_device(), prepare(cp, rows, width, k, mode, next_n, cols,
                                                 block_size)


def decode_mode(context_lens):
    """The kernel's decode mode of ``context_lens`` [B] or [B, next_n]."""
    return MODE_DECODE_2D if context_lens.ndim == 2 else MODE_DECODE


def supports_slots(block_size):
    """True when the decode kernel can map positions to slots itself (a power-of-two
    page size); the op maps them with a second launch otherwise."""
    return block_size > 0 and block_size & (block_size - 1) == 0


def topk_per_row(cp, logits, row_starts, row_ends, k, out, *, cluster=None, variant=None):
    """Top-k positions of each window ``[row_starts, row_ends)`` into ``out`` [M, k].

    Inputs are validated by :func:`cpsparse.indexer.topk_per_row`. ``cluster``
    forces the CTAs per row and ``variant`` a compiled configuration (tests and
    benchmarks); None picks by shape.
    """
    return _launch(cp, logits, row_starts, row_ends, row_starts, 1, MODE_ROWS, k, out, cluster,
                   variant)


def topk_per_row_decode(cp, logits, context_lens, next_n, k, out, *, cluster=None,
                        variant=None, block_table=None, block_size=0):
    """Decode rows: start 0, end from ``context_lens`` [B] or [B, next_n] (in the kernel).

    With ``block_table`` [B, cols] (and a :func:`supports_slots` ``block_size``) the
    rows are global cache slots of request ``row // next_n`` instead of positions.
    """
    return _launch(cp, logits, context_lens, context_lens, context_lens, next_n,
                   decode_mode(context_lens), k, out,
                   cluster, variant, block_table, block_size)
