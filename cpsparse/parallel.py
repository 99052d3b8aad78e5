"""Context parallelism across ranks: process groups, the DCP decode steps, PCP's gather.

With DCP each of ``world`` ranks holds a shard of every request's cache (vLLM's
layout: token t on rank ``(t // interleave) % world``; see
:mod:`cpsparse.reference.context_parallel`). A decode step then runs, on every rank:

1. :func:`dcp_topk_per_row`: the rank's local top-k over the keys it holds, its
   candidates (k values and their global positions a row, not whole rows) all-gathered,
   and the exact global top-k merged from them: the same rows on every rank, equal to
   :func:`cpsparse.topk_per_row` over the unsharded logits (ties and -1 padding
   included);
2. :func:`dcp_local_indices`: the global top-k positions this rank holds, as positions
   of its own shard (-1 elsewhere), ready for :func:`cpsparse.local_to_global_slots`
   with the rank's block table;
3. :func:`dcp_merge_attention`: each rank's partial attention over its selected keys,
   all-gathered and merged by lse: every rank ends with the unsharded result.

:class:`cpsparse.mla.DeepseekV32MLA` with a ``dcp_group`` runs those steps in its
decode forward, given this rank's :func:`dcp_decode_view` of the step.

Prefill context parallelism (PCP) splits a long prompt's tokens across the ranks (any
layout: contiguous, vLLM's head-tail halves for causal balance); each rank scores its
own queries against the whole prompt's keys, which :func:`pcp_all_gather` assembles in
global order from every rank's shard (the indexer's FP8 key codes and scales, or the
MLA latents), so the top-k rows equal one GPU's.

The collectives run on a process group: :class:`NcclGroup` (NCCL through
``cupy.cuda.nccl``, one process per GPU) or :class:`ThreadGroup` (ranks simulated by
threads of one process, NumPy or CuPy arrays: the CPU tests, and a way to try a layout
without GPUs). A group needs one method, ``all_gather(x) -> [world, *x.shape]``.

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, set by :class:`NcclGroup` unless the
caller set it): NVLS needs multicast objects the lent machines do not grant.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy

from cpsparse import _backend
from cpsparse import _validation as V
from cpsparse.indexer import topk_per_row, topk_per_row_core
from cpsparse.reference import context_parallel as _cp_ref
from cpsparse.reference._xp import xp_of

if TYPE_CHECKING:
    from cpsparse._typing import Array

__all__ = ["ThreadGroup", "NcclGroup", "DcpDecodeView", "dcp_decode_view",
           "dcp_topk_per_row", "dcp_local_indices", "dcp_merge_attention",
           "pcp_all_gather", "shard_rows"]


class ThreadGroup:
    """Ranks of one process, one thread each: a process group for tests and the CPU.

    Use :meth:`run`, which starts ``world`` threads and hands each its group.

    Parameters
    ----------
    rank, world : int
        This rank and the number of ranks.
    shared : dict
        The state the ranks of one :meth:`run` share (a barrier and the exchange
        slots); made by :meth:`run`.

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.parallel import ThreadGroup
    >>> ThreadGroup.run(3, lambda g: g.all_gather(np.array([g.rank]))[:, 0].tolist())
    [[0, 1, 2], [0, 1, 2], [0, 1, 2]]
    """

    def __init__(self, rank: int, world: int, shared: dict[str, Any]):
        self.rank = rank
        self.world = world
        self._shared = shared

    @classmethod
    def run(cls, world: int, fn: Callable[["ThreadGroup"], Any],
            timeout: float = 60.0) -> list[Any]:
        """``[fn(group of rank r) for r in range(world)]``, the ranks run concurrently.

        An exception on any rank breaks the others' collectives (no deadlock) and is
        raised here, the first rank's first.
        """
        world = V.check_positive_int("world", world)
        shared: dict[str, Any] = {"barrier": threading.Barrier(world, timeout=timeout),
                                  "slots": [None] * world}
        results: list[Any] = [None] * world
        errors: list[BaseException | None] = [None] * world

        def body(rank):
            try:
                results[rank] = fn(cls(rank, world, shared))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[rank] = e
                shared["barrier"].abort()

        threads = [threading.Thread(target=body, args=(r,), daemon=True)
                   for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        raised = [e for e in errors if e is not None]
        # A rank that failed breaks the barrier of the others: report its error.
        real = [e for e in raised if not isinstance(e, threading.BrokenBarrierError)]
        if raised:
            raise (real or raised)[0]
        return results

    def all_gather(self, x: Array) -> Array:
        """``[world, *x.shape]``: every rank's ``x`` (same shape and dtype on all)."""
        xp = xp_of(x)
        slots, barrier = self._shared["slots"], self._shared["barrier"]
        slots[self.rank] = x
        barrier.wait()
        got = list(slots)
        first = got[0]
        for r, y in enumerate(got):
            if y.shape != first.shape or y.dtype != first.dtype:
                barrier.abort()
                raise ValueError(f"Invalid all_gather: rank {r} gave {y.dtype}{list(y.shape)}"
                                 f", rank 0 {first.dtype}{list(first.shape)}")
        out = xp.stack(got)
        barrier.wait()                     # nobody overwrites a slot another still reads
        return out


class NcclGroup:
    """One rank of an NCCL communicator (``cupy.cuda.nccl``), one process per GPU.

    Parameters
    ----------
    world, rank : int
    unique_id : tuple
        :meth:`unique_id` of rank 0, handed to every rank (by a file, a pipe, MPI).
    stream : cupy.cuda.Stream, optional
        Stream of the collectives (default: the current stream at each call).

    Examples
    --------
    One process per GPU (not run here)::

        uid = NcclGroup.unique_id()          # on rank 0, then sent to every rank
        group = NcclGroup(world, rank, uid)  # with cupy.cuda.Device(rank) current
        rows = dcp_topk_per_row(group, local_logits, local_lens, lens, 2048)
    """

    def __init__(self, world: int, rank: int, unique_id: Any, *, stream: Any = None):
        self.rank, self.world = _check_rank(rank, world)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        nccl = self._nccl()
        self._uint8 = nccl.NCCL_UINT8
        self._comm = nccl.NcclCommunicator(self.world, unique_id, self.rank)
        self._stream = stream

    @staticmethod
    def _nccl():
        from cupy.cuda import nccl
        if not getattr(nccl, "available", False):
            raise RuntimeError("NCCL is not available to CuPy (install nvidia-nccl-cu12 "
                               "or nvidia-nccl-cu13 for your CuPy)")
        return nccl

    @classmethod
    def unique_id(cls) -> Any:
        """A new communicator id (call on one rank, share it with the others)."""
        return cls._nccl().get_unique_id()

    def all_gather(self, x: Array) -> Array:
        """``[world, *x.shape]`` of every rank's CuPy array ``x`` (as bytes: any dtype)."""
        import cupy
        x = cupy.ascontiguousarray(x)
        out = cupy.empty((self.world,) + x.shape, dtype=x.dtype)
        stream = self._stream or cupy.cuda.get_current_stream()
        self._comm.allGather(x.data.ptr, out.data.ptr, x.nbytes, self._uint8, stream.ptr)
        return out


def dcp_topk_per_row(group: Any, local_logits: Array, local_lens: Array, lens: Array, k: int,
                     *, interleave: int = 1) -> Array:
    """The exact global top-k of each row from the shards of every rank.

    Parameters
    ----------
    group : ThreadGroup, NcclGroup or any object with ``rank``, ``world`` and
        ``all_gather``
    local_logits : float32 [M, N_local]
        This rank's logits of each row over the keys it holds, in its local order
        (local position j is global position ``dcp_to_global(j, rank, world,
        interleave)``).
    local_lens : int [M]
        How many of each row's keys this rank holds (``dcp_local_lens``).
    lens : int [M]
        Each row's global length (its keys are global positions ``[0, len)``).
    k : int
    interleave : int
        vLLM's ``cp_kv_cache_interleave_size``.

    Returns
    -------
    int32 [M, k]
        Global positions, identical on every rank: what :func:`cpsparse.topk_per_row`
        returns over the whole row (a row of at most k keys: its positions ascending,
        then -1).

    Examples
    --------
    Two simulated ranks, one row of 6 keys, token t on rank t % 2:

    >>> import numpy as np
    >>> from cpsparse.parallel import ThreadGroup, dcp_topk_per_row, shard_rows
    >>> row = np.array([[0.5, 3.0, 1.0, 2.0, 9.0, 0.0]], np.float32)
    >>> def rank(g):
    ...     mine = shard_rows(row, g.rank, g.world)      # keys 0, 2, 4 or 1, 3, 5
    ...     return dcp_topk_per_row(g, mine, np.array([3]), np.array([6]), 3)
    >>> ThreadGroup.run(2, rank)[1]
    array([[4, 1, 3]], dtype=int32)
    """
    check_group(group)
    k = V.check_positive_int("k", k)
    interleave = V.check_positive_int("interleave", interleave)
    return dcp_topk_per_row_core(group, local_logits, local_lens, lens, k, interleave,
                                 checked=False)


def dcp_topk_per_row_core(group, local_logits, local_lens, lens, k, interleave, *,
                          checked=True):
    """:func:`dcp_topk_per_row`; ``checked``: the windows are known valid (the DCP
    layer built them on the host), so the local top-k skips its value checks (a device
    read on CuPy)."""
    xp = xp_of(local_logits)
    m, width = local_logits.shape
    if width == 0:                        # this rank holds no key of any row
        vals = xp.full((m, k), -xp.inf, dtype=xp.float32)
        local = xp.full((m, k), -1, dtype=xp.int32)
    else:
        starts = xp.zeros(m, dtype=xp.int32)
        ends = xp.asarray(local_lens).astype(xp.int32)
        local = (topk_per_row_core(xp, local_logits, starts, ends, k,
                                   xp.empty((m, k), dtype=xp.int32)) if checked
                 else topk_per_row(local_logits, starts, ends, k))
        vals = xp.take_along_axis(local_logits, xp.maximum(local, 0), axis=1)
    glob = _cp_ref.dcp_to_global(local, group.rank, group.world, interleave)
    return _cp_ref.merge_topk(group.all_gather(vals), group.all_gather(glob),
                              xp.asarray(lens), k)


def dcp_local_indices(positions: Array, rank: int, world: int, *,
                      interleave: int = 1) -> Array:
    """This rank's share of global top-k positions, as positions of its own shard.

    A position the rank holds becomes its local position
    (:func:`cpsparse.reference.context_parallel.dcp_to_local`); one another rank
    holds, and -1, become -1. Map the result to cache slots with
    :func:`cpsparse.local_to_global_slots` and the rank's block table.

    Parameters
    ----------
    positions : int [T, k]
        Global (request-local) token positions, -1 for padding
        (:func:`dcp_topk_per_row`'s rows).
    rank, world : int
    interleave : int
        vLLM's ``cp_kv_cache_interleave_size``.

    Returns
    -------
    int32 [T, k]

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.parallel import dcp_local_indices
    >>> dcp_local_indices(np.array([[0, 1, 2, 3, 5, -1]], np.int32), 1, 2)
    array([[-1,  0, -1,  1,  2, -1]], dtype=int32)
    """
    rank, world = _check_rank(rank, world)
    interleave = V.check_positive_int("interleave", interleave)
    xp = xp_of(positions)
    if positions.dtype.kind not in "iu":
        raise TypeError(f"Invalid dtype of positions: expected an integer array, "
                        f"got {positions.dtype}")
    return _cp_ref.dcp_to_local(positions, rank, world, interleave).astype(xp.int32)


def dcp_merge_attention(group: Any, out: Array, lse: Array) -> tuple[Array, Array]:
    """Merge every rank's partial attention (over the keys it holds) by lse.

    Parameters
    ----------
    group : a process group (see :func:`dcp_topk_per_row`)
    out : float32 [T, H, d_v]
        This rank's normalised output over its keys (:func:`cpsparse.sparse_mla_attention`
        with the indices of :func:`dcp_local_indices`).
    lse : float32 [T, H]
        Its lse (-inf where the rank holds none of a row's selected keys).

    Returns
    -------
    out float32 [T, H, d_v], lse float32 [T, H]
        The attention over all the selected keys, on every rank; a row no rank has a
        key for gets out 0 and lse -inf, a NaN on any rank makes the row NaN.
    """
    check_group(group)
    merged, merged_lse = _cp_ref.merge_attention(group.all_gather(out), group.all_gather(lse))
    xp = xp_of(out)
    return merged.astype(xp.float32), merged_lse.astype(xp.float32)


@dataclasses.dataclass(frozen=True)
class DcpDecodeView:
    """One rank's view of a decode step under DCP (built by :func:`dcp_decode_view`).

    T is the number of new tokens of the step (decodes only, request order), R the
    number of requests. Every parameter is an attribute of the same name. The view is
    frozen and owns copies of its arrays: a layer checks its page ids against its
    caches, and a caller's later change to its table cannot reach it.

    Parameters
    ----------
    rank, world, interleave, block_size : int
        The shard layout and the caches' page size.
    query_lens, context_lens : numpy.ndarray
        Host int64 [R]: new tokens of each request, tokens already cached (global).
    positions : int32 array [T]
        Global position of each new token (its RoPE position).
    req_ids : int32 array [T]
        Request of each new token (row of ``block_table``).
    ends : int64 array [T]
        Each token's global window end (``position + 1``: it sees the keys before it
        and itself).
    local_ends : int32 array [T]
        How many of those keys this rank holds.
    slot_mapping : int32 array [T]
        Local cache slot of each new token this rank holds, -1 for the others.
    num_local_tokens : int
        How many of the new tokens this rank holds.
    block_table : int32 array [R, cols]
        This rank's page ids of each request, in local position order (a copy of the
        caller's table: the slots above were computed from it).
    token_table : int32 array [T, cols]
        ``block_table[req_ids]``: each token scored as its own row.
    block_table_host : numpy.ndarray
        Host copy of ``block_table``.
    local_seq_lens : numpy.ndarray
        Host int64 [R]: each request's tokens on this rank after the step (what the
        table must cover).
    max_local_len : int
        The longest local window (``local_ends.max()``, 0 without tokens).
    """
    rank: int
    world: int
    interleave: int
    block_size: int
    query_lens: numpy.ndarray
    context_lens: numpy.ndarray
    positions: Any
    req_ids: Any
    ends: Any
    local_ends: Any
    slot_mapping: Any
    num_local_tokens: int
    block_table: Any
    token_table: Any
    block_table_host: numpy.ndarray
    local_seq_lens: numpy.ndarray
    max_local_len: int

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())


def dcp_decode_view(query_lens: Sequence[int], context_lens: Sequence[int],
                    local_block_table: Array, rank: int, world: int, *, interleave: int = 1,
                    block_size: int = 64, next_n: int = 1) -> DcpDecodeView:
    """This rank's view of a DCP decode step: global positions, its shard's slots.

    Parameters
    ----------
    query_lens : sequence of int [R]
        New tokens of each request (1 .. ``next_n``: a decode step).
    context_lens : sequence of int [R]
        Tokens of each request already cached, over all ranks.
    local_block_table : int32 array [R, cols]
        This rank's pages of each request (its local positions ``0, 1, ...`` in order;
        they must cover the request's local length after the step). NumPy or CuPy (sets
        the backend).
    rank, world : int
    interleave : int
        vLLM's ``cp_kv_cache_interleave_size``.
    block_size : int
        Tokens per page of the rank's caches.
    next_n : int
        1 + the number of speculative tokens.

    Returns
    -------
    DcpDecodeView

    Examples
    --------
    Rank 1 of 2 holds the odd positions; the new token of a request with 5 cached
    tokens sits at position 5, its local position 2 (page 7, offset 2):

    >>> import numpy as np
    >>> from cpsparse.parallel import dcp_decode_view
    >>> view = dcp_decode_view([1], [5], np.array([[7]], np.int32), 1, 2, block_size=4)
    >>> view.positions, view.slot_mapping, view.local_ends
    (array([5], dtype=int32), array([30], dtype=int32), array([3], dtype=int32))
    """
    xp = _backend.get_array_module(local_block_table=local_block_table)
    rank, world = _check_rank(rank, world)
    interleave = V.check_positive_int("interleave", interleave)
    block_size = V.check_positive_int("block_size", block_size)
    next_n = V.check_positive_int("next_n", next_n)
    V.check_index("local_block_table", local_block_table, ndim=2, shape_desc="[R, cols]")
    q = numpy.asarray(query_lens, dtype=numpy.int64).reshape(-1)
    ctx = numpy.asarray(context_lens, dtype=numpy.int64).reshape(-1)
    table_h = numpy.array(V.to_host(local_block_table), dtype=numpy.int32)    # a copy
    if q.shape != ctx.shape or q.shape[0] != table_h.shape[0]:
        raise ValueError(f"Invalid lengths: expected query_lens, context_lens and "
                         f"local_block_table rows to agree on R, got {q.shape[0]}, "
                         f"{ctx.shape[0]} and {table_h.shape[0]}")
    if (ctx < 0).any() or (q < 1).any() or (q > next_n).any():
        raise ValueError(f"Invalid lengths: a DCP decode step takes 1 <= query_lens <= "
                         f"next_n={next_n} and context_lens >= 0, got {q.tolist()} and "
                         f"{ctx.tolist()}")
    local_seq = _cp_ref.dcp_local_lens(ctx + q, rank, world, interleave)
    V.check_block_table(numpy, local_seq, table_h, block_size,
                        name="local_block_table", what="this rank's caches")
    req = numpy.repeat(numpy.arange(q.size, dtype=numpy.int64), q)
    starts = numpy.repeat(numpy.cumsum(q) - q, q)
    pos = numpy.repeat(ctx, q) + numpy.arange(req.size, dtype=numpy.int64) - starts
    local = _cp_ref.dcp_to_local(pos, rank, world, interleave)
    mine = local >= 0
    lpos = numpy.where(mine, local, 0)
    page = table_h[req, lpos // block_size].astype(numpy.int64) if req.size else lpos
    slots = numpy.where(mine, page * block_size + lpos % block_size, -1)
    local_ends = _cp_ref.dcp_local_lens(pos + 1, rank, world, interleave)
    table = xp.asarray(table_h)                  # from the host copy the slots came from
    req_d = xp.asarray(req.astype(numpy.int32))
    return DcpDecodeView(
        rank=rank, world=world, interleave=interleave, block_size=block_size,
        query_lens=q, context_lens=ctx, positions=xp.asarray(pos.astype(numpy.int32)),
        req_ids=req_d, ends=xp.asarray(pos + 1),
        local_ends=xp.asarray(local_ends.astype(numpy.int32)),
        slot_mapping=xp.asarray(slots.astype(numpy.int32)),
        num_local_tokens=int(mine.sum()), block_table=table,
        token_table=xp.ascontiguousarray(table[req_d]), block_table_host=table_h,
        local_seq_lens=local_seq, max_local_len=int(local_ends.max()) if local_ends.size else 0)


def pcp_all_gather(group: Any, x: Array, positions: Array, total: int) -> Array:
    """Every rank's rows of ``x`` at their global positions: the whole sequence.

    Parameters
    ----------
    group : a process group (see :func:`dcp_topk_per_row`)
    x : array [n_local, ...]
        This rank's rows (its tokens' keys, scales or latents; the shard may be empty).
    positions : int [n_local]
        Their global positions in ``[0, total)``.
    total : int
        The sequence length; the ranks' positions must cover ``[0, total)`` exactly
        once (else ``ValueError``, on every rank).

    Returns
    -------
    array [total, ...]
        Same dtype as ``x``, on every rank.

    Examples
    --------
    Three tokens on two ranks (rank 0 holds tokens 0 and 2):

    >>> import numpy as np
    >>> from cpsparse.parallel import ThreadGroup, pcp_all_gather
    >>> def rank(g):
    ...     pos = np.array([0, 2]) if g.rank == 0 else np.array([1])
    ...     return pcp_all_gather(g, 10 * pos, pos, 3)
    >>> ThreadGroup.run(2, rank)[1]
    array([ 0, 10, 20])
    """
    check_group(group)
    total = V.check_nonnegative_int("total", total)
    xp = xp_of(x)
    if positions.ndim != 1 or positions.shape[0] != x.shape[0]:
        raise ValueError(f"Invalid shape of positions: expected [{x.shape[0]}] (one per "
                         f"row of x), got {list(positions.shape)}")
    # Two host syncs: the shard sizes (to pad to one width), then one coverage flag.
    counts = [int(c) for c in group.all_gather(xp.asarray([x.shape[0]], dtype=xp.int64))
              .reshape(-1).tolist()]
    width = max(counts)
    rows = xp.zeros((width,) + tuple(x.shape[1:]), dtype=x.dtype)
    rows[:x.shape[0]] = x
    where = xp.full(width, -1, dtype=xp.int64)
    where[:x.shape[0]] = positions
    all_rows, all_pos = group.all_gather(rows), group.all_gather(where)
    pos = xp.concatenate([all_pos[r, :n] for r, n in enumerate(counts)])
    got = xp.concatenate([all_rows[r, :n] for r, n in enumerate(counts)])
    inside = (pos >= 0) & (pos < total)
    once = xp.bincount(xp.where(inside, pos, 0), minlength=max(total, 1))[:total] == 1
    if sum(counts) != total or not bool(inside.all() & once.all()):
        raise ValueError(f"Invalid positions: the ranks' shards ({counts} rows) "
                         f"must cover [0, {total}) exactly once")
    out = xp.empty((total,) + tuple(x.shape[1:]), dtype=x.dtype)
    out[pos] = got
    return out


def shard_rows(x: Array, rank: int, world: int, *, interleave: int = 1,
               axis: int = -1) -> Array:
    """The part of ``x`` along ``axis`` that rank ``rank`` holds, in its local order.

    Parameters
    ----------
    x : array
        Values over the global token positions along ``axis`` (logits, latents).
    rank, world : int
    interleave : int
    axis : int

    Returns
    -------
    array
        ``take(x, dcp_to_global(arange(n_local)), axis)``, a new contiguous array.

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.parallel import shard_rows
    >>> shard_rows(np.arange(10), 1, 3, interleave=2)
    array([2, 3, 8, 9])
    """
    xp = xp_of(x)
    n = x.shape[axis]
    n_local = int(_cp_ref.dcp_local_lens(numpy.array([n]), rank, world, interleave)[0])
    glob = _cp_ref.dcp_to_global(xp.arange(n_local), rank, world, interleave)
    return xp.take(x, glob, axis=axis)


def _check_rank(rank: int, world: int) -> tuple[int, int]:
    """(rank, world) as ints, 0 <= rank < world."""
    world = V.check_positive_int("world", world)
    rank = V.check_nonnegative_int("rank", rank)
    if rank >= world:
        raise ValueError(f"Invalid rank: expected 0 <= rank < world={world}, got {rank}")
    return rank, world


def check_group(group: Any,
                names: Sequence[str] = ("rank", "world", "all_gather")) -> None:
    """TypeError unless ``group`` has what a process group needs (``names``)."""
    missing = [n for n in names if not hasattr(group, n)]
    if missing:
        raise TypeError(f"Invalid group: expected an object with {', '.join(names)}, "
                        f"got {type(group).__name__} without {', '.join(missing)}")
