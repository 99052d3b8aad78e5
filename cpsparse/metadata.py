"""Batch metadata for the DSA layer drivers, built from plain per-request lengths.

One :class:`BatchMetadata` describes a forward pass over a packed batch of
requests (decodes first, then prefills, in batch order): where each new token
goes in the paged caches, the indexer's decode/prefill split with its decode
rows and prefill chunks, and the MLA side's metadata (its own decode
threshold, ``prefill.max_seq_len``, ``prefill.use_dense_mha``).

A :class:`ForwardContext` maps layer names to MLA metadata, like vLLM's
``forward_context.attn_metadata``; the indexer reads the MLA metadata of the
layer named by ``dense_mha_metadata_layer_name`` to decide the short-prefill
early return (``docs/contract.md``, "The indexer of a layer and the
construction-time gate").
"""

import contextlib
import dataclasses
import threading
from typing import Any, Dict, List, Optional

import numpy

from cpsparse import _backend
from cpsparse import _validation as V
from cpsparse import paging
from cpsparse.reference._xp import to_host

__all__ = ["BatchMetadata", "DecodeMetadata", "DenseMetadata", "PrefillChunk", "PrefillMetadata",
           "MLAMetadata", "MLAPrefillMetadata", "ForwardContext", "build_batch",
           "decodes_first_order", "check_batch", "dense_metadata", "set_forward_context",
           "get_forward_context",
           "DEFAULT_LOGITS_BUDGET_BYTES"]

DEFAULT_LOGITS_BUDGET_BYTES = 512 << 20


@dataclasses.dataclass
class DecodeMetadata:
    """The indexer's decode requests (the first ``num_decodes`` of the batch).

    Decode tokens are laid out on ``[num_decodes, next_n]`` rows; a request
    with fewer than ``next_n`` new tokens leaves padding rows (window end 0).
    Built by :func:`build_batch`; every parameter is an attribute of the same
    name. Device arrays live on the batch's backend.

    Parameters
    ----------
    next_n : int
        Rows per decode request: 1 + the number of speculative tokens.
    context_lens : int32 array [B] or [B, next_n]
        What :func:`cpsparse.paged_mqa_logits` takes: without padding, the
        total length of each decode request ([B], new tokens included); with
        padding, the window end of every row ([B, next_n], 0 on padding rows).
    block_table : int array [B, max_blocks]
        The decode requests' rows of the batch's block table.
    max_context_len : int
        The longest decode request (context + new tokens): the logits width.
    requires_padding : bool
        Some decode request has fewer than ``next_n`` new tokens, so the
        tokens are scattered to their rows (``token_rows``) and back.
    token_rows : int64 array [num_decode_tokens]
        Row of each decode token in the ``[B * next_n]`` layout.
    token_rows_host : numpy.ndarray
        Host copy of ``token_rows``.
    """
    next_n: int
    context_lens: Any          # int32 [B] (uniform) or [B, next_n] window ends
    block_table: Any           # int32 [B, max_blocks]
    max_context_len: int
    requires_padding: bool
    token_rows: Any            # int64 [num_decode_tokens]: row of each token in [B * next_n]
    token_rows_host: numpy.ndarray


@dataclasses.dataclass
class PrefillChunk:
    """A piece of the prefill whose logits ``[tokens, num_keys]`` fit the budget.

    Keys of the chunk's requests are gathered from the cache in request order
    (``cu_seq_lens``); a long request may be split along its queries, and
    then only the keys up to its last query in the chunk are gathered. Built
    by :func:`build_batch`; every parameter is an attribute of the same name.

    Parameters
    ----------
    token_start, token_end : int
        The chunk's query tokens are batch rows ``[token_start, token_end)``
        (and rows of the top-k buffer).
    num_keys : int
        Keys gathered for the chunk (the logits width).
    cu_seq_lens : int32 array [n + 1]
        Key offsets of the chunk's n requests in the gathered keys (what
        :meth:`cpsparse.IndexerKCache.gather` takes).
    block_table : int array [n, max_blocks]
        The block-table rows of the chunk's requests.
    ks, ke : int32 array [token_end - token_start]
        Window of each query in the gathered keys, ``[ks, ke)`` (what
        :func:`cpsparse.mqa_logits` and :func:`cpsparse.topk_per_row` take).
    cu_seq_lens_host : numpy.ndarray, optional
        Host int64 copy of ``cu_seq_lens``.
    key_req_ids : int32 array [num_keys], optional
        Request (row of this chunk's ``block_table``) of each gathered key.

    Attributes
    ----------
    num_tokens : int
        ``token_end - token_start``.
    logits_bytes : int
        ``4 * num_tokens * num_keys``: the chunk's float32 logits.
    """
    token_start: int
    token_end: int
    num_keys: int
    cu_seq_lens: Any           # int32 [n + 1] key offsets of the gathered requests
    block_table: Any           # int32 [n, max_blocks]
    ks: Any                    # int32 [tokens] window start in the gathered keys
    ke: Any                    # int32 [tokens] window end (exclusive)
    cu_seq_lens_host: Optional[numpy.ndarray] = None   # host int64 copy of cu_seq_lens
    key_req_ids: Any = None    # int32 [num_keys]: the request (row of block_table) of each key

    @property
    def num_tokens(self):
        return self.token_end - self.token_start

    @property
    def logits_bytes(self):
        return 4 * self.num_tokens * self.num_keys


@dataclasses.dataclass
class PrefillMetadata:
    """The indexer's prefill requests, cut into chunks.

    Parameters
    ----------
    chunks : list of PrefillChunk
        In batch order; together they cover every prefill token once.
    """
    chunks: List[PrefillChunk]


@dataclasses.dataclass
class DenseMetadata:
    """The MLA dense route's inputs (prefill requests from ``first_request`` on): every
    key position of each request mapped to its cache slot, and the packed offsets.

    Every parameter is an attribute of the same name; n is the number of those
    requests and ``T_d = cu_seqlens_q[-1]`` their query tokens.

    Parameters
    ----------
    first_request : int
        The first request of the batch that the dense route attends (the MLA's
        ``num_decodes``).
    cu_seqlens_q : numpy.ndarray
        Host int64 [n + 1]: packed offsets of the requests' new tokens.
    cu_seqlens_k : numpy.ndarray
        Host int64 [n + 1]: packed offsets of their keys (context + new tokens).
    slots : int32 array [cu_seqlens_k[-1]]
        Cache slot of every key position 0 .. seq_len - 1 of each request.
    key_start : int32 array [T_d]
        First key row (in the packed keys) of each query's request.
    key_count : int32 array [T_d]
        Keys each query sees (bottom-right causal).
    """
    first_request: int
    cu_seqlens_q: numpy.ndarray        # host int64 [n + 1]
    cu_seqlens_k: numpy.ndarray        # host int64 [n + 1]
    slots: Any                         # int32 [cu_seqlens_k[-1]] on the batch's device
    key_start: Any                     # int32 [T]: first key row of each query (packed)
    key_count: Any                     # int32 [T]: keys each query sees (causal)


@dataclasses.dataclass
class MLAPrefillMetadata:
    """The MLA side's view of the prefill requests.

    Parameters
    ----------
    max_seq_len : int
        The longest full length (context included) of the MLA's prefill requests.
    use_dense_mha : bool
        ``max_seq_len <= index_topk``: every key fits the top-k, so the prefill
        tokens take dense causal MHA and the top-k buffer is not read.
    """
    max_seq_len: int           # longest full length (context included) of a prefill
    use_dense_mha: bool        # max_seq_len <= index_topk: every key fits the top-k


@dataclasses.dataclass
class MLAMetadata:
    """What the MLA attention of a layer needs to route its tokens.

    ``num_decode_tokens`` follows the MLA's own decode threshold, which may
    differ from the indexer's ``next_n``; that is why the indexer's
    short-prefill early return reads this object and not its own split.

    Parameters
    ----------
    decode_threshold : int
        A request is an MLA decode when its query length is at most this
        (``build_batch``'s ``mla_decode_threshold``, default ``next_n``).
    num_decodes : int
        The leading requests that are MLA decodes.
    num_decode_tokens : int
        Their tokens (the first rows of the batch): they always attend sparsely.
    num_prefills : int
        The other requests.
    num_prefill_tokens : int
        Their tokens.
    prefill : MLAPrefillMetadata or None
        None when the batch has no MLA prefill request.

    Attributes
    ----------
    dense_prefill : bool
        The prefill tokens take dense causal MHA (``prefill.use_dense_mha``).
    topk_unused : bool
        ``dense_prefill and num_decode_tokens == 0``: nothing of this batch
        reads the top-k rows, the condition of the short-prefill early return.
    """
    decode_threshold: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    prefill: Optional[MLAPrefillMetadata]

    # The dense-route predicate, one owner: the layer's attention route and the
    # indexer's short-prefill early return both read it from here.
    @property
    def dense_prefill(self):
        """The prefill tokens take dense causal MHA (every key fits the top-k)."""
        return self.prefill is not None and bool(self.prefill.use_dense_mha)

    @property
    def topk_unused(self):
        """Nothing of this batch reads the top-k rows: a dense prefill, no decode token."""
        return self.dense_prefill and self.num_decode_tokens == 0


@dataclasses.dataclass
class BatchMetadata:
    """Everything one forward pass over a packed batch needs (see :func:`build_batch`).

    R is the number of requests, T the number of new tokens (decodes first, in
    batch order). Every parameter is an attribute of the same name; "device"
    arrays live on the batch's backend ``xp``, "host" arrays are NumPy.

    Parameters
    ----------
    xp : module
        ``numpy`` or ``cupy``.
    block_size : int
        Tokens per page; the caches must have the same.
    next_n : int
        1 + the number of speculative tokens (the indexer's decode threshold).
    index_topk : int
        The top-k width; the layer and its buffer must have the same.
    num_reqs : int
        The number of requests, R.
    num_tokens : int
        The number of new tokens, T.
    query_lens : numpy.ndarray
        Host int64 [R]: new tokens of each request.
    context_lens : numpy.ndarray
        Host int64 [R]: tokens already cached.
    seq_lens : numpy.ndarray
        Host int64 [R]: ``context_lens + query_lens``.
    query_start_loc : numpy.ndarray
        Host int64 [R + 1]: packed offsets of the new tokens.
    block_table : int array [R, max_blocks]
        The caller's block table (page ids of each request, in position order).
    block_table_host : numpy.ndarray
        Host copy of ``block_table`` (value checks read it: no device sync).
    slot_mapping : int32 array [T]
        Cache slot of each new token.
    positions : int32 array [T]
        Position of each new token in its request (its RoPE position).
    req_ids : int32 array [T]
        Request (row of ``block_table``) of each new token.
    num_decodes, num_decode_tokens : int
        The indexer's decode requests (query length ``<= next_n``) and their tokens.
    num_prefills, num_prefill_tokens : int
        The indexer's other requests and their tokens.
    decode : DecodeMetadata or None
        None when there is no indexer decode request.
    prefill : PrefillMetadata or None
        None when there is no indexer prefill token.
    mla : MLAMetadata
        The MLA side's split and dense-route decision.
    dense : DenseMetadata or None
        The dense route's inputs, set when ``mla.dense_prefill``.
    checked_num_blocks : set of int
        Cache sizes (``num_blocks``) every page id of the batch was checked
        against (each check runs once per batch).

    Attributes
    ----------
    last_token_rows : numpy.ndarray
        Host int64 [R]: batch row of each request's last new token (what the
        MTP reuse compacts to).
    """
    xp: Any
    block_size: int
    next_n: int
    index_topk: int
    num_reqs: int
    num_tokens: int
    query_lens: numpy.ndarray          # host int64 [R]
    context_lens: numpy.ndarray        # host int64 [R], tokens already cached
    seq_lens: numpy.ndarray            # host int64 [R], context + query
    query_start_loc: numpy.ndarray     # host int64 [R + 1]
    block_table: Any                   # int32 [R, max_blocks]
    block_table_host: numpy.ndarray    # host copy of block_table (value checks, no sync)
    slot_mapping: Any                  # int32 [T]
    positions: Any                     # int32 [T], position of each token in its request
    req_ids: Any                       # int32 [T], request of each token
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    decode: Optional[DecodeMetadata]
    prefill: Optional[PrefillMetadata]
    mla: MLAMetadata
    dense: Optional[DenseMetadata] = None   # set when mla.dense_prefill
    # cache sizes (num_blocks) every page id of the batch was checked against
    checked_num_blocks: set = dataclasses.field(default_factory=set)

    @property
    def last_token_rows(self):
        """host int64 [R]: batch row of each request's last new token."""
        return self.query_start_loc[1:] - 1


def decodes_first_order(query_lens, next_n=1):
    """A stable order of the requests that puts decodes (query_len <= next_n) first.

    Parameters
    ----------
    query_lens : sequence of int [R]
        New tokens of each request.
    next_n : int
        The decode threshold (1 + the number of speculative tokens).

    Returns
    -------
    numpy.ndarray
        int64 [R]: request ids, decodes first, each group in its original order.

    Examples
    --------
    >>> from cpsparse.metadata import decodes_first_order
    >>> decodes_first_order([5, 1, 7, 1], next_n=1)
    array([1, 3, 0, 2])
    """
    q = numpy.asarray(query_lens)
    return numpy.argsort(q > next_n, kind="stable")


def _leading_run(query_lens, threshold):
    """Number of leading requests with query_len <= threshold."""
    big = numpy.flatnonzero(query_lens > threshold)
    return int(big[0]) if big.size else int(query_lens.size)


def _plan_chunks(prefill_reqs, query_lens, context_lens, token_starts, budget):
    """Greedy chunking: list of lists of (request, first query, end query)."""
    chunks: List[List[Any]] = []
    current: List[Any] = []
    cur_tokens, cur_keys = 0, 0
    for r in prefill_reqs:
        qlen, ctx = int(query_lens[r]), int(context_lens[r])
        if 4 * qlen * (ctx + qlen) > budget:
            # One request too large for the budget: split along its queries so
            # that (queries in piece) * (keys up to the piece's last query) fits.
            if current:
                chunks.append(current)
                current, cur_tokens, cur_keys = [], 0, 0
            i0 = 0
            while i0 < qlen:
                i1 = i0 + 1
                while i1 < qlen and 4 * (i1 + 1 - i0) * (ctx + i1 + 1) <= budget:
                    i1 += 1
                chunks.append([(r, i0, i1)])
                i0 = i1
            continue
        tokens, keys = cur_tokens + qlen, cur_keys + ctx + qlen
        if current and 4 * tokens * keys > budget:
            chunks.append(current)
            current, tokens, keys = [], qlen, ctx + qlen
        current.append((r, 0, qlen))
        cur_tokens, cur_keys = tokens, keys
    if current:
        chunks.append(current)
    return chunks


def _lengths(name, values):
    """Host int64 [R] of per-request lengths given as integers (no float, str or bool)."""
    if isinstance(values, (str, bytes)):
        raise TypeError(f"Invalid {name}: expected a sequence of ints, got {values!r}")
    a = to_host(values)
    if a.size == 0:
        return numpy.zeros(0, numpy.int64)
    if a.dtype.kind not in "iu":
        flat = a.reshape(-1)
        bad = next((v for v in flat if isinstance(v, (bool, numpy.bool_))
                    or not isinstance(v, (int, numpy.integer))), flat[0])
        raise TypeError(f"Invalid {name}: expected integers, got {bad!r} "
                        f"({type(bad).__name__})")
    return a.astype(numpy.int64).reshape(-1)


def build_batch(query_lens, context_lens, block_table, *, next_n=1, block_size=64,
                index_topk=2048, mla_decode_threshold=None,
                logits_budget_bytes=DEFAULT_LOGITS_BUDGET_BYTES, num_blocks=None, xp=None):
    """Build the metadata of one forward pass from per-request lengths.

    Parameters
    ----------
    query_lens : sequence of int [R]
        New tokens of each request in this step.
    context_lens : sequence of int [R]
        Tokens of each request already in the caches (before this step).
    block_table : int32 array [R, max_blocks]
        Page ids of each request; NumPy or CuPy (sets the backend).
    next_n : int
        1 + the number of speculative tokens: a request is an indexer decode
        when ``query_len <= next_n``. Decodes must come first in the batch
        (:func:`decodes_first_order` gives such an order).
    block_size : int
        Tokens per page of both caches.
    index_topk : int
        The top-k width; ``prefill.use_dense_mha = max_seq_len <= index_topk``.
    mla_decode_threshold : int, optional
        The MLA side's own decode threshold (default ``next_n``).
    logits_budget_bytes : int
        Upper bound of one prefill chunk's float32 logits (default 512 MiB).
    num_blocks : int, optional
        Pages of the caches this batch will address: every page id a request uses
        must be below it (checked here; the layer and ``sparse_attn_indexer`` check
        again against their own caches). Page ids must always be >= 0 and keep
        their slots within int32.
    xp : module, optional
        Backend of the arrays built here (default: that of ``block_table``).

    Returns
    -------
    BatchMetadata

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.metadata import build_batch
    >>> table = np.arange(6, dtype=np.int32).reshape(2, 3)
    >>> meta = build_batch([1, 5], [70, 0], table, next_n=1, index_topk=4)
    >>> meta.num_decode_tokens, meta.num_prefill_tokens, meta.mla.prefill.use_dense_mha
    (1, 5, False)
    >>> meta.slot_mapping          # decode token at position 70 -> page 1, offset 6
    array([ 70, 192, 193, 194, 195, 196], dtype=int32)
    >>> chunk = meta.prefill.chunks[0]
    >>> chunk.ks, chunk.ke         # causal windows in the gathered keys
    (array([0, 0, 0, 0, 0], dtype=int32), array([1, 2, 3, 4, 5], dtype=int32))
    """
    if xp is None:
        xp = _backend.get_array_module(block_table=block_table)
    V.check_index("block_table", block_table, ndim=2, shape_desc="[R, max_blocks]")
    table_h = to_host(block_table)
    q = _lengths("query_lens", query_lens)
    ctx = _lengths("context_lens", context_lens)
    if q.shape != ctx.shape or q.shape[0] != table_h.shape[0]:
        raise ValueError(f"Invalid lengths: expected query_lens, context_lens and block_table "
                         f"rows to agree on R, got {q.shape[0]}, {ctx.shape[0]} and "
                         f"{table_h.shape[0]}")
    if (q < 0).any() or (ctx < 0).any():
        raise ValueError("Invalid lengths: expected query_lens and context_lens >= 0")
    next_n = V.check_positive_int("next_n", next_n)
    block_size = V.check_positive_int("block_size", block_size)
    index_topk = V.check_positive_int("index_topk", index_topk)
    budget = V.check_positive_int("logits_budget_bytes", logits_budget_bytes)
    mla_threshold = next_n if mla_decode_threshold is None else V.check_positive_int(
        "mla_decode_threshold", mla_decode_threshold)
    num_decodes = _leading_run(q, next_n)
    late = numpy.flatnonzero(q[num_decodes:] <= next_n)
    if late.size:
        r = num_decodes + int(late[0])
        raise ValueError(f"Invalid batch order: request {r} is a decode (query_len "
                         f"{int(q[r])} <= next_n={next_n}) after the prefill request "
                         f"{num_decodes}; decodes must come first (see decodes_first_order)")
    if num_blocks is not None:
        num_blocks = V.check_nonnegative_int("num_blocks", num_blocks)
    seq = ctx + q
    V.check_block_table(numpy, seq, table_h, block_size, num_blocks)

    cu = numpy.concatenate([[0], numpy.cumsum(q)]).astype(numpy.int64)
    total = int(cu[-1])
    req_ids, new_pos = paging.expand(q)
    positions = new_pos + ctx[req_ids]
    slots = paging.page_slots(table_h, req_ids, positions, block_size)
    dev = (lambda a: xp.asarray(a)) if xp is not numpy else (lambda a: a)
    i32 = numpy.int32

    decode = None
    num_decode_tokens = int(cu[num_decodes])
    if num_decodes:
        dq, dseq = q[:num_decodes], seq[:num_decodes]
        padded = bool((dq != next_n).any())
        j = numpy.arange(next_n)[None, :]
        if padded:
            ends = numpy.where(j < dq[:, None], dseq[:, None] - dq[:, None] + j + 1, 0)
            lens = ends.astype(i32)
        else:
            lens = dseq.astype(i32)
        rows = (req_ids[:num_decode_tokens] * next_n
                + numpy.arange(num_decode_tokens) - cu[req_ids[:num_decode_tokens]])
        decode = DecodeMetadata(next_n=next_n, context_lens=dev(lens),
                                block_table=dev(numpy.ascontiguousarray(table_h[:num_decodes])),
                                max_context_len=int(dseq.max()), requires_padding=padded,
                                token_rows=dev(rows.astype(numpy.int64)), token_rows_host=rows)

    prefill = None
    prefill_reqs = [r for r in range(num_decodes, q.size) if q[r] > 0]
    if prefill_reqs:
        chunks = []
        for plan in _plan_chunks(prefill_reqs, q, ctx, cu, budget):
            keys = [int(ctx[r]) + i1 for r, _, i1 in plan]
            key_off = numpy.concatenate([[0], numpy.cumsum(keys)])
            ks = numpy.concatenate([numpy.full(i1 - i0, key_off[n]) for n, (r, i0, i1)
                                    in enumerate(plan)])
            ke = numpy.concatenate([key_off[n] + paging.causal_ends(q[r], ctx[r] + q[r],
                                                                    numpy.arange(i0, i1))
                                    for n, (r, i0, i1) in enumerate(plan)])
            reqs = [r for r, _, _ in plan]
            first, last = plan[0], plan[-1]
            chunks.append(PrefillChunk(
                token_start=int(cu[first[0]] + first[1]), token_end=int(cu[last[0]] + last[2]),
                num_keys=int(key_off[-1]), cu_seq_lens=dev(key_off.astype(i32)),
                block_table=dev(numpy.ascontiguousarray(table_h[reqs])),
                ks=dev(ks.astype(i32)), ke=dev(ke.astype(i32)),
                cu_seq_lens_host=key_off.astype(numpy.int64),
                key_req_ids=dev(paging.expand(keys)[0].astype(i32))))
        prefill = PrefillMetadata(chunks=chunks)

    mla_decodes = _leading_run(q, mla_threshold)
    mla_decode_tokens = int(cu[mla_decodes])
    mla_prefill = None
    if mla_decodes < q.size:
        max_seq = int(seq[mla_decodes:].max())
        mla_prefill = MLAPrefillMetadata(max_seq_len=max_seq, use_dense_mha=max_seq <= index_topk)
    mla = MLAMetadata(decode_threshold=mla_threshold, num_decodes=mla_decodes,
                      num_decode_tokens=mla_decode_tokens, num_prefills=q.size - mla_decodes,
                      num_prefill_tokens=total - mla_decode_tokens, prefill=mla_prefill)
    # The dense route's inputs are built here, so the layer uploads nothing.
    dense = _dense_metadata(xp, q, seq, table_h, mla_decodes, block_size) \
        if mla.dense_prefill else None

    return BatchMetadata(
        xp=xp, block_size=block_size, next_n=next_n, index_topk=index_topk,
        num_reqs=int(q.size), num_tokens=total, query_lens=q, context_lens=ctx, seq_lens=seq,
        query_start_loc=cu, block_table=block_table,
        block_table_host=numpy.ascontiguousarray(table_h),
        checked_num_blocks=set() if num_blocks is None else {num_blocks},
        slot_mapping=dev(slots.astype(i32)),
        positions=dev(positions.astype(i32)), req_ids=dev(req_ids.astype(i32)),
        num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
        num_prefills=int(q.size) - num_decodes, num_prefill_tokens=total - num_decode_tokens,
        decode=decode, prefill=prefill, mla=mla, dense=dense)


def _dense_metadata(xp, query_lens, seq_lens, table_h, first_request, block_size):
    """Every position 0..seq-1 of each request from ``first_request`` on, mapped to its
    slot, and the packed offsets: what the MLA dense route gathers and attends."""
    dseq, dq = seq_lens[first_request:], query_lens[first_request:]
    dreq, dpos = paging.expand(dseq)
    cu_q = numpy.concatenate([[0], numpy.cumsum(dq)]).astype(numpy.int64)
    cu_k = numpy.concatenate([[0], numpy.cumsum(dseq)]).astype(numpy.int64)
    slots = paging.page_slots(table_h, dreq + first_request, dpos, block_size)
    start, visible = paging.causal_key_ranges(cu_q, cu_k)
    dev = (lambda a: xp.asarray(a)) if xp is not numpy else (lambda a: a)
    return DenseMetadata(first_request=first_request, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         slots=dev(slots), key_start=dev(start), key_count=dev(visible))


def dense_metadata(batch, first_request):
    """The batch's :class:`DenseMetadata` from ``first_request`` on (built by
    build_batch for its own MLA split; built here for another one)."""
    if batch.dense is not None and batch.dense.first_request == first_request:
        return batch.dense
    return _dense_metadata(batch.xp, batch.query_lens, batch.seq_lens, batch.block_table_host,
                           first_request, batch.block_size)


def check_batch(batch, *, block_size, index_topk=None, num_blocks=None, xp=None,
                owner="the caches"):
    """Refuse a batch built for other caches or another layer (before any state changes).

    ``block_size`` and ``index_topk`` must be the ones the batch was built with,
    and every page id a request uses must exist in caches of ``num_blocks`` pages
    (read from the batch's host copy of its block table: no device sync).
    """
    if not isinstance(batch, BatchMetadata):
        raise TypeError(f"Invalid metadata: expected BatchMetadata (see build_batch), got "
                        f"{type(batch).__qualname__}")
    if batch.block_size != block_size:
        raise ValueError(f"Invalid metadata: built with block_size={batch.block_size}, but "
                         f"{owner} have block_size={block_size}")
    if index_topk is not None and batch.index_topk != index_topk:
        raise ValueError(f"Invalid metadata: built with index_topk={batch.index_topk}, but "
                         f"{owner} use index_topk={index_topk}")
    if xp is not None and batch.xp is not xp:
        raise TypeError(f"Invalid metadata: its arrays are {batch.xp.__name__} arrays, but "
                        f"{owner} are {xp.__name__} arrays")
    if num_blocks is not None and num_blocks not in batch.checked_num_blocks:
        V.check_block_table(numpy, batch.seq_lens, batch.block_table_host, block_size,
                            num_blocks, name="metadata.block_table", what=f" ({owner})")
        batch.checked_num_blocks.add(num_blocks)       # once per batch, not per layer


# ---- forward context ---------------------------------------------------------

@dataclasses.dataclass
class ForwardContext:
    """Per-forward state shared by all layers: the batch and MLA metadata by layer name.

    Parameters
    ----------
    batch : BatchMetadata
        The forward pass's batch.
    attn_metadata : dict of str to MLAMetadata
        MLA metadata by layer name (vLLM's ``forward_context.attn_metadata``);
        a layer's ``_dense_mha_metadata_layer_name`` must be a key.
        :meth:`for_layers` maps every given name to ``batch.mla``.

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.metadata import ForwardContext, build_batch
    >>> meta = build_batch([3], [0], np.zeros((1, 1), np.int32), index_topk=8)
    >>> ctx = ForwardContext.for_layers(meta, ["layers.0.attn", "layers.1.attn"])
    >>> ctx.attn_metadata["layers.1.attn"].prefill.use_dense_mha
    True
    """
    batch: BatchMetadata
    attn_metadata: Dict[str, MLAMetadata] = dataclasses.field(default_factory=dict)

    @classmethod
    def for_layers(cls, batch, layer_names):
        return cls(batch=batch, attn_metadata={name: batch.mla for name in layer_names})


_CURRENT = threading.local()


@contextlib.contextmanager
def set_forward_context(context):
    """Make ``context`` the current forward context of this thread (nests).

    Parameters
    ----------
    context : ForwardContext
        What :func:`get_forward_context` returns inside the ``with`` block.

    Yields
    ------
    ForwardContext
        ``context``; the previous one is restored on exit.
    """
    previous = getattr(_CURRENT, "context", None)
    _CURRENT.context = context
    try:
        yield context
    finally:
        _CURRENT.context = previous


def get_forward_context():
    """The current :class:`ForwardContext`; RuntimeError outside ``set_forward_context``.

    Returns
    -------
    ForwardContext
        The innermost context set by :func:`set_forward_context` on this thread.
    """
    context = getattr(_CURRENT, "context", None)
    if context is None:
        raise RuntimeError("no forward context is set: run the layer inside "
                           "`with cpsparse.metadata.set_forward_context(ctx):` or pass "
                           "forward_context=")
    return context
