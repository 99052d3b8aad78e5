"""Ragged-batch and paging arithmetic: the one home of these formulas.

Array-generic (NumPy or CuPy, no validation), used by the metadata builder, the
reference, the launchers, the layer drivers, the benchmarks and the tests:

* :func:`cdiv` -- ceiling division;
* :func:`expand` -- per-request lengths to (request id, offset) of every packed item;
* :func:`causal_ends` -- bottom-right aligned causal windows
  (query i of a request with q_len queries and k_len keys sees ``j < k_len - q_len + i + 1``);
* :func:`decode_row_ends` -- the window end of each decode row;
* :func:`page_slots` / :func:`local_to_global_slots` -- page addressing
  (``slot = block_table[req, pos // B] * B + pos % B``), with every out-of-range input
  mapped to -1, never wrapped.

Examples
--------
>>> import numpy as np
>>> from cpsparse import paging
>>> paging.expand(np.array([2, 0, 3]))
(array([0, 0, 2, 2, 2]), array([0, 1, 0, 1, 2]))
>>> paging.causal_ends(q_len=2, k_len=5, i=np.arange(2))
array([4, 5])
"""

import numpy

from cpsparse._backend import xp_of

__all__ = ["INT32_MAX", "cdiv", "expand", "causal_ends", "causal_key_ranges",
           "decode_row_ends", "page_slots", "local_to_global_slots"]

INT32_MAX = 2 ** 31 - 1


def cdiv(a, b):
    """``ceil(a / b)`` for integers (scalars or arrays), b > 0."""
    return -(-a // b)


def expand(lengths):
    """(request of each item, offset of each item within its request) of packed lengths.

    ``lengths`` is a host int array [R]; returns two int64 arrays of ``sum(lengths)``.
    """
    lengths = numpy.asarray(lengths, dtype=numpy.int64)
    req = numpy.repeat(numpy.arange(lengths.size), lengths)
    starts = numpy.cumsum(lengths) - lengths
    return req, numpy.arange(int(lengths.sum())) - numpy.repeat(starts, lengths)


def causal_ends(q_len, k_len, i):
    """Exclusive end of the keys query ``i`` sees: ``k_len - q_len + i + 1``.

    Bottom-right aligned (FlashAttention's varlen convention): the new tokens see
    the whole context and causally each other. Works on scalars and arrays.
    """
    return k_len - q_len + i + 1


def causal_key_ranges(cu_seqlens_q, cu_seqlens_k):
    """Per query token of packed requests: (first key row, number of keys it sees).

    Host int64 cu arrays [R + 1] in; two int32 arrays [T] out.
    """
    lens_q = numpy.diff(cu_seqlens_q)
    lens_k = numpy.diff(cu_seqlens_k)
    req, i = expand(lens_q)
    visible = numpy.clip(causal_ends(lens_q[req], lens_k[req], i), 0, lens_k[req])
    return (numpy.asarray(cu_seqlens_k[:-1])[req].astype(numpy.int32),
            visible.astype(numpy.int32))


def decode_row_ends(context_lens, next_n):
    """int64 [B * next_n]: exclusive end of the window of each decode row.

    1-D ``context_lens`` [B] (the total length L_b, new tokens included): row (b, j)
    sees positions ``< L_b - next_n + j + 1``, clipped at 0 (the causal end of query
    j of next_n). 2-D ``context_lens`` [B, next_n]: row (b, j) sees ``< context_lens[b, j]``.
    """
    xp = xp_of(context_lens)
    lens = context_lens.astype(xp.int64)
    if lens.ndim == 2:
        return lens.reshape(-1)
    j = xp.arange(next_n, dtype=xp.int64)
    return xp.maximum(causal_ends(next_n, lens[:, None], j[None, :]), 0).reshape(-1)


def page_slots(block_table, req, pos, block_size):
    """Global slots of positions ``pos`` of requests ``req`` (broadcast), or -1.

    -1 for a masked (negative) position and for anything out of range: a request id
    outside the table, a position past its table row, a negative page id, or a slot
    past int32 (it would wrap onto another request's page). int32 result.
    """
    xp = xp_of(block_table)
    num_reqs, max_blocks = block_table.shape
    pos = xp.asarray(pos).astype(xp.int64)
    req = xp.broadcast_to(xp.asarray(req).astype(xp.int64), pos.shape)
    col = pos // block_size
    valid = (pos >= 0) & (col < max_blocks) & (req >= 0) & (req < num_reqs)
    pages = xp.zeros(pos.shape, dtype=xp.int64)
    pages[valid] = block_table[req[valid], col[valid]]
    slots = pages * block_size + pos % block_size
    valid &= (pages >= 0) & (slots <= INT32_MAX)
    return xp.where(valid, slots, -1).astype(xp.int32)


def local_to_global_slots(indices, req_ids, block_table, block_size):
    """Request-local top-k positions [T, topk] of requests ``req_ids`` [T] -> slots."""
    xp = xp_of(indices)
    return page_slots(block_table, xp.asarray(req_ids)[:, None], indices, block_size)
