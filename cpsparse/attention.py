"""MLA attention: sparse over the indexer's top-k rows, and dense causal.

Shapes (DeepSeek-V3.2): a query head is ``[q_nope absorbed by W_UK (512) |
q_pe (64)]`` = 576 wide; a key is ``[kv_c | k_pe]`` (576); the value is
``kv_c`` (the first ``d_v`` = 512 columns of the key row). Outputs are
``out`` [T, H, d_v] and ``lse`` [T, H], both float32, lse in natural log.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy

from cpsparse import _backend
from cpsparse import _validation as V
from cpsparse import paging
from cpsparse.cache import MLAKVCache
from cpsparse.raw_kernels import attention as _katt
from cpsparse.reference import attention as _ref
from cpsparse.reference import cache as _cache_ref

if TYPE_CHECKING:
    from cpsparse._typing import Array, FloatLike, IntLike

__all__ = ["sparse_mla_attention", "dense_mla_attention", "local_to_global_slots",
           "softmax_scale"]

DEFAULT_ROPE_DIM = 64


def softmax_scale(qk_nope_head_dim: int = 128, qk_rope_head_dim: int = 64,
                  mscale: float | None = None) -> float:
    """``(qk_nope + qk_rope) ** -0.5``, times ``mscale ** 2`` when YaRN is used.

    Parameters
    ----------
    qk_nope_head_dim : int
        Per-head query/key dims without RoPE (128 in DeepSeek-V3.2). Absorbed
        into the 512-wide latent, but the scale is that of the original head.
    qk_rope_head_dim : int
        Per-head RoPE dims (64).
    mscale : float, optional
        YaRN's attention factor, ``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``
        (1 when ``factor <= 1``), from the model's ``rope_scaling`` config. None:
        no YaRN correction. DeepSeek-V3.2's config (``factor`` 40,
        ``mscale_all_dim`` 1.0) gives ``0.1 * ln 40 + 1 = 1.368888``, so
        ``mscale ** 2 = 1.873854`` and the scale is 0.135234 instead of 0.072169.
        cpsparse does not read the model config: pass it here, or set
        :attr:`cpsparse.mla.MLAConfig.softmax_mscale`.

    Returns
    -------
    float
        The ``sm_scale`` of :func:`sparse_mla_attention` and
        :func:`dense_mla_attention`.

    Examples
    --------
    >>> import math
    >>> from cpsparse.attention import softmax_scale
    >>> round(softmax_scale(128, 64), 6)
    0.072169
    >>> mscale = 0.1 * 1.0 * math.log(40) + 1          # DeepSeek-V3.2: factor 40
    >>> round(mscale, 6), round(softmax_scale(128, 64, mscale), 6)
    (1.368888, 0.135234)
    """
    scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
    return scale * mscale * mscale if mscale is not None else scale


def _kv_source(kv_cache, dqk, d_v):
    """(MLAKVCache, or a dense workspace [S, D], and d_v) for any accepted kv_cache form."""
    if isinstance(kv_cache, MLAKVCache):
        if kv_cache.head_dim != dqk:
            raise ValueError(f"Invalid kv_cache: expected kv_lora_rank + rope_dim = {dqk} "
                             f"(the last dimension of q), got {kv_cache.head_dim}")
        return kv_cache, kv_cache.kv_lora_rank if d_v is None else d_v
    V.check_array("kv_cache", kv_cache, contiguous=True)
    if str(kv_cache.dtype) in V.CODE_DTYPES:
        # A raw fp8_ds_mla array: infer L from D = L + R and T = L + L/32 + 2R.
        kv_cache = V.squeeze_axis("kv_cache", kv_cache, 2, 4)   # FlashMLA's [nb, bs, 1, T]
        if kv_cache.ndim != 3:
            raise ValueError("Invalid shape of kv_cache: expected [num_blocks, block_size, "
                             "token_bytes] or [num_blocks, block_size, 1, token_bytes] for "
                             f"the fp8_ds_mla layout, got {kv_cache.shape}")
        lora = (2 * dqk - kv_cache.shape[2]) * 32 // 31
        if lora <= 0 or lora % 128 or _cache_ref.mla_token_bytes(lora, dqk - lora) != \
                kv_cache.shape[2]:
            raise ValueError(f"Invalid shape of kv_cache: token_bytes={kv_cache.shape[2]} "
                             f"matches no fp8_ds_mla layout of head dim {dqk}")
        return _kv_source(MLAKVCache.wrap(kv_cache, lora, dqk - lora, name="kv_cache"), dqk,
                          d_v)
    V.check_array("kv_cache", kv_cache, ndim=2, dtype=V.FLOAT_DTYPES, shape=(None, dqk),
                  shape_desc="[num_slots, D] (dense latent)")
    return kv_cache, (dqk - DEFAULT_ROPE_DIM if d_v is None else d_v)


def _check_q(q):
    V.check_array("q", q, ndim=3, dtype=V.FLOAT_DTYPES, shape_desc="[T, H, D]")
    return q.shape


def _check_d_v(d_v, dqk):
    d_v = V.check_positive_int("d_v", d_v)
    if d_v > dqk:
        raise ValueError(f"Invalid d_v: expected <= the head dim {dqk}, got {d_v}")
    return d_v


def _check_scale(sm_scale):
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float, numpy.floating)):
        raise TypeError(f"Invalid sm_scale: expected a finite float, got {sm_scale!r}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"Invalid sm_scale: expected a finite float, got {sm_scale!r}")
    return float(sm_scale)


def sparse_mla_attention(q: Array, kv_cache: MLAKVCache | Array, indices: Array,
                         sm_scale: FloatLike, *, d_v: IntLike | None = None
                         ) -> tuple[Array, Array]:
    """Attention of each query token over the key rows its top-k selected.

    Parameters
    ----------
    q : float [T, H, D]
        Absorbed queries (D = 576 for DeepSeek-V3.2).
    kv_cache : MLAKVCache, uint8 [num_blocks, block_size, token_bytes] or float [S, D]
        The paged fp8_ds_mla cache (dequantized on the fly; FlashMLA's
        ``[num_blocks, block_size, 1, 656]`` view is accepted), or a dense latent
        workspace (e.g. bf16 rows gathered for prefill).
    indices : int32 or int64 [T, topk] or [T, 1, topk]
        Global slots (``page * block_size + offset``); -1 is masked. A slot
        listed twice counts twice. With value checks off (or under CUDA-graph
        capture) any slot outside ``[0, num_slots)`` is masked too, as FlashMLA
        does: it is never read. A masked slot's contents (NaN included) never
        reach the output.
    sm_scale : float
        See :func:`softmax_scale`.
    d_v : int, optional
        Value width: the first d_v columns of a key row. Default: the cache's
        kv_lora_rank, or ``D - 64`` for a dense workspace.

    Returns
    -------
    out : float32 [T, H, d_v]
    lse : float32 [T, H]
        Natural-log sum of exp of the scaled scores; a row with no valid index
        gets ``out = 0`` and ``lse = -inf``. A NaN in a query or in a valid key
        gives NaN in that row's out and lse.

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.attention import sparse_mla_attention
    >>> kv = np.eye(4, 8, dtype=np.float32)                 # 4 slots, D = 8
    >>> q = np.zeros((1, 2, 8), np.float32)                 # uniform scores
    >>> out, lse = sparse_mla_attention(q, kv, np.array([[0, 2, -1]], np.int32), 1.0, d_v=4)
    >>> out[0, 0]                                           # mean of rows 0 and 2
    array([0.5, 0. , 0.5, 0. ], dtype=float32)
    >>> np.round(lse[0], 4)                                 # log(2)
    array([0.6931, 0.6931], dtype=float32)
    """
    if isinstance(kv_cache, MLAKVCache):
        data, wrapped = kv_cache.data, (kv_cache.kv_lora_rank, kv_cache.rope_dim)
    else:
        data, wrapped = kv_cache, None
    key = V.layouts(q, indices, data)
    if key is not None:
        key += (type(sm_scale), sm_scale, type(d_v), d_v, wrapped)
    hit = _SPARSE_CALLS.get(key)
    if hit is None:
        xp = _backend.get_array_module(q=q, indices=indices, kv_cache=data)
        tokens, heads, dqk = _check_q(q)
        source, d_v = _kv_source(kv_cache, dqk, d_v)
        d_v = _check_d_v(d_v, dqk)
        indices = V.squeeze_axis("indices", indices, 1, 3)       # FlashMLA's [T, 1, topk]
        V.check_index("indices", indices, ndim=2, shape=(tokens, None),
                      shape_desc="[T, topk] or [T, 1, topk]")
        sm_scale = _check_scale(sm_scale)
        # A raw fp8_ds_mla array is found again by its latent width (the layout
        # checks passed), a dense workspace by None.
        lora = source.kv_lora_rank if isinstance(source, MLAKVCache) else None
        _SPARSE_CALLS.put(key, (xp, d_v, sm_scale, lora))
    else:                                  # the same layouts passed the checks above
        xp, d_v, sm_scale, lora = hit
        if indices.ndim == 3:
            indices = indices.reshape(indices.shape[0], indices.shape[2])
        source = kv_cache if wrapped is not None or lora is None else MLAKVCache.trusted_view(
            data, lora, q.shape[2] - lora, xp)
    if isinstance(source, MLAKVCache):
        rows, decode = source.records(), source.decode_records
    else:
        rows, decode = source, None
    V.check_slots(xp, indices, rows.shape[0], name="indices")
    return sparse_mla_attention_core(xp, q, rows, decode, indices, sm_scale, d_v)


_SPARSE_CALLS = V.CallMemo("sparse_mla_attention")


def sparse_mla_attention_core(xp, q, rows, decode, indices, sm_scale, d_v):
    """:func:`sparse_mla_attention` on validated arguments: ``rows`` are the key rows
    (fp8_ds_mla records when ``decode`` is their decoder, else a dense workspace)."""
    if _backend.use_kernels(xp):
        fp8 = decode is not None
        if _katt.supports(q.shape, d_v) and _katt.supports_rows(rows, fp8):
            return _katt.sparse_mla_attention(xp, q, rows, indices, sm_scale, d_v, fp8)
        _backend.warn_fallback("sparse_mla_attention", tuple(q.shape) + (d_v,),
                               "this head dim / d_v / record size")
    return _ref.sparse_mla_attention(q, rows, indices, sm_scale, d_v, decode)


def dense_mla_attention(q: Array, kv: Array, sm_scale: FloatLike, *,
                        cu_seqlens_q: Array | None = None, cu_seqlens_k: Array | None = None,
                        d_v: IntLike | None = None) -> tuple[Array, Array]:
    """Dense causal MLA attention over packed requests (the short-prefill route).

    Query i of a request with ``q_len`` queries and ``k_len`` keys sees keys
    ``j < k_len - q_len + i + 1`` (bottom-right aligned, as in FlashAttention's
    varlen API): the new tokens attend to the whole context and causally to
    each other.

    Parameters
    ----------
    q : float [T, H, D]
    kv : float [S, D]
        Dense latent keys of every request, packed.
    sm_scale : float
    cu_seqlens_q, cu_seqlens_k : int32 [R + 1], optional
        Packed offsets; default one request of all T queries and S keys.
    d_v : int, optional
        Default ``D - 64``.

    Returns
    -------
    out : float32 [T, H, d_v], lse : float32 [T, H]

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.attention import dense_mla_attention
    >>> kv = np.arange(12, dtype=np.float32).reshape(3, 4)
    >>> out, lse = dense_mla_attention(np.zeros((3, 1, 4), np.float32), kv, 1.0, d_v=2)
    >>> out[:, 0]            # query i averages keys 0..i
    array([[0., 1.],
           [2., 3.],
           [4., 5.]], dtype=float32)
    """
    xp = _backend.get_array_module(q=q, kv=kv, cu_seqlens_q=cu_seqlens_q,
                                   cu_seqlens_k=cu_seqlens_k)
    tokens, heads, dqk = _check_q(q)
    V.check_array("kv", kv, ndim=2, dtype=V.FLOAT_DTYPES, shape=(None, dqk),
                  shape_desc="[S, D]")
    d_v = _check_d_v(dqk - DEFAULT_ROPE_DIM if d_v is None else d_v, dqk)
    sm_scale = _check_scale(sm_scale)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("Invalid cu_seqlens: expected both cu_seqlens_q and cu_seqlens_k "
                         "or neither")
    if cu_seqlens_q is None:
        cu_q = numpy.array([0, tokens], numpy.int64)
        cu_k = numpy.array([0, kv.shape[0]], numpy.int64)
    else:
        V.check_index("cu_seqlens_q", cu_seqlens_q, ndim=1,
                      shape_desc="[R + 1]")
        V.check_index("cu_seqlens_k", cu_seqlens_k,
                      shape=(cu_seqlens_q.shape[0],), shape_desc="[R + 1] (as cu_seqlens_q)")
        cu_q = V.check_cu_seq_lens(xp, cu_seqlens_q, "cu_seqlens_q")
        cu_k = V.check_cu_seq_lens(xp, cu_seqlens_k, "cu_seqlens_k")
        for name, cu, total in (("cu_seqlens_q", cu_q, tokens),
                                ("cu_seqlens_k", cu_k, kv.shape[0])):
            if cu[-1] != total:
                raise ValueError(f"Invalid {name}: expected the last entry to be {total}, "
                                 f"got {int(cu[-1])}")
    return dense_mla_attention_core(xp, q, kv, sm_scale, d_v, cu_q, cu_k)


def dense_mla_attention_core(xp, q, kv, sm_scale, d_v, cu_q, cu_k, key_ranges=None):
    """:func:`dense_mla_attention` on validated arguments (host int64 cu arrays;
    ``key_ranges``: the per-query (first key, key count) device arrays, if known)."""
    if _backend.use_kernels(xp):
        if _katt.supports(q.shape, d_v):
            return _katt.dense_mla_attention(xp, q, kv, sm_scale, d_v, cu_q, cu_k, key_ranges)
        _backend.warn_fallback("dense_mla_attention", tuple(q.shape) + (d_v,),
                               "this head dim / d_v")
    return _ref.dense_mla_attention(q, kv, sm_scale, d_v, cu_q, cu_k)


def local_to_global_slots(indices: Array, req_ids: Array, block_table: Array,
                          block_size: IntLike = 64) -> Array:
    """Map request-local top-k positions to global cache slots; -1 stays -1.

    ``slot = block_table[req, pos // block_size] * block_size + pos % block_size``.

    Parameters
    ----------
    indices : int32 [T, topk]
        Positions within each token's request (what :func:`topk_per_row` gives).
    req_ids : int32 [T]
        Request of each token (row of ``block_table``).
    block_table : int32 [R, max_blocks]
    block_size : int

    Returns
    -------
    int32 [T, topk]

    Examples
    --------
    >>> import numpy as np
    >>> from cpsparse.attention import local_to_global_slots
    >>> local_to_global_slots(np.array([[0, 65, -1]], np.int32), np.array([0], np.int32),
    ...                       np.array([[7, 3]], np.int32), block_size=64)
    array([[448, 193,  -1]], dtype=int32)
    """
    key = V.layouts(indices, req_ids, block_table)
    if key is not None:
        key += (type(block_size), block_size)
    hit = _SLOTS_CALLS.get(key)
    if hit is None:
        xp = _backend.get_array_module(indices=indices, req_ids=req_ids,
                                       block_table=block_table)
        block_size = V.check_positive_int("block_size", block_size)
        V.check_index("indices", indices, ndim=2, shape_desc="[T, topk]")
        V.check_index("req_ids", req_ids, shape=(indices.shape[0],),
                      shape_desc="[T]")
        V.check_index("block_table", block_table, ndim=2,
                      shape_desc="[R, max_blocks]")
        _SLOTS_CALLS.put(key, (xp, block_size))
    else:
        xp, block_size = hit
    V.check_slots(xp, indices, block_table.shape[1] * block_size, name="indices")
    V.check_slots(xp, req_ids, block_table.shape[0], name="req_ids", allow_negative_one=False)
    return local_to_global_slots_core(xp, indices, req_ids, block_table, block_size)


_SLOTS_CALLS = V.CallMemo("local_to_global_slots")


def local_to_global_slots_core(xp, indices, req_ids, block_table, block_size):
    """:func:`local_to_global_slots` on validated arguments."""
    if _backend.use_kernels(xp):
        return _katt.local_to_global_slots(xp, indices, req_ids, block_table, block_size)
    return paging.local_to_global_slots(indices, req_ids, block_table, block_size)
