"""Reference of the lightning indexer: FP8 scoring and per-row top-k.

Array-generic (NumPy or CuPy), float64 accumulation, float32 results, no
validation (the public wrappers in :mod:`cpsparse.indexer` validate).

Exactness note: products of two e4m3 values need at most 8 significant bits
and a 128-term dot product of them spans less than 2**43 quanta, so the fp8
dot products are *exact* in float64, in any summation order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy

from cpsparse import paging
from cpsparse.reference import cache as cache_ref
from cpsparse.reference import fp4, fp8
from cpsparse.reference._xp import to_host, xp_of

if TYPE_CHECKING:
    from cpsparse._typing import Array, IntLike

WORKSPACE_BYTES = 256 << 20


def fold_weights(weights: Array, q_scales: Array, head_dim: IntLike) -> Array:
    """``W[t,h] = w[t,h] * s_q[t,h] * D**-0.5 * H**-0.5`` in float32."""
    xp = xp_of(weights)
    n_heads = weights.shape[-1]
    w = fp8.to_float64(weights) * fp8.to_float64(q_scales).reshape(weights.shape)
    return (w * (head_dim ** -0.5) * (n_heads ** -0.5)).astype(xp.float32)


def _score_block(q, k, k_scales, weights):
    """[m, n] float64: s_k * sum_h W * relu(q . k) for decoded q [m,H,D], k [n,D]."""
    m, h, d = q.shape
    dots = (q.reshape(m * h, d) @ k.T).reshape(m, h, -1)
    xp = xp_of(dots)
    xp.maximum(dots, 0.0, out=dots)
    acc = (dots * weights[:, :, None]).sum(axis=1)
    return acc * k_scales[None, :]


def mqa_logits(q_codes: Array, k_codes: Array, k_scales: Array, weights: Array, ks: Array,
               ke: Array) -> Array:
    """logits [M, N] float32; ``-inf`` outside ``[ks, ke)``.

    Windows are clamped to the keys that exist (``[max(ks, 0), min(ke, N))``), as the
    kernels do when no host check ran.
    """
    xp = xp_of(q_codes)
    m_total, heads, dim = q_codes.shape
    n_keys = k_codes.shape[0]
    out = xp.full((m_total, n_keys), -xp.inf, dtype=xp.float32)
    if m_total == 0 or n_keys == 0:
        return out
    q = fp8.e4m3_decode(q_codes).astype(xp.float64)
    if k_scales.dtype == xp.uint8:         # MXFP4 keys: packed e2m1 and ue8m0 bytes
        k = fp4.dequantize(k_codes, k_scales)
        s_k = xp.ones(n_keys, dtype=xp.float64)
    else:
        k = fp8.e4m3_decode(k_codes).astype(xp.float64)
        s_k = k_scales.reshape(-1).astype(xp.float64)
    w = weights.astype(xp.float64)
    ks = xp.clip(ks.astype(xp.int64), 0, n_keys)
    ke = xp.clip(ke.astype(xp.int64), 0, n_keys)
    ks_h = to_host(ks)
    ke_h = to_host(ke)
    rows = max(1, WORKSPACE_BYTES // (8 * heads * max(1, n_keys)))
    for m0 in range(0, m_total, rows):
        m1 = min(m_total, m0 + rows)
        lo, hi = int(ks_h[m0:m1].min()), int(ke_h[m0:m1].max())
        if hi <= lo:
            continue
        vals = _score_block(q[m0:m1], k[lo:hi], s_k[lo:hi], w[m0:m1])
        cols = xp.arange(lo, hi)[None, :]
        inside = (cols >= ks[m0:m1, None]) & (cols < ke[m0:m1, None])
        out[m0:m1, lo:hi] = xp.where(inside, vals, -xp.inf)
    return out


decode_row_ends = paging.decode_row_ends


def paged_mqa_logits(q_codes: Array, cache_data: Array, block_size: int, weights: Array,
                     context_lens: Array, block_table: Array, max_context_len: int,
                     fmt: str = "fp8") -> Array:
    """logits [B * next_n, max_context_len] float32 over the paged key cache (pages of
    ``fmt`` "fp8" or "mxfp4", see :func:`cpsparse.reference.cache.indexer_layout`).

    Windows end at ``min(end, max_context_len)``. A position whose page id is
    outside ``[0, num_blocks)``, or past the request's block-table row, is not a
    key: it is never read and scores ``-inf``.
    """
    xp = xp_of(q_codes)
    batch, next_n, heads, dim = q_codes.shape
    num_blocks, max_blocks = cache_data.shape[0], block_table.shape[1]
    out = xp.full((batch * next_n, max_context_len), -xp.inf, dtype=xp.float32)
    ends = xp.minimum(decode_row_ends(context_lens, next_n), max_context_len)
    ends_h = to_host(ends)
    for b in range(batch):
        rows = slice(b * next_n, (b + 1) * next_n)
        length = int(ends_h[rows].max()) if next_n else 0
        if length <= 0:
            continue
        pos = xp.arange(length)
        col = pos // block_size
        pages = xp.full(length, -1, dtype=xp.int64)
        inside = col < max_blocks
        pages[inside] = block_table[b, col[inside]]
        exists = (pages >= 0) & (pages < num_blocks)
        pos = pos[exists]
        codes, scales = cache_ref.indexer_read(cache_data, block_size, dim, pages[exists],
                                               pos % block_size, fmt)
        ks = xp.zeros(next_n, dtype=xp.int64)
        # Keys are the existing positions only; a row's window is those below its end.
        ke = xp.searchsorted(pos, ends[rows])
        out[rows, pos] = mqa_logits(q_codes[b], codes, scales, weights[rows], ks, ke)
    return out


# ---- top-k -------------------------------------------------------------------

def order_keys(values: Array) -> Array:
    """uint32 keys whose unsigned order is the order of the float32 values.

    NaN maps to 0, below every number (-inf included); -0.0 maps like +0.0
    so that equal values tie exactly and ties go to the lower index.
    """
    xp = xp_of(values)
    v = xp.ascontiguousarray(values, dtype=xp.float32)
    v = xp.where(v == 0, xp.float32(0), v)
    u = v.view(xp.uint32)
    keys = xp.where(u >> 31 == 1, ~u, u | xp.uint32(0x80000000))
    return xp.where(xp.isnan(v), xp.uint32(0), keys)


def topk_per_row(logits: Array, row_starts: Array, row_ends: Array, k: int,
                 out: Array | None = None) -> Array:
    """int32 [M, k] of row-start-relative positions; see :func:`cpsparse.indexer.topk_per_row`.

    Rows no longer than k get ``0..len-1`` then -1. Longer rows get the k
    largest values, largest first, ties to the lower position, NaN last.
    """
    xp = xp_of(logits)
    m_total, width = logits.shape
    if out is None:
        out = xp.empty((m_total, k), dtype=xp.int32)
    # Windows clamped to the row, as the kernel does when no host check ran.
    ends = xp.clip(row_ends.astype(xp.int64), 0, width)
    starts = xp.minimum(xp.clip(row_starts.astype(xp.int64), 0, width), ends)
    row_ends = ends
    lens = ends - starts
    cols = xp.arange(k, dtype=xp.int64)
    out[...] = xp.where(cols[None, :] < lens[:, None], cols[None, :], -1).astype(xp.int32)
    long_rows = xp.flatnonzero(lens > k)
    if long_rows.size == 0:
        return out
    rows_per_chunk = max(1, WORKSPACE_BYTES // (8 * max(1, width)))
    positions = xp.arange(width, dtype=xp.uint64)
    for c0 in range(0, int(long_rows.size), rows_per_chunk):
        rows = long_rows[c0:c0 + rows_per_chunk]
        # Composite key: descending value in the high word, column in the low
        # word; unique keys make the selection deterministic.
        desc = (xp.uint32(0xFFFFFFFF) - order_keys(logits[rows])).astype(xp.uint64)
        key = (desc << xp.uint64(32)) | positions[None, :]
        c = positions[None, :].astype(xp.int64)
        inside = (c >= starts[rows, None]) & (c < row_ends[rows, None].astype(xp.int64))
        key = xp.where(inside, key, xp.uint64(0xFFFFFFFFFFFFFFFF))
        best = xp.sort(xp.partition(key, k - 1, axis=1)[:, :k], axis=1)
        col = (best & xp.uint64(0xFFFFFFFF)).astype(xp.int64)
        out[rows] = (col - starts[rows, None]).astype(xp.int32)
    return out


def topk_per_row_decode(logits: Array, context_lens: Array, next_n: int, k: int,
                        out: Array | None = None) -> Array:
    """Decode form: row_starts 0, row ends from :func:`decode_row_ends`."""
    xp = xp_of(logits)
    ends = decode_row_ends(context_lens, next_n)
    return topk_per_row(logits, xp.zeros_like(ends), ends, k, out=out)


# ---- Hadamard rotation -------------------------------------------------------

def hadamard_rotate(x: Array) -> Array:
    """``x @ H_n / sqrt(n)`` on the last axis (Sylvester order), float32 out.

    Iterative fast Walsh-Hadamard transform in float64: log2(n) butterfly
    stages, each a reshape and one add/subtract.
    """
    xp = xp_of(x)
    v = fp8.to_float64(x)
    n = v.shape[-1]
    lead = v.shape[:-1]
    h = 1
    while h < n:
        v = v.reshape(lead + (n // (2 * h), 2, h))
        a, b = v[..., 0, :], v[..., 1, :]
        v = xp.stack([a + b, a - b], axis=-2)
        h *= 2
    return (v.reshape(lead + (n,)) * (n ** -0.5)).astype(xp.float32)
