"""Decode context parallelism (DCP) on one host: the shard layout and the two merges.

With DCP each of ``world`` ranks holds a shard of every request's cache: token t
of a request lives on rank ``(t // interleave) % world`` at local position
``(t // (interleave * world)) * interleave + t % interleave`` (vLLM's layout;
``interleave`` is its ``cp_kv_cache_interleave_size``, 1 by default). Each rank
scores its own keys and keeps its local top-k; the exact global top-k is then
merged from the ranks' candidates (k a rank, not whole rows), and each rank's
partial attention over the selected keys it holds is merged by lse.

Both merges are exact: a row's global top-k is contained in the union of the
local top-ks (a rank contributes at most k of them, and they are its largest),
and the local-to-global map is increasing on each rank, so the tie rule (the
lower position first) agrees between a shard and the whole row. Array-generic
(NumPy or CuPy), float64 for the lse merge.
"""

from __future__ import annotations

import numpy

from cpsparse.reference._xp import xp_of
from cpsparse.reference.indexer import order_keys


def dcp_local_lens(lens, rank, world, interleave=1):
    """How many of each request's ``lens`` tokens rank ``rank`` holds (int64)."""
    xp = xp_of(lens)
    lens = lens.astype(xp.int64)
    span = interleave * world
    full, rest = lens // span, lens % span
    mine = xp.clip(rest - rank * interleave, 0, interleave)
    return full * interleave + mine


def dcp_to_global(local, rank, world, interleave=1):
    """Global token positions of a rank's local positions; -1 (padding) stays -1."""
    xp = xp_of(local)
    local = local.astype(xp.int64)
    block, offset = local // interleave, local % interleave
    g = (block * world + rank) * interleave + offset
    return xp.where(local < 0, -1, g)


def dcp_to_local(positions, rank, world, interleave=1):
    """Local positions on rank ``rank`` of global token positions (the inverse of
    :func:`dcp_to_global`); a position another rank holds, and -1, give -1 (int64)."""
    xp = xp_of(positions)
    p = positions.astype(xp.int64)
    mine = (p >= 0) & ((p // interleave) % world == rank)
    local = (p // (interleave * world)) * interleave + p % interleave
    return xp.where(mine, local, -1)


def merge_topk(values, positions, lens, k):
    """The global top-k of each row from every rank's candidates.

    Parameters
    ----------
    values : float32 [R, M, kr]
        Each rank's candidate values (its local top-k of the row), anything where
        the position is -1.
    positions : int [R, M, kr]
        Their global positions (:func:`dcp_to_global`), -1 for padding.
    lens : int [M]
        Each row's global length: a row of at most k tokens takes the short-row rule
        (the candidates alone cannot tell: a rank holding exactly k of a longer row
        returns k, as one holding a row of k does).
    k : int
        The global k (each rank's candidates must be its local top-k with this k).

    Returns
    -------
    int32 [M, k]
        :func:`cpsparse.reference.indexer.topk_per_row`'s answer on the whole row:
        a row of at most k tokens gets its positions ascending, then -1; a longer
        row the k largest values, largest first, ties to the lower position, NaN
        below every number.
    """
    xp = xp_of(values)
    r, m, kr = positions.shape
    pos = xp.moveaxis(positions.astype(xp.int64), 0, 1).reshape(m, r * kr)
    val = xp.moveaxis(values, 0, 1).reshape(m, r * kr)
    valid = pos >= 0
    out = xp.full((m, k), -1, dtype=xp.int32)
    if r * kr == 0:
        return out
    # One sort of composite keys, position in the low word: a long row orders by
    # descending value first (high word), a short row (len <= k) by position alone.
    upos = xp.where(valid, pos, 0).astype(xp.uint64)
    desc = (xp.uint32(0xFFFFFFFF) - order_keys(val)).astype(xp.uint64)
    short = (lens.astype(xp.int64) <= k)[:, None]
    none = xp.uint64(0xFFFFFFFFFFFFFFFF)
    key = xp.where(valid, xp.where(short, upos, (desc << xp.uint64(32)) | upos), none)
    best = xp.sort(key, axis=1)[:, :min(k, r * kr)]
    out[:, :best.shape[1]] = xp.where(best == none, -1,
                                      (best & xp.uint64(0xFFFFFFFF)).astype(xp.int64))
    return out


def merge_attention(outs, lses):
    """Merge the ranks' partial attention over disjoint key sets by their lse.

    Parameters
    ----------
    outs : float [R, T, H, d_v]
        Each rank's normalised output over the keys it holds.
    lses : float [R, T, H]
        Their lse (natural log; -inf where a rank holds none of a row's keys).

    Returns
    -------
    out float64 [T, H, d_v], lse float64 [T, H]
        ``lse = log sum_r exp(lse_r)``, ``out = sum_r exp(lse_r - lse) out_r``; a row
        no rank has a key for gets out 0 and lse -inf, and a NaN lse (a NaN score on
        that rank) makes the row NaN, as one pass over all the keys would.
    """
    xp = xp_of(outs)
    outs = outs.astype(xp.float64)
    lses = lses.astype(xp.float64)
    nan = xp.isnan(lses).any(axis=0)
    clean = xp.where(xp.isnan(lses), -xp.inf, lses)
    top = clean.max(axis=0) if clean.shape[0] else xp.full(clean.shape[1:], -xp.inf)
    empty = top == -xp.inf
    shift = xp.where(empty, 0.0, top)
    with numpy.errstate(over="ignore", invalid="ignore"):
        w = xp.where(clean == -xp.inf, 0.0, xp.exp(clean - shift[None]))
    total = w.sum(axis=0)
    with numpy.errstate(divide="ignore", invalid="ignore"):
        out = (w[..., None] * xp.where(w[..., None] > 0, outs, 0.0)).sum(axis=0) / \
            xp.where(empty, 1.0, total)[..., None]
        lse = xp.where(empty, -xp.inf, shift + xp.log(xp.where(empty, 1.0, total)))
    out = xp.where(empty[..., None], 0.0, out)
    out = xp.where(nan[..., None], xp.nan, out)
    lse = xp.where(nan, xp.nan, lse)
    return out, lse
