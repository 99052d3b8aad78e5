"""``sparse_attn_indexer``: the lightning indexer of one layer over a batch
(``docs/contract.md``, "The indexer of a layer"), vLLM's name for it.

It validates the whole batch once (every argument, before the first write), then
runs the unvalidated op cores of :mod:`cpsparse.indexer` and the caches: no
device-to-host copy or sync on the way (value checks read the metadata's host
copies), so a decode step can be captured in a CUDA graph.
"""

import numpy

from cpsparse import _backend
from cpsparse import _validation as V
from cpsparse.cache import IndexerKCache
from cpsparse.indexer import (mqa_logits_core, paged_mqa_logits_core, topk_per_row_core,
                              topk_per_row_decode_core)

__all__ = ["sparse_attn_indexer", "sparse_attn_indexer_core", "IndexerStats"]


class IndexerStats:
    """Counters of what :func:`sparse_attn_indexer` did (for tests, demos, benchmarks)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.calls = 0            # invocations
        self.skipped = 0          # short-prefill early returns
        self.scored_calls = 0     # invocations that scored (decode or prefill)
        self.decode_rows = 0      # decode query rows scored
        self.prefill_rows = 0     # prefill query rows scored
        self.prefill_chunks = 0
        self.inserted_keys = 0

    def __repr__(self):
        return ("IndexerStats(" + ", ".join(f"{k}={v}" for k, v in vars(self).items()) + ")")


def _check_indexer_call(xp, q_codes, weights, k, k_cache, metadata, buffer, skip_insert):
    """Every argument of :func:`sparse_attn_indexer`, named as the caller passed it;
    returns the uint8 view of ``q_codes``."""
    from cpsparse.metadata import check_batch
    check_batch(metadata, block_size=k_cache.block_size, num_blocks=k_cache.num_blocks,
                xp=xp, owner="k_cache")
    tokens = metadata.num_tokens
    q_codes = V.check_codes("q_codes", q_codes, ndim=3, shape_desc="[T, H, D]")
    _, heads, dim = q_codes.shape
    if dim != k_cache.head_dim:
        raise ValueError(f"Invalid shape of q_codes: expected D = {k_cache.head_dim} (the "
                         f"k_cache's head_dim), got {tuple(q_codes.shape)}")
    if q_codes.shape[0] < tokens:
        raise ValueError(f"Invalid shape of q_codes: expected at least {tokens} rows "
                         f"(the batch's tokens), got {q_codes.shape[0]}")
    V.check_array("weights", weights, ndim=2, dtype="float32", shape=(None, heads),
                  shape_desc="[T, H]")
    if weights.shape[0] < tokens:
        raise ValueError(f"Invalid shape of weights: expected at least {tokens} rows "
                         f"(the batch's tokens), got {weights.shape[0]}")
    V.check_array("topk_indices_buffer", buffer, ndim=2, dtype="int32",
                  shape_desc="[max_num_tokens, topk]")
    if buffer.shape[0] < tokens:
        raise ValueError(f"Invalid shape of topk_indices_buffer: expected at least {tokens} "
                         f"rows, got {buffer.shape[0]}")
    if buffer.shape[1] != metadata.index_topk:
        raise ValueError(f"Invalid shape of topk_indices_buffer: expected {metadata.index_topk}"
                         f" columns (the metadata's index_topk), got {tuple(buffer.shape)}")
    if not skip_insert:
        V.check_array("k", k, ndim=2, dtype=V.FLOAT_DTYPES, shape=(None, dim),
                      shape_desc="[T, D]", contiguous=False)
        if k.shape[0] < tokens:
            raise ValueError(f"Invalid shape of k: expected at least {tokens} rows (the "
                             f"batch's tokens), got {k.shape[0]}")
    return q_codes


def _check_layer_name(name, forward_context):
    """A name the forward context does not know is an error (a typo would otherwise
    silently disable the skip)."""
    if name and name not in forward_context.attn_metadata:
        raise ValueError(f"Invalid dense_mha_metadata_layer_name: {name!r} is not a layer of "
                         f"the forward context (its layers: "
                         f"{sorted(forward_context.attn_metadata)})")


def _short_prefill_skip(name, forward_context, xp):
    """Step 2 of :func:`sparse_attn_indexer` (the early return): the MLA metadata under
    ``name`` makes top-k unused (read from the metadata's one predicate, which the
    layer's route reads too)."""
    if not name:
        return False
    return (forward_context.attn_metadata[name].topk_unused
            and not _backend.is_stream_capturing(xp))


def _pad_decode(xp, a, decode, batch):
    """[num_decode_tokens, ...] -> [B * next_n, ...] with zero padding rows."""
    if not decode.requires_padding:
        return a
    out = xp.zeros((batch * decode.next_n,) + a.shape[1:], dtype=a.dtype)
    out[decode.token_rows] = a
    return out


def sparse_attn_indexer(q_codes, weights, k, k_cache, metadata, topk_indices_buffer, *,
                        skip_k_cache_insert=False, use_pcp=False,
                        dense_mha_metadata_layer_name="", skip_topk_buffer_clear=False,
                        forward_context=None, stats=None):
    """Run the lightning indexer of one layer over a batch; fill the top-k rows.

    Order of work (:doc:`the contract </contract>`, "The indexer of a layer and the
    construction-time gate"):

    1. insert the new keys ``k`` into ``k_cache`` (unless ``skip_k_cache_insert``);
    2. short-prefill early return: if ``dense_mha_metadata_layer_name`` is
       non-empty and the MLA metadata stored under it in the forward context
       says ``prefill.use_dense_mha`` with ``num_decode_tokens == 0``, and no
       CUDA graph is being captured, return at once: no scoring, no top-k, the
       buffer untouched (dense MHA will not read it);
    3. unless ``skip_topk_buffer_clear``, fill ``buffer[:num_tokens]`` with -1;
    4. decode tokens: paged scoring + decode top-k into
       ``buffer[:num_decode_tokens]``;
    5. prefill tokens: per chunk (logits under the byte budget), gather keys,
       score, top-k into the chunk's rows.

    Parameters
    ----------
    q_codes : uint8 [T, H, D]
        Quantized indexer queries of the batch's tokens.
    weights : float32 [T, H]
        Head weights with the query scales folded in (:func:`fold_weights`).
    k : float [T, D]
        New indexer keys (after norm, RoPE and rotation), quantized on insert.
    k_cache : IndexerKCache
    metadata : cpsparse.metadata.BatchMetadata
    topk_indices_buffer : int32 [max_num_tokens, topk]
        Shared by the layers of a forward pass; rows hold request-local positions.
    skip_k_cache_insert : bool
        The keys are already in the cache (e.g. a fused insert ran earlier).
    use_pcp : bool
        Prefill context parallelism. cpsparse runs in one process, so there is
        no key all-gather to do; the flag matters to the layer's construction
        gate (a PCP layer never passes a dense-MHA layer name).
    dense_mha_metadata_layer_name : str
        The MLA layer whose metadata may allow the early return; "" disables it.
        The layer decides this once, at construction (the gate); the indexer
        only obeys the name.
    skip_topk_buffer_clear : bool
        The caller already cleared ``buffer[:num_tokens]``.
    forward_context : cpsparse.metadata.ForwardContext, optional
        Default: the current one (:func:`cpsparse.metadata.set_forward_context`).
    stats : IndexerStats, optional
        Counters to update.

    Returns
    -------
    topk_indices_buffer
    """
    if not isinstance(k_cache, IndexerKCache):
        raise TypeError(f"Invalid type of k_cache: expected IndexerKCache, got "
                        f"{type(k_cache).__qualname__}")
    xp = _backend.get_array_module(q_codes=q_codes, weights=weights,
                                   k=None if skip_k_cache_insert else k,
                                   topk_indices_buffer=topk_indices_buffer,
                                   k_cache=k_cache.data)
    # Every check runs before the first write (key insert, buffer clear): a call that
    # raises leaves the cache and the buffer as they were. Value checks read the
    # metadata's host copies, so they cost no device sync.
    q_codes = _check_indexer_call(xp, q_codes, weights, k, k_cache, metadata,
                                  topk_indices_buffer, skip_k_cache_insert)
    if dense_mha_metadata_layer_name and forward_context is None:
        from cpsparse.metadata import get_forward_context
        forward_context = get_forward_context()
    _check_layer_name(dense_mha_metadata_layer_name, forward_context)
    return sparse_attn_indexer_core(
        xp, q_codes, weights, k, k_cache, metadata,
        topk_indices_buffer, skip_k_cache_insert=skip_k_cache_insert, use_pcp=use_pcp,
        dense_mha_metadata_layer_name=dense_mha_metadata_layer_name,
        skip_topk_buffer_clear=skip_topk_buffer_clear, forward_context=forward_context,
        stats=stats)


def sparse_attn_indexer_core(xp, q_codes, weights, k, k_cache, metadata, topk_indices_buffer,
                             *, skip_k_cache_insert, use_pcp, dense_mha_metadata_layer_name,
                             skip_topk_buffer_clear, forward_context, stats, query_rows=None):
    """:func:`sparse_attn_indexer` on arguments already validated (the layer checks its
    batch once per forward and calls this): no checks, no host reads. ``use_pcp`` has no
    effect in one process (see :func:`sparse_attn_indexer`).

    ``query_rows`` (prefill context parallelism, a prefill-only batch): host int64, the
    sorted batch tokens this rank scores; ``q_codes`` and ``weights`` hold those rows
    only, ``k`` every token's key (gathered), and only those rows of the buffer are
    written (the others are left -1)."""
    _, heads, dim = q_codes.shape
    skip = _short_prefill_skip(dense_mha_metadata_layer_name, forward_context, xp)
    tokens = metadata.num_tokens
    topk = topk_indices_buffer.shape[1]
    stats = stats if stats is not None else IndexerStats()
    stats.calls += 1

    if not skip_k_cache_insert:
        k_cache.insert_core(xp, xp.ascontiguousarray(k[:tokens]), metadata.slot_mapping)
        stats.inserted_keys += tokens

    if skip:
        stats.skipped += 1
        return topk_indices_buffer

    if not skip_topk_buffer_clear:
        topk_indices_buffer[:tokens] = -1
    if tokens:
        stats.scored_calls += 1

    decode = metadata.decode
    if decode is not None and metadata.num_decode_tokens:
        nd, batch, next_n = metadata.num_decode_tokens, metadata.num_decodes, decode.next_n
        q_dec = _pad_decode(xp, q_codes[:nd], decode, batch).reshape(batch, next_n, heads, dim)
        w_dec = _pad_decode(xp, weights[:nd], decode, batch)
        # (the top-k reads only the rows' windows: nothing past them is written)
        logits = paged_mqa_logits_core(xp, xp.ascontiguousarray(q_dec), k_cache,
                                       xp.ascontiguousarray(w_dec), decode.context_lens,
                                       decode.block_table, decode.max_context_len,
                                       clean_logits=False)
        if decode.requires_padding:
            rows = topk_per_row_decode_core(xp, logits, decode.context_lens, next_n, topk,
                                            xp.empty((logits.shape[0], topk), xp.int32))
            topk_indices_buffer[:nd] = rows[decode.token_rows]
        else:
            topk_per_row_decode_core(xp, logits, decode.context_lens, next_n, topk,
                                     topk_indices_buffer[:nd])
        stats.decode_rows += nd

    if metadata.prefill is not None:
        for chunk in metadata.prefill.chunks:
            t0, t1 = chunk.token_start, chunk.token_end
            if query_rows is None:
                lo, hi, ks, ke = t0, t1, chunk.ks, chunk.ke
            else:       # this rank's rows of the chunk: local rows [lo, hi) of q_codes
                lo, hi = (int(i) for i in numpy.searchsorted(query_rows, (t0, t1)))
                if lo == hi:
                    continue
                mine = xp.asarray(query_rows[lo:hi])
                ks, ke = chunk.ks[mine - t0], chunk.ke[mine - t0]
            codes, scales = k_cache.gather_core(xp, chunk.block_table, chunk.cu_seq_lens,
                                                chunk.cu_seq_lens_host, chunk.key_req_ids)
            logits = mqa_logits_core(xp, xp.ascontiguousarray(q_codes[lo:hi]), codes, scales,
                                     xp.ascontiguousarray(weights[lo:hi]), ks, ke)
            if query_rows is None:
                topk_per_row_core(xp, logits, ks, ke, topk, topk_indices_buffer[t0:t1])
            else:
                topk_indices_buffer[mine] = topk_per_row_core(xp, logits, ks, ke, topk, None)
            stats.prefill_rows += hi - lo
            stats.prefill_chunks += 1
    return topk_indices_buffer
