"""MLA attention: sparse over the indexer's top-k rows, and dense causal.

Shapes (DeepSeek-V3.2): a query head is ``[q_nope absorbed by W_UK (512) |
q_pe (64)]`` = 576 wide; a key is ``[kv_c | k_pe]`` (576); the value is
``kv_c`` (the first ``d_v`` = 512 columns of the key row). Outputs are
``out`` [T, H, d_v] (float32, or bfloat16 / float16 with ``out_dtype``) and ``lse``
[T, H] (float32), lse in natural log.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy

from cpsparse import _backend
from cpsparse import _validation as V
from cpsparse import paging
from cpsparse.cache import MLAKVCache, Model1KVCache
from cpsparse.raw_kernels import attention as _katt
from cpsparse.reference import attention as _ref
from cpsparse.reference import cache as _cache_ref
from cpsparse.reference import context_parallel as _cp_ref

if TYPE_CHECKING:
    from cpsparse._typing import Array, DTypeLike, FloatLike, IntLike

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
        return kv_cache, kv_cache.value_dim if d_v is None else d_v
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


def _rows_of(source):
    """(key rows, their decoder or None) of a cache (its records) or a dense workspace."""
    if isinstance(source, MLAKVCache):
        return source.records(), source.decode_records
    return source, None


def _num_slots(source):
    """Slots an index may name in a cache or a dense workspace."""
    return source.num_slots if isinstance(source, MLAKVCache) else source.shape[0]


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
                         sm_scale: FloatLike, *, d_v: IntLike | None = None,
                         attn_sink: Array | None = None, topk_length: Array | None = None,
                         extra_kv_cache: MLAKVCache | Array | None = None,
                         extra_indices: Array | None = None,
                         extra_topk_length: Array | None = None,
                         out_dtype: DTypeLike | None = None) -> tuple[Array, Array]:
    """Attention of each query token over the key rows its top-k selected.

    Parameters
    ----------
    q : float [T, H, D]
        Absorbed queries (D = 576 for DeepSeek-V3.2): float16, float32, float64 or
        bfloat16 (ml_dtypes' dtype; on CuPy >= 14 the kernels read it as it is).
    kv_cache : MLAKVCache, uint8 [num_blocks, block_size, token_bytes] or float [S, D]
        The paged fp8_ds_mla cache (dequantized on the fly; FlashMLA's
        ``[num_blocks, block_size, 1, 656]`` view is accepted), DeepSeek-V4's
        MODEL1 cache (an ``MLAKVCache`` of ``layout="model1"``, D = 512; on CuPy
        one kernel runs it with all the extras below, when every key source is a
        MODEL1 cache),
        or a dense latent workspace (e.g. bf16 rows gathered for prefill).
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
        ``value_dim`` (kv_lora_rank; 512 for MODEL1), or ``D - 64`` for a dense
        workspace.
    attn_sink : float32 [H], optional
        FlashMLA's attention sink: one more logit per head with a zero value,
        in the softmax's denominator only. ``out`` is scaled by
        ``exp(lse) / (exp(lse) + exp(attn_sink))``; ``lse`` is not changed.
        ``+inf`` makes the head's output 0, ``-inf`` has no effect.
    topk_length : int32 or int64 [T], optional
        Row t attends to its first ``topk_length[t]`` indices only (the rest
        count as -1, never read); 0 attends to none, a length past topk to all.
    extra_kv_cache : MLAKVCache or array, optional
        A second key source in any form ``kv_cache`` takes (e.g. DeepSeek-V4's
        sliding-window cache), attended in the same softmax: ``out`` and
        ``lse`` are those of one softmax over both index lists.
    extra_indices : int32 or int64 [T, extra_topk] or [T, 1, extra_topk]
        Slots of ``extra_kv_cache`` (given with it, same masking rules).
    extra_topk_length : int32 or int64 [T], optional
        ``topk_length`` of ``extra_indices``.
    out_dtype : {None, "float32", "bfloat16", "float16"} or dtype, optional
        dtype of ``out`` (default float32): the float32 result rounded to nearest
        even, on CuPy in the kernel's epilogue or the split-KV merge (bfloat16 is
        FlashMLA's output dtype; no separate cast pass). bfloat16 needs ml_dtypes (and
        CuPy >= 14). ``lse`` is float32 either way.

    Returns
    -------
    out : float32 [T, H, d_v] (or ``out_dtype``)
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

    A sink logit equal to the row's lse halves the output; ``topk_length``
    drops the tail of a row:

    >>> out, _ = sparse_mla_attention(q, kv, np.array([[0, 2, -1]], np.int32), 1.0, d_v=4,
    ...                               attn_sink=np.log(np.full(2, 2, np.float32)))
    >>> out[0, 0]
    array([0.25, 0.  , 0.25, 0.  ], dtype=float32)
    >>> out, lse = sparse_mla_attention(q, kv, np.array([[0, 2, -1]], np.int32), 1.0,
    ...                                 d_v=4, topk_length=np.array([1]))
    >>> out[0, 0], lse[0]
    (array([1., 0., 0., 0.], dtype=float32), array([0., 0.], dtype=float32))

    A 16-bit output (rounded from the float32 result):

    >>> out, _ = sparse_mla_attention(q, kv, np.array([[0, 1, 2]], np.int32), 1.0, d_v=4,
    ...                               out_dtype="float16")
    >>> out[0, 0]
    array([0.3333, 0.3333, 0.3333, 0.    ], dtype=float16)
    """
    if attn_sink is not None or topk_length is not None or extra_kv_cache is not None \
            or extra_indices is not None or extra_topk_length is not None:
        return _sparse_with_extras(q, kv_cache, indices, sm_scale, d_v, attn_sink,
                                   topk_length, extra_kv_cache, extra_indices,
                                   extra_topk_length, out_dtype)
    if isinstance(kv_cache, MLAKVCache):
        data, wrapped = kv_cache.data, (type(kv_cache), kv_cache.kv_lora_rank,
                                        kv_cache.rope_dim)
    else:
        data, wrapped = kv_cache, None
    key = V.layouts(q, indices, data)
    if key is not None:
        key += (type(sm_scale), sm_scale, type(d_v), d_v, wrapped) \
            + V.out_dtype_key(out_dtype)
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
        out_dt = V.check_out_dtype(xp, out_dtype)
        # A raw fp8_ds_mla array is found again by its latent width (the layout
        # checks passed), a dense workspace by None.
        lora = source.kv_lora_rank if isinstance(source, MLAKVCache) else None
    else:                                  # the same layouts passed the checks above
        xp, d_v, sm_scale, lora, out_dt, launch = hit
        if indices.ndim == 3:
            indices = indices.reshape(indices.shape[0], indices.shape[2])
        run = V.memo_launch(xp, launch)
        if run is not None:
            result = run(q, data, indices)
            if result is not None:
                return result
        source = kv_cache if wrapped is not None or lora is None else MLAKVCache.trusted_view(
            data, lora, q.shape[2] - lora, xp)
    V.check_slots(xp, indices, _num_slots(source), name="indices")
    if hit is None:
        # fp8_ds_mla records (not MODEL1's pages, not dense rows): the kernel's launch,
        # prepared once, after every check (the call then costs a launch or two: a decode
        # loop's eager attention is bound by host time).
        launch = _katt.call_launch(xp, q, data, source.records(), indices, sm_scale, d_v,
                                   out_dt) \
            if _backend.use_kernels(xp) and isinstance(source, MLAKVCache) \
            and not isinstance(source, Model1KVCache) else None
        _SPARSE_CALLS.put(key, (xp, d_v, sm_scale, lora, out_dt, launch))
    return sparse_mla_attention_core(xp, q, source, indices, sm_scale, d_v, out_dtype=out_dt)


_SPARSE_CALLS = V.CallMemo("sparse_mla_attention")


def _check_sparse_source(xp, q, kv_cache, indices, d_v, names):
    """(key source, [T, topk] indices, d_v) of one key source, checked (``names``: the
    argument names of the cache and its indices)."""
    tokens, _, dqk = q.shape
    source, d_v = _kv_source(kv_cache, dqk, d_v)
    d_v = _check_d_v(d_v, dqk)
    indices = V.squeeze_axis(names[1], indices, 1, 3)        # FlashMLA's [T, 1, topk]
    V.check_index(names[1], indices, ndim=2, shape=(tokens, None),
                  shape_desc="[T, topk] or [T, 1, topk]")
    V.check_slots(xp, indices, _num_slots(source), name=names[1])
    return source, indices, d_v


def _first(xp, indices, lengths):
    """``indices`` with the entries of row t past ``lengths[t]`` set to -1."""
    if lengths is None:
        return indices
    keep = xp.arange(indices.shape[1])[None, :] < lengths.astype(xp.int64)[:, None]
    return xp.where(keep, indices, -1).astype(indices.dtype)


def _check_lengths(xp, name, lengths, tokens):
    if lengths is None:
        return
    V.check_index(name, lengths, shape=(tokens,), shape_desc="[T]")
    if V.value_checks_enabled(xp) and tokens and int(lengths.min()) < 0:
        raise ValueError(f"Invalid {name}: expected values >= 0, got {int(lengths.min())}")


def _sparse_with_extras(q, kv_cache, indices, sm_scale, d_v, attn_sink, topk_length,
                        extra_kv_cache, extra_indices, extra_topk_length, out_dtype):
    """:func:`sparse_mla_attention` with FlashMLA's extras. On CuPy with MODEL1 caches
    only, one kernel does it all (lengths, both lists in one softmax, the sink);
    otherwise each key source goes through the core (kernels or reference), merged by
    lse into one softmax, then the sink.

    The composition is exact (a softmax over two disjoint index lists is the lse
    merge of the two), and costs a launch or two more than the fused kernel."""
    if (extra_kv_cache is None) != (extra_indices is None):
        raise ValueError("Invalid extra_kv_cache: expected extra_kv_cache and "
                         "extra_indices together, got only one of them")
    if extra_topk_length is not None and extra_indices is None:
        raise ValueError("Invalid extra_topk_length: expected extra_indices with it")
    xp = _backend.get_array_module(
        q=q, indices=indices, attn_sink=attn_sink, topk_length=topk_length,
        extra_indices=extra_indices, extra_topk_length=extra_topk_length,
        kv_cache=kv_cache.data if isinstance(kv_cache, MLAKVCache) else kv_cache,
        extra_kv_cache=extra_kv_cache.data if isinstance(extra_kv_cache, MLAKVCache)
        else extra_kv_cache)
    tokens, heads, dqk = _check_q(q)
    source, indices, d_v = _check_sparse_source(xp, q, kv_cache, indices, d_v,
                                                ("kv_cache", "indices"))
    sm_scale = _check_scale(sm_scale)
    out_dt = V.check_out_dtype(xp, out_dtype)
    _check_lengths(xp, "topk_length", topk_length, tokens)
    if attn_sink is not None:
        V.check_array("attn_sink", attn_sink, dtype="float32", shape=(heads,),
                      shape_desc="[H]")
    parts = [(source, indices, topk_length)]
    if extra_kv_cache is not None:
        e_source, e_indices, _ = _check_sparse_source(
            xp, q, extra_kv_cache, extra_indices, d_v, ("extra_kv_cache", "extra_indices"))
        _check_lengths(xp, "extra_topk_length", extra_topk_length, tokens)
        parts.append((e_source, e_indices, extra_topk_length))
    if len(parts) == 1:
        # One key source: its lengths and the sink go into the kernel (or the reference).
        return sparse_mla_attention_core(xp, q, source, indices, sm_scale, d_v,
                                         topk_length, attn_sink, out_dt)
    if _backend.use_kernels(xp) and _katt.supports_model1(q.shape, d_v) and all(
            isinstance(src, Model1KVCache) for src, _, _ in parts):
        # Two MODEL1 caches: both lists in one softmax of one kernel.
        return _katt.sparse_mla_attention_model1(
            xp, q, [(src.data, src.block_size, idx, n) for src, idx, n in parts], sm_scale,
            d_v, attn_sink, out_dtype=out_dt)
    results = [sparse_mla_attention_core(xp, q, src, idx, sm_scale, d_v, n)
               for src, idx, n in parts]
    out, lse = _cp_ref.merge_attention(xp.stack([o for o, _ in results]),
                                       xp.stack([lse for _, lse in results]))
    return _as_out(xp, _with_sink(xp, out, lse, attn_sink), out_dt), lse.astype(xp.float32)


def _as_out(xp, out, out_dtype):
    """out as the op returns it: float32, then rounded to ``out_dtype`` (as the kernels
    round their float32 rows)."""
    out = out.astype(xp.float32, copy=False)
    return out if out_dtype == out.dtype else out.astype(out_dtype)


def _with_sink(xp, out, lse, attn_sink):
    """out scaled by exp(lse) / (exp(lse) + exp(sink)) = 1 / (1 + exp(sink - lse)); an
    empty row (lse -inf) keeps out = 0, a +inf sink gives 0, a -inf sink 1."""
    if attn_sink is None:
        return out
    with numpy.errstate(over="ignore", invalid="ignore"):
        factor = 1.0 / (1.0 + xp.exp(attn_sink.astype(xp.float64)[None, :]
                                     - lse.astype(xp.float64)))
    factor = xp.where(lse == -xp.inf, 0.0, factor)
    return out * factor[..., None]


def sparse_mla_attention_core(xp, q, source, indices, sm_scale, d_v, lengths=None,
                              attn_sink=None, out_dtype=numpy.dtype(numpy.float32)):
    """:func:`sparse_mla_attention` on validated arguments: ``source`` is an
    :class:`MLAKVCache` (fp8_ds_mla or MODEL1) or a dense workspace [S, D]; row t
    attends to its first ``lengths[t]`` indices (all when None); ``attn_sink`` [H]
    or None; ``out_dtype`` a checked numpy dtype (:func:`V.check_out_dtype`). On the
    kernel path the lengths and the sink are read by the kernel."""
    if _backend.use_kernels(xp):
        if isinstance(source, Model1KVCache):
            # the kernel reads the pages (MODEL1's records() would build a device
            # arange of every slot for nothing)
            if _katt.supports_model1(q.shape, d_v):
                return _katt.sparse_mla_attention_model1(
                    xp, q, [(source.data, source.block_size, indices, lengths)], sm_scale,
                    d_v, attn_sink, out_dtype=out_dtype)
        else:
            rows, decode = _rows_of(source)
            fp8 = decode is not None
            if _katt.supports(q.shape, d_v) and _katt.supports_rows(rows, fp8) \
                    and _katt.supports_scale(sm_scale, fp8):
                return _katt.sparse_mla_attention(xp, q, rows, indices, sm_scale, d_v, fp8,
                                                  lengths=lengths, attn_sink=attn_sink,
                                                  out_dtype=out_dtype)
        _backend.warn_fallback("sparse_mla_attention", tuple(q.shape) + (d_v,),
                               "this head dim / d_v / record size / sm_scale")
    rows, decode = _rows_of(source)
    out, lse = _ref.sparse_mla_attention(q, rows, _first(xp, indices, lengths), sm_scale, d_v,
                                         decode)
    return _as_out(xp, _with_sink(xp, out, lse, attn_sink), out_dtype), lse


def dense_mla_attention(q: Array, kv: Array, sm_scale: FloatLike, *,
                        cu_seqlens_q: Array | None = None, cu_seqlens_k: Array | None = None,
                        d_v: IntLike | None = None,
                        out_dtype: DTypeLike | None = None) -> tuple[Array, Array]:
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
    out_dtype : {None, "float32", "bfloat16", "float16"} or dtype, optional
        dtype of ``out``, as in :func:`sparse_mla_attention`.

    Returns
    -------
    out : float32 [T, H, d_v] (or ``out_dtype``), lse : float32 [T, H]

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
    out_dt = V.check_out_dtype(xp, out_dtype)
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
    return dense_mla_attention_core(xp, q, kv, sm_scale, d_v, cu_q, cu_k, out_dtype=out_dt)


def dense_mla_attention_core(xp, q, kv, sm_scale, d_v, cu_q, cu_k, key_ranges=None,
                             out_dtype=numpy.dtype(numpy.float32)):
    """:func:`dense_mla_attention` on validated arguments (host int64 cu arrays;
    ``key_ranges``: the per-query (first key, key count) device arrays, if known)."""
    if _backend.use_kernels(xp):
        if _katt.supports(q.shape, d_v) and _katt.supports_scale(sm_scale, False):
            return _katt.dense_mla_attention(xp, q, kv, sm_scale, d_v, cu_q, cu_k, key_ranges,
                                             out_dtype)
        _backend.warn_fallback("dense_mla_attention", tuple(q.shape) + (d_v,),
                               "this head dim / d_v / sm_scale")
    out, lse = _ref.dense_mla_attention(q, kv, sm_scale, d_v, cu_q, cu_k)
    return _as_out(xp, out, out_dtype), lse


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
