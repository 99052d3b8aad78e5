"""Reference MLA attention (sparse over top-k rows, and dense causal), array-generic.

Float64 softmax in natural log: ``lse = log(sum_j exp(sm_scale * q . k_j))``.
A query with no valid key gets ``out = 0`` and ``lse = -inf`` (never NaN).
"""

import numpy

from cpsparse.reference import fp8
from cpsparse.reference._xp import xp_of

WORKSPACE_BYTES = 256 << 20


def _softmax_rows(xp, logits, valid):
    """(p, lse) over the last axis with invalid entries excluded."""
    masked = xp.where(valid, logits, -xp.inf)
    top = masked.max(axis=-1, keepdims=True)
    top = xp.where(xp.isfinite(top), top, 0.0)
    e = xp.where(valid, xp.exp(masked - top), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    with numpy.errstate(divide="ignore", invalid="ignore"):
        lse = xp.where(total > 0, xp.log(total) + top, -xp.inf)[..., 0]
        p = xp.where(total > 0, e / xp.where(total > 0, total, 1.0), 0.0)
    return p, lse


def sparse_mla_attention(q, kv, indices, sm_scale, d_v, decode=None):
    """out [T, H, d_v], lse [T, H] (float32) over the rows ``kv[indices[t]]``.

    kv is the dense latent [S, Dqk], or raw rows (e.g. fp8_ds_mla records)
    that ``decode`` turns into float rows [n, Dqk]. Index -1 is masked; a
    repeated index counts as many times as it appears.
    """
    xp = xp_of(q)
    tokens, heads, dqk = q.shape
    topk = indices.shape[1]
    out = xp.zeros((tokens, heads, d_v), dtype=xp.float32)
    lse = xp.full((tokens, heads), -xp.inf, dtype=xp.float32)
    if tokens == 0 or topk == 0 or kv.shape[0] == 0:
        return out, lse          # nothing to attend to (every index is -1)
    q64 = fp8.to_float64(q)
    chunk = max(1, WORKSPACE_BYTES // (8 * topk * (dqk + heads)))
    for t0 in range(0, tokens, chunk):
        t1 = min(tokens, t0 + chunk)
        idx = indices[t0:t1].astype(xp.int64)
        valid = idx >= 0
        # Decode each distinct slot once: top-k rows of nearby tokens overlap.
        slots, inverse = xp.unique(xp.where(valid, idx, 0).reshape(-1), return_inverse=True)
        distinct = kv[slots]
        distinct = fp8.to_float64(decode(distinct) if decode is not None else distinct)
        rows = distinct[inverse.reshape(-1)].reshape(idx.shape + (dqk,))  # [t, k, Dqk]
        logits = (q64[t0:t1] @ rows.transpose(0, 2, 1)) * sm_scale       # [t, h, k]
        p, row_lse = _softmax_rows(xp, logits, valid[:, None, :])
        out[t0:t1] = p @ rows[:, :, :d_v]
        lse[t0:t1] = row_lse
    return out, lse


def dense_mla_attention(q, kv, sm_scale, d_v, cu_seqlens_q, cu_seqlens_k):
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
            p, row_lse = _softmax_rows(xp, logits, j < k_len - q_len + i + 1)
            out[q0 + i0:q0 + i1] = p @ keys[:, :d_v]
            lse[q0 + i0:q0 + i1] = row_lse
    return out, lse


def local_to_global_slots(indices, req_ids, block_table, block_size):
    """``block_table[req, pos // B] * B + pos % B``; negative positions give -1."""
    xp = xp_of(indices)
    pos = indices.astype(xp.int64)
    valid = pos >= 0
    pos = xp.where(valid, pos, 0)
    pages = block_table[req_ids.astype(xp.int64)[:, None], pos // block_size].astype(xp.int64)
    return xp.where(valid, pages * block_size + pos % block_size, -1).astype(xp.int32)
