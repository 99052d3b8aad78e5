"""The lightning indexer: FP8 scoring of every earlier key, and per-row top-k.

Public ops validate their arguments (one message style, before any launch),
then dispatch on the array type: NumPy arrays run the reference
(:mod:`cpsparse.reference.indexer`); CuPy arrays stay on the device.

The formula (``docs/contract.md``, "Indexer logits"), for query token t and key s
in its window::

    I[t, s] = s_k[s] * sum_h W[t, h] * relu(sum_d q8[t, h, d] * k8[s, d])

with ``W`` the head weights with the query scale folded in
(:func:`fold_weights`). Entries outside the window are ``-inf``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy

from cpsparse import _backend
from cpsparse import _validation as V
from cpsparse import attention as _attention
from cpsparse import paging
from cpsparse.cache import IndexerKCache
from cpsparse.raw_kernels import indexer as _kindexer
from cpsparse.raw_kernels import topk as _ktopk
from cpsparse.reference import indexer as _ref

if TYPE_CHECKING:
    from cpsparse._typing import Array, IntLike

__all__ = ["mqa_logits", "paged_mqa_logits", "topk_per_row", "topk_per_row_decode",
           "fold_weights", "hadamard_rotate", "decode_row_ends"]


def __getattr__(name: str) -> Any:
    # The layer orchestration lives in cpsparse.sparse_attn_indexer (vLLM's name);
    # its two names stay reachable from here.
    if name in ("sparse_attn_indexer", "IndexerStats"):
        from cpsparse import sparse_attn_indexer as _sai
        return getattr(_sai, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- cores: validated arguments in, the kernel or the reference out ------------------
# The public ops below validate, then call these; the layer path (sparse_attn_indexer)
# validates a whole batch once and calls them directly.

def mqa_logits_core(xp, q_codes, k_codes, k_scales, weights, ks, ke):
    if _backend.use_kernels(xp) and k_scales.dtype == xp.uint8:
        _backend.warn_fallback("mqa_logits", tuple(q_codes.shape) + ("mxfp4",),
                               "MXFP4 keys")
    elif _backend.use_kernels(xp):
        if _kindexer.supports_prefill(q_codes, k_codes):
            return _kindexer.mqa_logits(xp, q_codes, k_codes, k_scales, weights, ks, ke)
        _backend.warn_fallback("mqa_logits", tuple(q_codes.shape),
                               "this head count / head_dim / alignment")
    return _ref.mqa_logits(q_codes, k_codes, k_scales, weights, ks, ke)


def paged_mqa_logits_core(xp, q_codes, cache, weights, context_lens, block_table,
                          max_context_len, clean_logits=True):
    if _backend.use_kernels(xp):
        batch, next_n, heads, dim = q_codes.shape
        planned = _kindexer.paged_plan(batch, next_n, heads, dim, max_context_len,
                                       cache.block_size, fp4=cache.dtype == "mxfp4")
        if _kindexer.supports_paged(q_codes, cache.data, planned[1]):
            return _kindexer.paged_mqa_logits(xp, q_codes, cache, weights, context_lens,
                                              block_table, max_context_len, plan=planned,
                                              clean_logits=clean_logits)
        _backend.warn_fallback("paged_mqa_logits",
                               tuple(q_codes.shape) + (cache.block_size, cache.dtype),
                               "this head count / head_dim / page size / alignment / key "
                               "format (MXFP4: Hopper, pages of >= 64 keys)")
    return _ref.paged_mqa_logits(q_codes, cache.data, cache.block_size, weights, context_lens,
                                 block_table, max_context_len, cache.dtype)


def topk_per_row_core(xp, logits, row_starts, row_ends, k, out):
    if _backend.use_kernels(xp):
        return _ktopk.topk_per_row(xp, logits, row_starts, row_ends, k, out)
    return _ref.topk_per_row(logits, row_starts, row_ends, k, out=out)


def topk_per_row_decode_core(xp, logits, context_lens, next_n, k, out, block_table=None,
                             block_size=0):
    if block_table is not None and _backend.use_kernels(xp) \
            and _ktopk.supports_slots(block_size):
        return _ktopk.topk_per_row_decode(xp, logits, context_lens, next_n, k, out,
                                          block_table=block_table, block_size=block_size)
    if _backend.use_kernels(xp):
        rows = _ktopk.topk_per_row_decode(xp, logits, context_lens, next_n, k, out)
    else:
        rows = _ref.topk_per_row_decode(logits, context_lens, next_n, k, out=out)
    if block_table is None:
        return rows
    req_ids = xp.arange(rows.shape[0], dtype=xp.int32) // next_n
    slots = _attention.local_to_global_slots_core(xp, rows, req_ids, block_table, block_size)
    if out is None:
        return slots
    out[...] = slots
    return out


def fold_weights(weights: Array, q_scales: Array, head_dim: IntLike = 128) -> Array:
    """Fold the per-(token, head) query scale into the indexer head weights.

    ``W[t, h] = weights[t, h] * q_scales[t, h] * head_dim**-0.5 * H**-0.5``.

    Parameters
    ----------
    weights : float32 [T, H]
        Output of the indexer's ``weights_proj``.
    q_scales : float32 [T, H] or [T, H, 1]
        Query scales from :func:`cpsparse.quantize_fp8` with
        ``block_size=head_dim``.
    head_dim : int

    Returns
    -------
    float32 [T, H]

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.indexer import fold_weights
    >>> fold_weights(np.ones((1, 4), np.float32), np.full((1, 4), 2, np.float32), 16)
    array([[0.25, 0.25, 0.25, 0.25]], dtype=float32)
    """
    _backend.get_array_module(weights=weights, q_scales=q_scales)
    V.check_positive_int("head_dim", head_dim)
    V.check_array("weights", weights, ndim=2, dtype="float32", shape_desc="[T, H]")
    if q_scales is None or tuple(getattr(q_scales, "shape", ())) not in (
            weights.shape, weights.shape + (1,)):
        V.check_array("q_scales", q_scales, shape=weights.shape, shape_desc="[T, H] or [T, H, 1]")
    V.check_array("q_scales", q_scales, dtype="float32", contiguous=False)
    return _ref.fold_weights(weights, q_scales, head_dim)


def hadamard_rotate(x: Array) -> Array:
    """Rotate the last axis by the normalised Hadamard matrix: ``x @ H_n / sqrt(n)``.

    DeepSeek-V3.2's indexer applies this to q and k (n = 128) before FP8
    quantization, which spreads outliers across the group. ``H_n`` is the
    Sylvester-ordered matrix of :func:`scipy.linalg.hadamard`; the rotation is
    orthogonal and its own inverse.

    Parameters
    ----------
    x : float [..., n], n a power of two

    Returns
    -------
    float32 [..., n]

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.indexer import hadamard_rotate
    >>> hadamard_rotate(np.array([1.0, 0.0, 0.0, 0.0], np.float32))
    array([0.5, 0.5, 0.5, 0.5], dtype=float32)
    """
    _backend.get_array_module(x=x)
    V.check_array("x", x, dtype=V.FLOAT_DTYPES, contiguous=False)
    n = x.shape[-1] if x.ndim else 0
    if n < 1 or n & (n - 1):
        raise ValueError(f"Invalid last dimension of x: expected a power of two, got {n}")
    return _ref.hadamard_rotate(x)


def _check_heads(q_codes, weights, rows):
    heads = q_codes.shape[-2]
    if heads < 1:            # the logits sum over heads: none is a caller's slip, not 0
        raise ValueError(f"Invalid shape of q_codes: expected at least one head (H >= 1), "
                         f"got {tuple(q_codes.shape)}")
    V.check_array("weights", weights, ndim=2, dtype="float32", shape=(rows, heads),
                  shape_desc=f"[{'M' if q_codes.ndim == 3 else 'B * next_n'}, H]")


def mqa_logits(q_codes: Array, k_codes: Array, k_scales: Array, weights: Array, ks: Array,
               ke: Array) -> Array:
    """Prefill indexer logits over a contiguous key array (ragged causal windows).

    Parameters
    ----------
    q_codes : uint8 [M, H, D]
        e4m3 codes of the queries (one scale per (token, head), folded into
        ``weights``); on NumPy also ``ml_dtypes.float8_e4m3fn``.
    k_codes : uint8 [N, D], or [N, D / 2] for MXFP4 keys
        e4m3 codes of the keys, e.g. from :meth:`cpsparse.IndexerKCache.gather`;
        MXFP4 keys: packed e2m1 codes (what an ``IndexerKCache(dtype="mxfp4")``
        gathers; the queries stay FP8).
    k_scales : float32 [N] or [N, 1], or uint8 [N, D / 32] for MXFP4 keys
        ``[N, 1]`` is what :func:`cpsparse.quantize_fp8` returns; uint8 scales are
        the MXFP4 keys' ue8m0 bytes (one per 32 values) and make ``k_codes`` MXFP4.
    weights : float32 [M, H]
        Head weights with the query scales folded in (:func:`fold_weights`).
    ks, ke : int32 or int64 [M]
        Window of each query, ``[ks, ke)`` in key rows. For query i of request
        r with context length ctx: ``ks = cu[r]``, ``ke = cu[r] + ctx + i + 1``.
        With value checks off, a window reaching outside ``[0, N)`` is clamped
        to it.

    Returns
    -------
    float32 [M, N]
        ``-inf`` outside each row's window.

    Examples
    --------
    >>> import numpy as np, cpsparse
    >>> from cpsparse.indexer import mqa_logits
    >>> rng = np.random.default_rng(0)
    >>> q8, qs = cpsparse.quantize_fp8(rng.standard_normal((3, 8, 128)).astype(np.float32),
    ...                                eps=1e-10)
    >>> k8, ksc = cpsparse.quantize_fp8(rng.standard_normal((3, 128)).astype(np.float32))
    >>> w = np.ones((3, 8), np.float32) * qs[..., 0]
    >>> logits = mqa_logits(q8, k8, ksc[:, 0], w, np.zeros(3, np.int32),
    ...                     np.arange(1, 4, dtype=np.int32))
    >>> np.isinf(logits)        # causal: query i sees keys 0..i
    array([[False,  True,  True],
           [False, False,  True],
           [False, False, False]])
    """
    key = V.layouts(q_codes, k_codes, k_scales, weights, ks, ke)
    hit = _MQA_CALLS.get(key)
    if hit is not None:                    # the same layouts passed the checks below
        run = V.memo_launch(*hit)
        if run is not None:
            logits = run(q_codes, k_codes, k_scales, weights, ks, ke)
            if logits is not None:
                return logits
    xp = _backend.get_array_module(q_codes=q_codes, k_codes=k_codes, k_scales=k_scales,
                                   weights=weights, ks=ks, ke=ke)
    q_codes = V.check_codes("q_codes", q_codes, ndim=3, shape_desc="[M, H, D]")
    m, heads, dim = q_codes.shape
    if getattr(k_scales, "dtype", None) == numpy.uint8:        # MXFP4 keys
        if dim % 32:
            raise ValueError(f"Invalid shape of q_codes: MXFP4 keys need D a multiple of "
                             f"32, got {tuple(q_codes.shape)}")
        V.check_array("k_codes", k_codes, ndim=2, dtype="uint8", shape=(None, dim // 2),
                      shape_desc="[N, D / 2] (packed e2m1)")
        V.check_array("k_scales", k_scales, ndim=2, shape=(k_codes.shape[0], dim // 32),
                      shape_desc="[N, D / 32] (ue8m0 bytes)")
        n = k_codes.shape[0]
    else:
        k_codes = V.check_codes("k_codes", k_codes, ndim=2, shape=(None, dim),
                                shape_desc="[N, D]")
        n = k_codes.shape[0]
        k_scales = V.squeeze_axis("k_scales", k_scales, 1, 2)     # quantize_fp8's [N, 1]
        V.check_array("k_scales", k_scales, dtype="float32", shape=(n,),
                      shape_desc="[N] or [N, 1]")
    _check_heads(q_codes, weights, m)
    V.check_index("ks", ks, shape=(m,), shape_desc="[M]")
    V.check_index("ke", ke, shape=(m,), shape_desc="[M]")
    V.check_windows(xp, ks, ke, n)
    if hit is None:
        # The prefill kernel's launch, prepared once, after every check: a hit with value
        # checks off is that launch (the structural checks above are the layouts'; the
        # kernel clamps windows).
        launch = _kindexer.prefill_call_launch(xp, q_codes, k_codes, k_scales, ks, ke) \
            if _backend.use_kernels(xp) else None
        _MQA_CALLS.put(key, (xp, launch))
    return mqa_logits_core(xp, q_codes, k_codes, k_scales, weights, ks, ke)


_MQA_CALLS = V.CallMemo("mqa_logits")


def _cache_of(cache: Any, dim: int) -> IndexerKCache:
    if isinstance(cache, IndexerKCache):
        if cache.head_dim != dim:
            raise ValueError(f"Invalid cache: expected head_dim={dim} (the last dimension of "
                             f"q_codes), got an IndexerKCache with head_dim={cache.head_dim}")
        return cache
    if not hasattr(cache, "dtype"):
        raise TypeError(f"Invalid type of cache: expected IndexerKCache or a uint8 "
                        f"[num_blocks, block_size * (D + 4)] array, got "
                        f"{type(cache).__qualname__}")
    V.check_array("cache", cache, dtype="uint8")
    cache = V.squeeze_axis("cache", cache, 2, 4)     # DeepGEMM's [num_blocks, bs, 1, D + 4]
    if cache.ndim == 3:       # the [num_blocks, block_size, D + 4] container view
        return IndexerKCache.wrap(cache, block_size=cache.shape[1], head_dim=dim, name="cache")
    V.check_array("cache", cache, ndim=2, shape_desc="[num_blocks, block_size * (D + 4)]")
    page = cache.shape[1]
    if page % (dim + 4) or page == 0:
        raise ValueError(f"Invalid shape of cache: expected [num_blocks, block_size * "
                         f"(D + 4)] with D={dim}, got {tuple(cache.shape)}")
    return IndexerKCache.wrap(cache, block_size=page // (dim + 4), head_dim=dim, name="cache")


def _check_decode_lens(context_lens, batch, next_n):
    if getattr(context_lens, "ndim", None) == 2:
        V.check_index("context_lens", context_lens, shape=(batch, next_n),
                      shape_desc="[B] or [B, next_n]")
    else:
        V.check_index("context_lens", context_lens, shape=(batch,),
                      shape_desc="[B] or [B, next_n]")


def paged_mqa_logits(q_codes: Array, cache: IndexerKCache | Array, weights: Array,
                     context_lens: Array, block_table: Array,
                     max_context_len: IntLike, *, clean_logits: bool = True) -> Array:
    """Decode indexer logits straight from the paged key cache.

    Parameters
    ----------
    q_codes : uint8 [B, next_n, H, D]
        ``next_n = 1 +`` the number of speculative tokens.
    cache : IndexerKCache or uint8 array
        ``[num_blocks, block_size * (D + 4)]`` (vLLM), or the same bytes viewed
        ``[num_blocks, block_size, D + 4]`` or ``[num_blocks, block_size, 1, D + 4]``
        (DeepGEMM).
    weights : float32 [B * next_n, H]
    context_lens : int32 or int64 [B] or [B, next_n]
        1-D: total length L_b including the new tokens; row (b, j) sees
        positions ``< L_b - next_n + j + 1``. 2-D: row (b, j) sees positions
        ``< context_lens[b, j]``.
    block_table : int32 or int64 [B, max_blocks]
        With value checks off, a page id outside ``[0, num_blocks)`` (or a
        position past the table) is never read: its keys score ``-inf``.
    max_context_len : int
        Width of the output (>= every context length).
    clean_logits : bool, optional
        True (default): ``-inf`` at every position a row does not see. False (as
        DeepGEMM's ``clean_logits=False``): positions past a row's window end may be
        left unwritten, their values unspecified. For a top-k that reads only the rows'
        windows (:func:`topk_per_row_decode` does; the indexer's decode step passes
        False) it saves writing them, most on batches of mixed lengths. Inside a row's
        window the logits are the same either way (``-inf`` for a missing page
        included). The NumPy reference writes ``-inf`` either way.

    Returns
    -------
    float32 [B * next_n, max_context_len]
        ``-inf`` at positions a row does not see (``clean_logits=False``: unspecified
        past its window end).

    Notes
    -----
    No schedule argument: where the warp-specialized decode kernels run (Hopper,
    57-64 heads, pages of 64 keys, next_n 1 or 2), each CTA reads the context lengths
    on the device and takes an equal share of the batch's work. A batch of mixed
    lengths is balanced by its actual lengths, and a captured CUDA graph stays right
    when they change (DeepGEMM asks for ``get_paged_mqa_logits_metadata`` once per
    batch instead).

    Examples
    --------
    >>> import numpy as np, cpsparse
    >>> from cpsparse.indexer import paged_mqa_logits
    >>> rng = np.random.default_rng(0)
    >>> cache = cpsparse.IndexerKCache(num_blocks=2, block_size=64, head_dim=128)
    >>> cache.insert(rng.standard_normal((70, 128)).astype(np.float32),
    ...              np.arange(70, dtype=np.int32))
    >>> q8, qs = cpsparse.quantize_fp8(rng.standard_normal((1, 2, 8, 128)).astype(np.float32),
    ...                                eps=1e-10)
    >>> w = np.ones((2, 8), np.float32)
    >>> logits = paged_mqa_logits(q8, cache, w, np.array([70], np.int32),
    ...                           np.array([[0, 1]], np.int32), max_context_len=72)
    >>> np.isfinite(logits).sum(axis=1)     # next_n=2: rows see 69 and 70 keys
    array([69, 70])
    """
    if isinstance(cache, IndexerKCache):
        data, wrapped = cache.data, (cache.block_size, cache.head_dim, cache.dtype)
    else:
        data, wrapped = cache, None
    if type(clean_logits) is not bool:        # (numpy.bool_ too; before the memo's key)
        clean_logits = V.check_bool("clean_logits", clean_logits)
    key = V.layouts(q_codes, weights, context_lens, block_table, data)
    if key is not None:
        key += (type(max_context_len), max_context_len, wrapped, clean_logits)
    hit = _PAGED_CALLS.get(key)
    if hit is None:
        xp = _backend.get_array_module(q_codes=q_codes, weights=weights,
                                       context_lens=context_lens, block_table=block_table,
                                       cache=data)
        q_codes = V.check_codes("q_codes", q_codes, ndim=4, shape_desc="[B, next_n, H, D]")
        batch, next_n, heads, dim = q_codes.shape
        kcache = _cache_of(cache, dim)
        _check_heads(q_codes, weights, batch * next_n)
        _check_decode_lens(context_lens, batch, next_n)
        V.check_index("block_table", block_table, ndim=2, shape=(batch, None),
                      shape_desc="[B, max_blocks]")
        max_context_len = V.check_nonnegative_int("max_context_len", max_context_len)
        launch = _kindexer.call_launch(xp, q_codes, kcache, context_lens, block_table,
                                       max_context_len, clean_logits) \
            if _backend.use_kernels(xp) else None
        _PAGED_CALLS.put(key, (xp, kcache.block_size, launch))
    else:                                  # the same layouts passed the checks above
        xp, block_size, launch = hit
        run = V.memo_launch(xp, launch)
        if run is not None:
            logits = run(q_codes, data, weights, context_lens, block_table)
            if logits is not None:
                return logits
        q_codes = V.as_codes(q_codes)
        kcache = cache if isinstance(cache, IndexerKCache) else \
            IndexerKCache.trusted_view(data, block_size, q_codes.shape[3], xp)
    V.check_context_lens(xp, context_lens, block_table, kcache.block_size, max_context_len,
                         kcache.num_blocks)
    return paged_mqa_logits_core(xp, q_codes, kcache, weights, context_lens, block_table,
                                 max_context_len, clean_logits)


_PAGED_CALLS = V.CallMemo("paged_mqa_logits")


def _check_out(xp, out, rows, k):
    """The caller's ``out`` once checked (get_array_module has already refused an
    ``out`` on the other backend; None is allocated by the core)."""
    V.check_array("out", out, ndim=2, dtype="int32", shape=(rows, k), shape_desc="[M, k]")
    return out


def topk_per_row(logits: Array, row_starts: Array, row_ends: Array, k: IntLike,
                 out: Array | None = None) -> Array:
    """Indices of the k largest logits of each row's window ``[row_start, row_end)``.

    Parameters
    ----------
    logits : float32 [M, N]
    row_starts, row_ends : int32 [M]
        Window of each row (end exclusive), ``0 <= start <= end <= N``.
    k : int
        ``index_topk`` (2048 in DeepSeek-V3.2; 512 and 1024 work too).
    out : int32 [M, k], optional
        Where to write (e.g. rows of the shared ``topk_indices_buffer``).

    Returns
    -------
    int32 [M, k]
        Positions relative to ``row_start``. A row no longer than k gets
        ``0 .. len-1`` ascending then -1 (no values used; decode rows' kernel reads
        their first units before it knows a row is short, never past the row's
        width). A longer row gets
        exactly k positions holding its k largest values, ties to the lower
        position; NumPy inputs get them largest first, the CUDA kernel in no
        particular order (and any choice among exact ties at the k-th value).
        NaN ranks below every number, ``-inf`` included, so it is chosen only
        when nothing else is left. See :doc:`the contract </contract>`, "Top-k".

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.indexer import topk_per_row
    >>> logits = np.array([[0.1, 0.9, 0.5, 0.7],
    ...                    [3.0, 1.0, 2.0, 0.0]], np.float32)
    >>> topk_per_row(logits, np.array([0, 1], np.int32), np.array([4, 2], np.int32), k=2)
    array([[ 1,  3],
           [ 0, -1]], dtype=int32)

    Row 1's window ``[1, 2)`` is no longer than k, so it takes the shortcut.
    """
    key = V.layouts(logits, row_starts, row_ends, out)
    if key is not None:
        key += (type(k), k)
    hit = _TOPK_CALLS.get(key)
    if hit is None:
        xp = _backend.get_array_module(logits=logits, row_starts=row_starts,
                                       row_ends=row_ends, out=out)
        k = V.check_positive_int("k", k)
        V.check_array("logits", logits, ndim=2, dtype="float32", shape_desc="[M, N]")
        m = logits.shape[0]
        V.check_index("row_starts", row_starts, shape=(m,), shape_desc="[M]")
        V.check_index("row_ends", row_ends, shape=(m,), shape_desc="[M]")
        if out is not None:
            _check_out(xp, out, m, k)
        launch = _ktopk.call_launch(xp, logits, k, _ktopk.MODE_ROWS, 1,
                                    (row_starts, row_ends)) if _backend.use_kernels(xp) else None
        hit = _TOPK_CALLS.put(key, (xp, k, launch))
    xp, k, launch = hit
    run = V.memo_launch(xp, launch)
    if run is not None:
        return run(logits, row_starts, row_ends, row_starts, out, None)
    V.check_windows(xp, row_starts, row_ends, logits.shape[1], ks_name="row_starts",
                    ke_name="row_ends")
    return topk_per_row_core(xp, logits, row_starts, row_ends, k, out)


_TOPK_CALLS = V.CallMemo("topk_per_row")


def decode_row_ends(context_lens: Array, next_n: IntLike) -> Array:
    """int64 [B * next_n]: where each decode row's window ends (see paged_mqa_logits).

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.indexer import decode_row_ends
    >>> decode_row_ends(np.array([5, 1]), next_n=2)      # request 1 has one key
    array([4, 5, 0, 1])
    """
    return paging.decode_row_ends(context_lens, next_n)


def topk_per_row_decode(logits: Array, context_lens: Array, next_n: IntLike, k: IntLike,
                        out: Array | None = None, *, block_table: Array | None = None,
                        block_size: IntLike = 64) -> Array:
    """Top-k of decode rows: row (b, j) covers positions ``[0, end)`` as in
    :func:`paged_mqa_logits`; with ``block_table``, their global cache slots.

    Parameters
    ----------
    logits : float32 [B * next_n, W]
    context_lens : int32 or int64 [B] or [B, next_n]
    next_n : int
    k : int
    out : int32 [B * next_n, k], optional
    block_table : int32 or int64 [B, max_blocks], optional
        The paged cache's table (the one :func:`paged_mqa_logits` read). Given,
        each chosen position ``pos`` of request b is written as its slot
        ``block_table[b, pos // block_size] * block_size + pos % block_size``,
        exactly what :func:`cpsparse.local_to_global_slots` would map it to, in
        the same launch (a power-of-two ``block_size``; others take a second
        launch): the attention's indices with one kernel and no extra buffer.
    block_size : int
        Tokens per page of ``block_table``.

    Returns
    -------
    int32 [B * next_n, k], same rules as :func:`topk_per_row` (positions, or their
    slots; -1 stays -1).

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.indexer import topk_per_row_decode
    >>> logits = np.array([[5, 1, 4, 9], [5, 1, 4, 9]], np.float32)
    >>> topk_per_row_decode(logits, np.array([4], np.int32), next_n=2, k=2)
    array([[0, 2],
           [3, 0]], dtype=int32)
    >>> topk_per_row_decode(logits, np.array([4], np.int32), next_n=2, k=2,
    ...                     block_table=np.array([[5]], np.int32), block_size=4)
    array([[20, 22],
           [23, 20]], dtype=int32)
    """
    key = V.layouts(logits, context_lens, out, block_table)
    if key is not None:
        key += (type(next_n), next_n, type(k), k, type(block_size), block_size)
    hit = _TOPK_DECODE_CALLS.get(key)
    if hit is None:
        xp = _backend.get_array_module(logits=logits, context_lens=context_lens, out=out,
                                       block_table=block_table)
        k = V.check_positive_int("k", k)
        next_n = V.check_positive_int("next_n", next_n)
        block_size = V.check_positive_int("block_size", block_size)
        V.check_array("logits", logits, ndim=2, dtype="float32",
                      shape_desc="[B * next_n, W]")
        if logits.shape[0] % next_n:
            raise ValueError(f"Invalid shape of logits: expected [B * next_n, W] with "
                             f"next_n={next_n}, got {tuple(logits.shape)}")
        batch = logits.shape[0] // next_n
        _check_decode_lens(context_lens, batch, next_n)
        if block_table is not None:
            V.check_index("block_table", block_table, ndim=2, shape=(batch, None),
                          shape_desc="[B, max_blocks]")
        if out is not None:
            _check_out(xp, out, logits.shape[0], k)
        launch = _ktopk.call_launch(xp, logits, k, _ktopk.decode_mode(context_lens), next_n,
                                    (context_lens,), block_table, block_size) \
            if _backend.use_kernels(xp) else None
        hit = _TOPK_DECODE_CALLS.put(key, (xp, k, next_n, block_size, launch))
    xp, k, next_n, block_size, launch = hit
    run = V.memo_launch(xp, launch)
    if run is not None:
        return run(logits, context_lens, context_lens, context_lens, out, block_table)
    rows, width = logits.shape
    if V.value_checks_enabled(xp) and rows:
        longest = int(decode_row_ends(context_lens, next_n).max())
        if longest > width:
            raise ValueError(f"Invalid shape of logits: a row's window ends at {longest}, "
                             f"past the logits width {width}")
        if int(context_lens.min()) < 0:
            raise ValueError("Invalid context_lens: expected values >= 0, got "
                             f"{int(context_lens.min())}")
        if block_table is not None:       # every position a row can choose has a page
            V.check_context_lens(xp, context_lens, block_table, block_size, None)
    return topk_per_row_decode_core(xp, logits, context_lens, next_n, k, out,
                                    block_table, block_size)


_TOPK_DECODE_CALLS = V.CallMemo("topk_per_row_decode")
