"""Reference MLA attention (sparse over top-k rows, and dense causal), array-generic.

Float64 softmax in natural log: ``lse = log(sum_j exp(sm_scale * q . k_j))``.
A query with no valid key gets ``out = 0`` and ``lse = -inf``. A masked key (index
-1, or any index outside ``[0, num_slots)``) is never read, so whatever its slot
holds (NaN included) cannot reach the output; a NaN that does take part (in the
query or in a valid key) makes that row's out and lse NaN, never the empty marker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy

from cpsparse import paging
from cpsparse.reference import fp8
from cpsparse.reference._xp import xp_of

if TYPE_CHECKING:
    from cpsparse._typing import Array, FloatLike

WORKSPACE_BYTES = 256 << 20


def _softmax_rows(xp, logits, valid):
    """(p, lse) over the last axis with invalid entries excluded.

    A row with no valid entry gets p = 0, lse = -inf; a NaN among its valid
    entries makes the whole row's p and lse NaN.
    """
    masked = xp.where(valid, logits, -xp.inf)
    nan_row = xp.isnan(masked).any(axis=-1, keepdims=True)
    masked = xp.where(xp.isnan(masked), -xp.inf, masked)
    top = masked.max(axis=-1, keepdims=True)
    top = xp.where(xp.isfinite(top), top, 0.0)
    with numpy.errstate(over="ignore", invalid="ignore"):
        e = xp.where(valid, xp.exp(masked - top), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    with numpy.errstate(divide="ignore", invalid="ignore"):
        lse = xp.where(total > 0, xp.log(total) + top, -xp.inf)
        p = xp.where(total > 0, e / xp.where(total > 0, total, 1.0), 0.0)
    lse = xp.where(nan_row, xp.nan, lse)[..., 0]
    p = xp.where(nan_row, xp.nan, p)
    return p, lse


def sparse_mla_attention(q: Array, kv: Array, indices: Array, sm_scale: FloatLike, d_v: int,
                         decode: Callable[[Array], Array] | None = None
                         ) -> tuple[Array, Array]:
    """out [T, H, d_v], lse [T, H] (float32) over the rows ``kv[indices[t]]``.

    kv is the dense latent [S, Dqk], or raw rows (e.g. fp8_ds_mla records)
    that ``decode`` turns into float rows [n, Dqk]. An index outside ``[0, S)``
    (-1 padding, or anything out of range) is masked and its row never read; a
    repeated index counts as many times as it appears.
    """
    xp = xp_of(q)
    tokens, heads, dqk = q.shape
    topk = indices.shape[1]
    num_slots = kv.shape[0]
    out = xp.zeros((tokens, heads, d_v), dtype=xp.float32)
    lse = xp.full((tokens, heads), -xp.inf, dtype=xp.float32)
    if tokens == 0 or topk == 0 or num_slots == 0:
        return out, lse          # nothing to attend to (every index is masked)
    q64 = fp8.to_float64(q)
    chunk = max(1, WORKSPACE_BYTES // (8 * topk * (dqk + heads)))
    for t0 in range(0, tokens, chunk):
        t1 = min(tokens, t0 + chunk)
        idx = indices[t0:t1].astype(xp.int64)
        valid = (idx >= 0) & (idx < num_slots)
        # Decode each distinct valid slot once (top-k rows of nearby tokens overlap);
        # masked entries get zero rows without reading anything.
        slots, inverse = xp.unique(idx[valid], return_inverse=True)
        distinct = kv[slots]
        distinct = fp8.to_float64(decode(distinct) if decode is not None else distinct)
        rows = xp.zeros(idx.shape + (dqk,), dtype=xp.float64)           # [t, k, Dqk]
        rows[valid] = distinct[inverse.reshape(-1)]
        logits = (q64[t0:t1] @ rows.transpose(0, 2, 1)) * sm_scale       # [t, h, k]
        p, row_lse = _softmax_rows(xp, logits, valid[:, None, :])
        out[t0:t1] = p @ rows[:, :, :d_v]
        lse[t0:t1] = row_lse
    return out, lse


def dense_mla_attention(q: Array, kv: Array, sm_scale: FloatLike, d_v: int, cu_seqlens_q: Array,
                        cu_seqlens_k: Array) -> tuple[Array, Array]:
    """Causal attention per request, bottom-right aligned (host int64 cu arrays).

    Query i of request r (q_len queries, k_len keys) sees keys
    ``j < k_len - q_len + i + 1``.
    """
    xp = xp_of(q)
    tokens, heads, dqk = q.shape
    out = xp.zeros((tokens, heads, d_v), dtype=xp.float32)
    lse = xp.full((tokens, heads), -xp.inf, dtype=xp.float32)
    q64 = fp8.to_float64(q)
    kv64 = fp8.to_float64(kv)
    for r in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[r]), int(cu_seqlens_q[r + 1])
        k0, k1 = int(cu_seqlens_k[r]), int(cu_seqlens_k[r + 1])
        q_len, k_len = q1 - q0, k1 - k0
        if q_len == 0 or k_len == 0:
            continue
        keys = kv64[k0:k1]
        chunk = max(1, WORKSPACE_BYTES // (8 * heads * k_len))
        for i0 in range(0, q_len, chunk):
            i1 = min(q_len, i0 + chunk)
            logits = (q64[q0 + i0:q0 + i1] @ keys.T) * sm_scale
            i = xp.arange(i0, i1)[:, None, None]
            j = xp.arange(k_len)[None, None, :]
            p, row_lse = _softmax_rows(xp, logits, j < paging.causal_ends(q_len, k_len, i))
            out[q0 + i0:q0 + i1] = p @ keys[:, :d_v]
            lse[q0 + i0:q0 + i1] = row_lse
    return out, lse


# The slot formula lives in cpsparse.paging (with the rest of the paging arithmetic).
local_to_global_slots = paging.local_to_global_slots
