"""Every public op refuses bad input with a TypeError/ValueError that names the argument.

DESIGN.md section 11: wrong dtype -> TypeError, wrong ndim/shape/layout ->
ValueError, non-array -> TypeError, bad values (k <= 0, ks > ke, ke > N, block
table too short, page id or slot out of range, ...) -> ValueError, all before
any work. Each case below starts from a call that succeeds
(``test_baseline_succeeds``) and changes exactly one argument.
"""

import re

import numpy as np
import pytest

import cpsparse
from cpsparse import IndexerKCache, MLAKVCache
from cpsparse.attention import (dense_mla_attention, local_to_global_slots,
                                sparse_mla_attention)
from cpsparse.indexer import (fold_weights, hadamard_rotate, mqa_logits, paged_mqa_logits,
                              topk_per_row, topk_per_row_decode)


# ---- helpers -----------------------------------------------------------------------

def noncontig(a):
    """Same shape, dtype and values, but not C-contiguous."""
    a = np.asarray(a)
    big = np.empty(a.shape[:-1] + (2 * a.shape[-1],), dtype=a.dtype)
    big[..., ::2] = a
    out = big[..., ::2]
    assert out.shape == a.shape and not out.flags.c_contiguous
    return out


def rng():
    return np.random.default_rng(7)


def u8(shape):
    return rng().integers(0, 0x70, size=shape, dtype=np.uint8)


def f32(shape):
    return rng().standard_normal(shape).astype(np.float32)


def i32(values):
    return np.array(values, dtype=np.int32)


# ---- baselines: one valid call per op ----------------------------------------------

def b_quantize():
    return dict(x=f32((2, 256)), block_size=128, scale_fmt="ue8m0", eps=1e-4)


def b_dequantize():
    codes, scales = cpsparse.quantize_fp8(f32((2, 256)))
    return dict(codes=codes, scales=scales, block_size=128)


def b_hadamard():
    return dict(x=f32((3, 16)))


def b_fold():
    return dict(weights=f32((4, 8)), q_scales=np.abs(f32((4, 8))), head_dim=128)


def b_mqa():
    return dict(q_codes=u8((3, 8, 32)), k_codes=u8((5, 32)), k_scales=np.ones(5, np.float32),
                weights=f32((3, 8)), ks=i32([0, 0, 1]), ke=i32([3, 4, 5]))


def _filled_indexer_cache(nb=6, bs=16, d=32):
    cache = IndexerKCache(num_blocks=nb, block_size=bs, head_dim=d)
    cache.insert(f32((nb * bs, d)), np.arange(nb * bs, dtype=np.int32))
    return cache


def b_paged():
    return dict(q_codes=u8((2, 2, 8, 32)), cache=_filled_indexer_cache(), weights=f32((4, 8)),
                context_lens=i32([20, 5]), block_table=i32([[0, 1, 2], [3, 4, 5]]),
                max_context_len=24)


def b_topk():
    return dict(logits=f32((3, 10)), row_starts=i32([0, 2, 0]), row_ends=i32([10, 7, 3]), k=4,
                out=None)


def b_topk_decode():
    return dict(logits=f32((4, 12)), context_lens=i32([10, 12]), next_n=2, k=4, out=None)


def _filled_mla_cache(nb=2, bs=16, lora=128, rope=64):
    cache = MLAKVCache(num_blocks=nb, block_size=bs, kv_lora_rank=lora, rope_dim=rope)
    n = nb * bs
    cache.insert(f32((n, lora)), f32((n, rope)), np.arange(n, dtype=np.int32))
    return cache


def b_sparse():
    return dict(q=f32((2, 4, 192)), kv_cache=_filled_mla_cache(),
                indices=i32([[0, 5, -1], [31, -1, -1]]), sm_scale=0.1, d_v=None)


def b_dense():
    return dict(q=f32((5, 2, 96)), kv=f32((7, 96)), sm_scale=0.1, cu_seqlens_q=i32([0, 2, 5]),
                cu_seqlens_k=i32([0, 3, 7]), d_v=32)


def b_l2g():
    return dict(indices=i32([[0, 65, -1], [3, -1, -1]]), req_ids=i32([0, 1]),
                block_table=i32([[7, 3], [1, 2]]), block_size=64)


def b_icache_new():
    return dict(num_blocks=4, block_size=16, head_dim=32, xp=np, scale_fmt="ue8m0")


def b_icache_wrap():
    return dict(data=np.zeros((4, 16 * 36), np.uint8), block_size=16, head_dim=32,
                scale_fmt="ue8m0")


def b_icache_insert():
    return dict(cache=IndexerKCache(4, 16, 32), k=f32((3, 32)), slot_mapping=i32([0, -1, 63]))


def b_icache_insert_q():
    return dict(cache=IndexerKCache(4, 16, 32), codes=u8((3, 32)),
                scales=np.ones(3, np.float32), slot_mapping=i32([0, -1, 63]))


def b_icache_gather():
    return dict(cache=_filled_indexer_cache(nb=4), block_table=i32([[3, 1, 0], [2, 0, 0]]),
                cu_seq_lens=i32([0, 40, 56]))


def b_mcache_new():
    return dict(num_blocks=2, block_size=16, kv_lora_rank=128, rope_dim=64, xp=np)


def b_mcache_wrap():
    return dict(data=np.zeros((2, 16, 260), np.uint8), kv_lora_rank=128, rope_dim=64)


def b_mcache_insert():
    return dict(cache=MLAKVCache(2, 16, 128, 64), kv_c=f32((3, 128)), k_pe=f32((3, 64)),
                slot_mapping=i32([0, -1, 31]))


def b_mcache_gather():
    return dict(cache=_filled_mla_cache(), slots=i32([0, 31, 7]))


def _method(name):
    def call(**kw):
        cache = kw.pop("cache")
        return getattr(cache, name)(**kw)
    return call


OPS = {
    "quantize_fp8": (b_quantize, cpsparse.quantize_fp8),
    "dequantize_fp8": (b_dequantize, cpsparse.dequantize_fp8),
    "hadamard_rotate": (b_hadamard, hadamard_rotate),
    "fold_weights": (b_fold, fold_weights),
    "mqa_logits": (b_mqa, mqa_logits),
    "paged_mqa_logits": (b_paged, paged_mqa_logits),
    "topk_per_row": (b_topk, topk_per_row),
    "topk_per_row_decode": (b_topk_decode, topk_per_row_decode),
    "sparse_mla_attention": (b_sparse, sparse_mla_attention),
    "dense_mla_attention": (b_dense, dense_mla_attention),
    "local_to_global_slots": (b_l2g, local_to_global_slots),
    "IndexerKCache": (b_icache_new, IndexerKCache),
    "IndexerKCache.wrap": (b_icache_wrap, IndexerKCache.wrap),
    "IndexerKCache.insert": (b_icache_insert, _method("insert")),
    "IndexerKCache.insert_quantized": (b_icache_insert_q, _method("insert_quantized")),
    "IndexerKCache.gather": (b_icache_gather, _method("gather")),
    "MLAKVCache": (b_mcache_new, MLAKVCache),
    "MLAKVCache.wrap": (b_mcache_wrap, MLAKVCache.wrap),
    "MLAKVCache.insert": (b_mcache_insert, _method("insert")),
    "MLAKVCache.gather": (b_mcache_gather, _method("gather")),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_baseline_succeeds(op):
    build, call = OPS[op]
    call(**build())


# ---- mutations --------------------------------------------------------------------

def put(name, value):
    """Replace argument ``name`` with ``value`` (a callable gets the old value)."""
    def mutate(kw):
        kw[name] = value(kw[name]) if callable(value) else value
    return mutate


def astype(name, dtype):
    return put(name, lambda a: a.astype(dtype))


def tolist(name):
    return put(name, lambda a: a.tolist())


def nc(name):
    return put(name, noncontig)


def item(name, index, value):
    def mutate(kw):
        a = kw[name].copy()
        a[index] = value
        kw[name] = a
    return mutate


def drop(name):
    def mutate(kw):
        del kw[name]
    return mutate


def word(name):
    """The argument's name as a whole word (so "k" does not match "keys")."""
    return r"(?<![\w.])" + re.escape(name) + r"(?![\w])"


# (op, argument named in the message, mutation, exception, extra regex or None)
T, V = TypeError, ValueError
CASES = [
    # quantize_fp8
    ("quantize_fp8", "x", tolist("x"), T, "type"),
    ("quantize_fp8", "x", astype("x", np.int32), T, "dtype"),
    ("quantize_fp8", "x", astype("x", np.complex64), T, "dtype"),
    ("quantize_fp8", "x", nc("x"), V, "C-contiguous"),
    ("quantize_fp8", "x", put("x", np.array(1.0, np.float32)), V, "dimension"),
    ("quantize_fp8", "x", put("x", f32((2, 200))), V, "multiple"),
    ("quantize_fp8", "x", put("x", None), T, None),
    ("quantize_fp8", "block_size", put("block_size", 0), V, "positive"),
    ("quantize_fp8", "block_size", put("block_size", -128), V, "positive"),
    ("quantize_fp8", "block_size", put("block_size", 1.5), T, None),
    ("quantize_fp8", "block_size", put("block_size", True), T, None),
    ("quantize_fp8", "block_size", put("block_size", 96), V, "multiple"),
    ("quantize_fp8", "scale_fmt", put("scale_fmt", "ue8m1"), V, "ue8m0"),
    ("quantize_fp8", "scale_fmt", put("scale_fmt", "fp32"), V, None),
    ("quantize_fp8", "eps", put("eps", 0.0), V, None),
    ("quantize_fp8", "eps", put("eps", -1e-4), V, None),
    ("quantize_fp8", "eps", put("eps", float("nan")), V, None),
    ("quantize_fp8", "eps", put("eps", float("inf")), V, None),
    ("quantize_fp8", "eps", put("eps", None), (T, V), None),
    ("quantize_fp8", "eps", put("eps", "1e-4"), (T, V), None),
    # dequantize_fp8
    ("dequantize_fp8", "codes", astype("codes", np.float32), T, "dtype"),
    ("dequantize_fp8", "codes", astype("codes", np.int8), T, "dtype"),
    ("dequantize_fp8", "codes", tolist("codes"), T, None),
    ("dequantize_fp8", "codes", nc("codes"), V, "C-contiguous"),
    ("dequantize_fp8", "codes", put("codes", np.zeros((2, 200), np.uint8)), V, "multiple"),
    ("dequantize_fp8", "codes", put("codes", np.zeros((), np.uint8)), V, "dimension"),
    ("dequantize_fp8", "scales", astype("scales", np.float64), T, "dtype"),
    ("dequantize_fp8", "scales", put("scales", np.ones((2, 3), np.float32)), V, "shape"),
    ("dequantize_fp8", "scales", put("scales", np.ones((2,), np.float32)), V, "shape"),
    ("dequantize_fp8", "scales", put("scales", np.ones((3, 2), np.float32)), V, "shape"),
    ("dequantize_fp8", "scales", nc("scales"), V, "C-contiguous"),
    ("dequantize_fp8", "scales", tolist("scales"), T, None),
    ("dequantize_fp8", "scales", put("scales", None), T, None),
    ("dequantize_fp8", "block_size", put("block_size", 0), V, None),
    ("dequantize_fp8", "block_size", put("block_size", "128"), T, None),
    # hadamard_rotate
    ("hadamard_rotate", "x", tolist("x"), T, None),
    ("hadamard_rotate", "x", astype("x", np.int64), T, "dtype"),
    ("hadamard_rotate", "x", put("x", f32((3, 12))), V, "power of two"),
    ("hadamard_rotate", "x", put("x", f32((3, 0))), V, "power of two"),
    ("hadamard_rotate", "x", put("x", np.ones((), np.float32)), V, None),
    ("hadamard_rotate", "x", put("x", None), T, None),
    # fold_weights
    ("fold_weights", "weights", astype("weights", np.float64), T, "dtype"),
    ("fold_weights", "weights", put("weights", f32((4, 8, 1))), V, "shape"),
    ("fold_weights", "weights", put("weights", f32((32,))), V, "shape"),
    ("fold_weights", "weights", nc("weights"), V, "C-contiguous"),
    ("fold_weights", "weights", tolist("weights"), T, None),
    ("fold_weights", "q_scales", put("q_scales", f32((4, 7))), V, "shape"),
    ("fold_weights", "q_scales", put("q_scales", f32((4, 8, 2))), V, "shape"),
    ("fold_weights", "q_scales", put("q_scales", f32((8, 4))), V, "shape"),
    ("fold_weights", "q_scales", astype("q_scales", np.float64), T, "dtype"),
    ("fold_weights", "q_scales", put("q_scales", None), T, None),
    ("fold_weights", "q_scales", tolist("q_scales"), T, None),
    ("fold_weights", "head_dim", put("head_dim", 0), V, None),
    ("fold_weights", "head_dim", put("head_dim", -128), V, None),
    ("fold_weights", "head_dim", put("head_dim", 128.0), T, None),
    # mqa_logits
    ("mqa_logits", "q_codes", astype("q_codes", np.float32), T, "dtype"),
    ("mqa_logits", "q_codes", put("q_codes", u8((3, 256))), V, "shape"),
    ("mqa_logits", "q_codes", put("q_codes", u8((1, 3, 8, 32))), V, "shape"),
    ("mqa_logits", "q_codes", nc("q_codes"), V, "C-contiguous"),
    ("mqa_logits", "q_codes", tolist("q_codes"), T, None),
    ("mqa_logits", "k_codes", put("k_codes", u8((5, 16))), V, "shape"),
    ("mqa_logits", "k_codes", put("k_codes", u8((5, 1, 32))), V, "shape"),
    ("mqa_logits", "k_codes", astype("k_codes", np.int8), T, "dtype"),
    ("mqa_logits", "k_codes", nc("k_codes"), V, "C-contiguous"),
    ("mqa_logits", "k_scales", put("k_scales", np.ones(4, np.float32)), V, "shape"),
    ("mqa_logits", "k_scales", put("k_scales", np.ones((5, 2), np.float32)), V, "shape"),
    ("mqa_logits", "k_scales", astype("k_scales", np.float64), T, "dtype"),
    ("mqa_logits", "k_scales", nc("k_scales"), V, "C-contiguous"),
    ("mqa_logits", "weights", put("weights", f32((3, 4))), V, "shape"),
    ("mqa_logits", "weights", put("weights", f32((2, 8))), V, "shape"),
    ("mqa_logits", "weights", astype("weights", np.float16), T, "dtype"),
    ("mqa_logits", "weights", nc("weights"), V, "C-contiguous"),
    ("mqa_logits", "ks", astype("ks", np.uint32), T, "dtype"),
    ("mqa_logits", "ks", put("ks", i32([0, 0])), V, "shape"),
    ("mqa_logits", "ks", tolist("ks"), T, None),
    ("mqa_logits", "ke", astype("ke", np.uint32), T, "dtype"),
    ("mqa_logits", "ke", put("ke", i32([[3, 4, 5]])), V, "shape"),
    ("mqa_logits", "ke", nc("ke"), V, "C-contiguous"),
    ("mqa_logits", "ks", item("ks", 1, 5), V, r"ks\[1\]=5 > ke\[1\]=4"),
    ("mqa_logits", "ke", item("ke", 2, 6), V, r"ke\[2\]=6"),
    ("mqa_logits", "ks", item("ks", 0, -1), V, r"ks\[0\]=-1"),
    # paged_mqa_logits
    ("paged_mqa_logits", "q_codes", put("q_codes", u8((2, 8, 32))), V, "shape"),
    ("paged_mqa_logits", "q_codes", astype("q_codes", np.float32), T, "dtype"),
    ("paged_mqa_logits", "q_codes", nc("q_codes"), V, "C-contiguous"),
    ("paged_mqa_logits", "cache", put("cache", IndexerKCache(6, 16, 64)), V, "head_dim"),
    ("paged_mqa_logits", "cache", put("cache", np.zeros((6, 100), np.uint8)), V, "shape"),
    ("paged_mqa_logits", "cache", put("cache", "cache"), T, None),
    ("paged_mqa_logits", "cache", put("cache", [[0] * 576] * 6), T, None),
    ("paged_mqa_logits", "weights", put("weights", f32((2, 8))), V, "shape"),
    ("paged_mqa_logits", "weights", put("weights", f32((4, 16))), V, "shape"),
    ("paged_mqa_logits", "weights", astype("weights", np.float64), T, "dtype"),
    ("paged_mqa_logits", "context_lens", put("context_lens", i32([20, 5, 1])), V, "shape"),
    ("paged_mqa_logits", "context_lens", put("context_lens", i32([[20, 5, 1]] * 2)), V, "shape"),
    ("paged_mqa_logits", "context_lens", astype("context_lens", np.uint32), T, "dtype"),
    ("paged_mqa_logits", "context_lens", item("context_lens", 1, -3), V, ">= 0"),
    ("paged_mqa_logits", "block_table", put("block_table", i32([[0, 1, 2]] * 3)), V, "shape"),
    ("paged_mqa_logits", "block_table", put("block_table", i32([0, 1, 2])), V, "shape"),
    ("paged_mqa_logits", "block_table", astype("block_table", np.uint32), T, "dtype"),
    ("paged_mqa_logits", "block_table", nc("block_table"), V, "C-contiguous"),
    ("paged_mqa_logits", "block_table", put("block_table", i32([[0], [3]])), V,
     "needs 2 blocks"),
    ("paged_mqa_logits", "block_table", item("block_table", (0, 1), 6), V, "page id 6"),
    ("paged_mqa_logits", "block_table", item("block_table", (1, 0), -1), V, "page id -1"),
    ("paged_mqa_logits", "max_context_len", put("max_context_len", 19), V, "20"),
    ("paged_mqa_logits", "max_context_len", put("max_context_len", -1), V, None),
    ("paged_mqa_logits", "max_context_len", put("max_context_len", 24.0), T, None),
    # topk_per_row
    ("topk_per_row", "k", put("k", 0), V, "positive"),
    ("topk_per_row", "k", put("k", -4), V, "positive"),
    ("topk_per_row", "k", put("k", 2.0), T, None),
    ("topk_per_row", "k", put("k", True), T, None),
    ("topk_per_row", "logits", astype("logits", np.float64), T, "dtype"),
    ("topk_per_row", "logits", put("logits", f32((30,))), V, "shape"),
    ("topk_per_row", "logits", nc("logits"), V, "C-contiguous"),
    ("topk_per_row", "logits", tolist("logits"), T, None),
    ("topk_per_row", "row_starts", put("row_starts", i32([0, 2])), V, "shape"),
    ("topk_per_row", "row_starts", astype("row_starts", np.uint32), T, "dtype"),
    ("topk_per_row", "row_starts", item("row_starts", 2, 4), V, r"row_starts\[2\]=4"),
    ("topk_per_row", "row_starts", item("row_starts", 0, -2), V, ">= 0"),
    ("topk_per_row", "row_ends", item("row_ends", 1, 11), V, r"<= 10"),
    ("topk_per_row", "row_ends", astype("row_ends", np.int16), T, "dtype"),
    ("topk_per_row", "out", put("out", np.empty((3, 5), np.int32)), V, "shape"),
    ("topk_per_row", "out", put("out", np.empty((3, 4), np.int64)), T, "dtype"),
    ("topk_per_row", "out", put("out", noncontig(np.empty((3, 4), np.int32))), V,
     "C-contiguous"),
    ("topk_per_row", "out", put("out", [[0] * 4] * 3), T, None),
    # topk_per_row_decode
    ("topk_per_row_decode", "k", put("k", 0), V, None),
    ("topk_per_row_decode", "next_n", put("next_n", 0), V, None),
    ("topk_per_row_decode", "next_n", put("next_n", 3), V, "next_n=3"),
    ("topk_per_row_decode", "logits", astype("logits", np.float16), T, "dtype"),
    ("topk_per_row_decode", "logits", put("logits", f32((2, 2, 12))), V, "shape"),
    ("topk_per_row_decode", "logits", put("logits", f32((4, 11))), V, "11"),
    ("topk_per_row_decode", "context_lens", put("context_lens", i32([10, 12, 3])), V, "shape"),
    ("topk_per_row_decode", "context_lens", astype("context_lens", np.uint32), T, "dtype"),
    ("topk_per_row_decode", "context_lens", item("context_lens", 0, -1), V, ">= 0"),
    ("topk_per_row_decode", "out", put("out", np.empty((4, 3), np.int32)), V, "shape"),
    # sparse_mla_attention
    ("sparse_mla_attention", "q", astype("q", np.int32), T, "dtype"),
    ("sparse_mla_attention", "q", put("q", f32((2, 192))), V, "shape"),
    ("sparse_mla_attention", "q", nc("q"), V, "C-contiguous"),
    ("sparse_mla_attention", "q", tolist("q"), T, None),
    ("sparse_mla_attention", "kv_cache", put("kv_cache", MLAKVCache(2, 16)), V, "576"),
    ("sparse_mla_attention", "kv_cache", put("kv_cache", np.zeros((32, 260), np.uint8)), V,
     "shape"),
    ("sparse_mla_attention", "kv_cache", put("kv_cache", np.zeros((2, 16, 300), np.uint8)), V,
     "token_bytes"),
    ("sparse_mla_attention", "kv_cache", put("kv_cache", f32((32, 100))), V, "shape"),
    ("sparse_mla_attention", "kv_cache", put("kv_cache", np.zeros((32, 192), np.int32)), T,
     "dtype"),
    ("sparse_mla_attention", "kv_cache", put("kv_cache", noncontig(f32((32, 192)))), V,
     "C-contiguous"),
    ("sparse_mla_attention", "kv_cache", put("kv_cache", "cache"), T, None),
    ("sparse_mla_attention", "d_v", put("d_v", 0), V, None),
    ("sparse_mla_attention", "d_v", put("d_v", 193), V, "192"),
    ("sparse_mla_attention", "d_v", put("d_v", 1.5), T, None),
    ("sparse_mla_attention", "indices", astype("indices", np.uint32), T, "dtype"),
    ("sparse_mla_attention", "indices", put("indices", i32([[0, 1, 2]] * 3)), V, "shape"),
    ("sparse_mla_attention", "indices", put("indices", i32([0, 1])), V, "shape"),
    ("sparse_mla_attention", "indices", nc("indices"), V, "C-contiguous"),
    ("sparse_mla_attention", "indices", item("indices", (1, 1), 32), V, "32"),
    ("sparse_mla_attention", "indices", item("indices", (0, 2), -2), V, "-2"),
    ("sparse_mla_attention", "sm_scale", put("sm_scale", float("nan")), V, None),
    ("sparse_mla_attention", "sm_scale", put("sm_scale", float("inf")), V, None),
    ("sparse_mla_attention", "sm_scale", put("sm_scale", "0.1"), (T, V), None),
    ("sparse_mla_attention", "sm_scale", put("sm_scale", None), (T, V), None),
    # dense_mla_attention
    ("dense_mla_attention", "q", put("q", f32((5, 96))), V, "shape"),
    ("dense_mla_attention", "q", astype("q", np.uint8), T, "dtype"),
    ("dense_mla_attention", "kv", put("kv", f32((7, 95))), V, "shape"),
    ("dense_mla_attention", "kv", astype("kv", np.int32), T, "dtype"),
    ("dense_mla_attention", "kv", nc("kv"), V, "C-contiguous"),
    ("dense_mla_attention", "kv", tolist("kv"), T, None),
    ("dense_mla_attention", "cu_seqlens", put("cu_seqlens_k", None), V, "cu_seqlens_q"),
    ("dense_mla_attention", "cu_seqlens_q", item("cu_seqlens_q", 2, 4), V, "5"),
    ("dense_mla_attention", "cu_seqlens_q", item("cu_seqlens_q", 0, 1), V, r"\[0\]"),
    ("dense_mla_attention", "cu_seqlens_q", astype("cu_seqlens_q", np.uint32), T, "dtype"),
    ("dense_mla_attention", "cu_seqlens_q", put("cu_seqlens_q", i32([[0, 2, 5]])), V, "shape"),
    ("dense_mla_attention", "cu_seqlens_k", put("cu_seqlens_k", i32([0, 8, 7])), V,
     "non-decreasing"),
    ("dense_mla_attention", "cu_seqlens_k", put("cu_seqlens_k", i32([0, 3, 5, 7])), V, "shape"),
    ("dense_mla_attention", "cu_seqlens_k", item("cu_seqlens_k", 2, 6), V, "7"),
    ("dense_mla_attention", "d_v", put("d_v", 97), V, None),
    ("dense_mla_attention", "d_v", put("d_v", -1), V, None),
    ("dense_mla_attention", "sm_scale", put("sm_scale", float("-inf")), V, None),
    # local_to_global_slots
    ("local_to_global_slots", "indices", astype("indices", np.uint32), T, "dtype"),
    ("local_to_global_slots", "indices", put("indices", i32([0, 65, -1])), V, "shape"),
    ("local_to_global_slots", "indices", item("indices", (1, 1), 128), V, "128"),
    ("local_to_global_slots", "indices", item("indices", (1, 1), -2), V, "-2"),
    ("local_to_global_slots", "indices", nc("indices"), V, "C-contiguous"),
    ("local_to_global_slots", "req_ids", put("req_ids", i32([0, 1, 1])), V, "shape"),
    ("local_to_global_slots", "req_ids", item("req_ids", 1, 2), V, "2"),
    ("local_to_global_slots", "req_ids", item("req_ids", 0, -1), V, "-1"),
    ("local_to_global_slots", "req_ids", astype("req_ids", np.uint32), T, "dtype"),
    ("local_to_global_slots", "block_table", put("block_table", i32([7, 3])), V, "shape"),
    ("local_to_global_slots", "block_table", astype("block_table", np.float32), T, "dtype"),
    ("local_to_global_slots", "block_size", put("block_size", 0), V, None),
    ("local_to_global_slots", "block_size", put("block_size", 64.0), T, None),
    # IndexerKCache(...)
    ("IndexerKCache", "num_blocks", put("num_blocks", -1), V, None),
    ("IndexerKCache", "num_blocks", put("num_blocks", 2.5), T, None),
    ("IndexerKCache", "head_dim", put("head_dim", 0), V, None),
    ("IndexerKCache", "head_dim", put("head_dim", "128"), T, None),
    ("IndexerKCache", "block_size", put("block_size", 0), V, None),
    ("IndexerKCache", "xp", put("xp", "torch"), V, None),
    ("IndexerKCache", "scale_fmt", put("scale_fmt", "e8m0"), V, None),
    # IndexerKCache.wrap
    ("IndexerKCache.wrap", "data", astype("data", np.float32), T, "dtype"),
    ("IndexerKCache.wrap", "data", astype("data", np.int8), T, "dtype"),
    ("IndexerKCache.wrap", "data", put("data", np.zeros((4, 16, 40), np.uint8)), V, "shape"),
    ("IndexerKCache.wrap", "data", put("data", np.zeros((4, 100), np.uint8)), V, "shape"),
    ("IndexerKCache.wrap", "data", nc("data"), V, "C-contiguous"),
    ("IndexerKCache.wrap", "data", tolist("data"), T, None),
    ("IndexerKCache.wrap", "scale_fmt", put("scale_fmt", "fp8"), V, None),
    # IndexerKCache.insert
    ("IndexerKCache.insert", "k", astype("k", np.int32), T, "dtype"),
    ("IndexerKCache.insert", "k", put("k", f32((96,))), V, "shape"),
    ("IndexerKCache.insert", "k", put("k", f32((3, 64))), V, "shape"),
    ("IndexerKCache.insert", "k", nc("k"), V, "C-contiguous"),
    ("IndexerKCache.insert", "k", tolist("k"), T, None),
    ("IndexerKCache.insert", "slot_mapping", astype("slot_mapping", np.uint32), T, "dtype"),
    ("IndexerKCache.insert", "slot_mapping", put("slot_mapping", i32([0, 1])), V, "shape"),
    ("IndexerKCache.insert", "slot_mapping", item("slot_mapping", 2, 64), V, "64"),
    ("IndexerKCache.insert", "slot_mapping", item("slot_mapping", 1, -2), V, "-2"),
    ("IndexerKCache.insert", "slot_mapping", nc("slot_mapping"), V, "C-contiguous"),
    ("IndexerKCache.insert", "slot_mapping", tolist("slot_mapping"), T, None),
    # IndexerKCache.insert_quantized
    ("IndexerKCache.insert_quantized", "codes", astype("codes", np.float32), T, "dtype"),
    ("IndexerKCache.insert_quantized", "codes", put("codes", u8((3, 16))), V, "shape"),
    ("IndexerKCache.insert_quantized", "scales", put("scales", np.ones(2, np.float32)), V,
     "shape"),
    ("IndexerKCache.insert_quantized", "scales", put("scales", np.ones((3, 1), np.float32)), V,
     "shape"),
    ("IndexerKCache.insert_quantized", "scales", astype("scales", np.float64), T, "dtype"),
    ("IndexerKCache.insert_quantized", "slot_mapping", item("slot_mapping", 0, 1000), V,
     "1000"),
    # IndexerKCache.gather
    ("IndexerKCache.gather", "block_table", astype("block_table", np.uint32), T, "dtype"),
    ("IndexerKCache.gather", "block_table", put("block_table", i32([3, 1, 0])), V, "shape"),
    ("IndexerKCache.gather", "block_table", nc("block_table"), V, "C-contiguous"),
    ("IndexerKCache.gather", "cu_seq_lens", put("cu_seq_lens", i32([0, 40])), V, "shape"),
    ("IndexerKCache.gather", "cu_seq_lens", astype("cu_seq_lens", np.uint32), T, "dtype"),
    ("IndexerKCache.gather", "cu_seq_lens", item("cu_seq_lens", 0, 2), V, r"\[0\]"),
    ("IndexerKCache.gather", "cu_seq_lens", item("cu_seq_lens", 2, 30), V, "non-decreasing"),
    ("IndexerKCache.gather", "block_table", item("cu_seq_lens", 2, 100), V, "needs 4 blocks"),
    ("IndexerKCache.gather", "block_table", item("block_table", (0, 2), 4), V, "page id 4"),
    ("IndexerKCache.gather", "block_table", item("block_table", (1, 0), -1), V, "page id -1"),
    # MLAKVCache(...)
    ("MLAKVCache", "num_blocks", put("num_blocks", -1), V, None),
    ("MLAKVCache", "block_size", put("block_size", 0), V, None),
    ("MLAKVCache", "block_size", put("block_size", 16.0), T, None),
    ("MLAKVCache", "kv_lora_rank", put("kv_lora_rank", 0), V, None),
    ("MLAKVCache", "rope_dim", put("rope_dim", -1), V, None),
    ("MLAKVCache", "xp", put("xp", object()), V, None),
    # MLAKVCache.wrap
    ("MLAKVCache.wrap", "data", put("data", np.zeros((2, 16, 656), np.uint8)), V, "shape"),
    ("MLAKVCache.wrap", "data", put("data", np.zeros((32, 260), np.uint8)), V, "shape"),
    ("MLAKVCache.wrap", "data", astype("data", np.float32), T, "dtype"),
    ("MLAKVCache.wrap", "data", nc("data"), V, "C-contiguous"),
    # MLAKVCache.insert
    ("MLAKVCache.insert", "kv_c", put("kv_c", f32((3, 256))), V, "shape"),
    ("MLAKVCache.insert", "kv_c", astype("kv_c", np.int32), T, "dtype"),
    ("MLAKVCache.insert", "kv_c", nc("kv_c"), V, "C-contiguous"),
    ("MLAKVCache.insert", "k_pe", put("k_pe", f32((3, 32))), V, "shape"),
    ("MLAKVCache.insert", "k_pe", put("k_pe", f32((2, 64))), V, "shape"),
    ("MLAKVCache.insert", "k_pe", astype("k_pe", np.uint16), T, "dtype"),
    ("MLAKVCache.insert", "k_pe", tolist("k_pe"), T, None),
    ("MLAKVCache.insert", "slot_mapping", item("slot_mapping", 2, 32), V, "32"),
    ("MLAKVCache.insert", "slot_mapping", astype("slot_mapping", np.uint32), T, "dtype"),
    # MLAKVCache.gather
    ("MLAKVCache.gather", "slots", item("slots", 1, -1), V, "-1"),
    ("MLAKVCache.gather", "slots", item("slots", 1, 32), V, "32"),
    ("MLAKVCache.gather", "slots", astype("slots", np.uint32), T, "dtype"),
    ("MLAKVCache.gather", "slots", put("slots", i32([[0, 1]])), V, "shape"),
    ("MLAKVCache.gather", "slots", tolist("slots"), T, None),
]


def _case_id(case):
    op, arg, mutate, exc, extra = case
    return f"{op}-{arg}"


@pytest.mark.parametrize("op,arg,mutate,exc,extra", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_is_refused(op, arg, mutate, exc, extra):
    build, call = OPS[op]
    kw = build()
    mutate(kw)
    with pytest.raises(exc) as info:
        call(**kw)
    msg = str(info.value)
    assert re.search(word(arg), msg), f"message does not name {arg!r}: {msg}"
    if extra is not None:
        assert re.search(extra, msg), f"message lacks {extra!r}: {msg}"


def test_case_table_covers_every_op():
    assert {c[0] for c in CASES} == set(OPS)
    exported = {"quantize_fp8", "dequantize_fp8", "IndexerKCache", "MLAKVCache", "mqa_logits",
                "paged_mqa_logits", "topk_per_row", "topk_per_row_decode", "fold_weights",
                "hadamard_rotate", "sparse_mla_attention", "dense_mla_attention",
                "local_to_global_slots"}
    assert exported <= set(cpsparse.__all__)
    assert exported <= {op.split(".")[0] for op in OPS}


# ---- values that are legal (no false alarms) ----------------------------------------

def test_unused_block_table_columns_are_not_checked():
    kw = b_paged()
    kw["block_table"] = i32([[0, 1, 99], [3, -7, 12345]])   # columns past each need: junk
    out = paged_mqa_logits(**kw)
    assert out.shape == (4, 24)
    kw = b_icache_gather()
    kw["block_table"] = i32([[3, 1, 0], [2, -1, 77]])
    codes, scales = _method("gather")(**kw)
    assert codes.shape == (56, 32)


def test_slot_minus_one_accepted_where_documented():
    kw = b_icache_insert()
    kw["slot_mapping"] = i32([-1, -1, -1])
    _method("insert")(**kw)
    kw = b_sparse()
    kw["indices"] = i32([[-1, -1, -1], [-1, -1, -1]])
    out, lse = sparse_mla_attention(**kw)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_fold_weights_accepts_three_dim_scales():
    kw = b_fold()
    kw["q_scales"] = kw["q_scales"][..., None]
    assert fold_weights(**kw).shape == (4, 8)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
def test_quantize_accepts_every_float_dtype(dtype):
    import ml_dtypes
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    codes, scales = cpsparse.quantize_fp8(f32((2, 128)).astype(dt))
    assert codes.shape == (2, 128) and scales.shape == (2, 1)


def test_quantize_accepts_numpy_float32_eps():
    x = f32((2, 128))
    codes, scales = cpsparse.quantize_fp8(x, eps=np.float32(1e-4))
    want_codes, want_scales = cpsparse.quantize_fp8(x, eps=1e-4)
    assert np.array_equal(codes, want_codes) and np.array_equal(scales, want_scales)


# ---- known message bugs (the message does not name the argument) ---------------------

def test_indexer_cache_negative_block_size_names_argument():
    with pytest.raises(ValueError, match=word("block_size")):
        IndexerKCache(num_blocks=4, block_size=-1, head_dim=32)


def test_indexer_cache_float_block_size_names_argument():
    with pytest.raises(TypeError, match=word("block_size")):
        IndexerKCache(num_blocks=4, block_size=16.0, head_dim=32)


def test_mla_cache_bad_kv_lora_rank_names_argument():
    with pytest.raises(ValueError, match=word("kv_lora_rank")):
        MLAKVCache(num_blocks=2, block_size=16, kv_lora_rank=100)


def test_paged_raw_cache_wrong_dtype_names_cache():
    kw = b_paged()
    kw["cache"] = np.zeros((6, 16 * 36), np.float32)
    with pytest.raises(TypeError, match=word("cache")):
        paged_mqa_logits(**kw)


def test_paged_raw_cache_non_contiguous_names_cache():
    kw = b_paged()
    kw["cache"] = noncontig(kw["cache"].data)
    with pytest.raises(ValueError, match=word("cache")):
        paged_mqa_logits(**kw)


def test_paged_raw_cache_three_dim_container_is_accepted():
    """DESIGN section 4: a [num_blocks, block_size, D+4] view is only a container of the
    same bytes; it gives the same logits as the 2-D page array."""
    kw = b_paged()
    want = paged_mqa_logits(**kw)
    kw["cache"] = kw["cache"].data.reshape(6, 16, 36)
    np.testing.assert_array_equal(paged_mqa_logits(**kw), want)


def test_paged_raw_cache_three_dim_wrong_row_names_cache():
    kw = b_paged()
    kw["cache"] = np.zeros((6, 16, 40), np.uint8)
    with pytest.raises(ValueError, match=word("cache")):
        paged_mqa_logits(**kw)


def test_paged_raw_cache_array_is_accepted():
    kw = b_paged()
    want = paged_mqa_logits(**kw)
    kw["cache"] = kw["cache"].data
    got = paged_mqa_logits(**kw)
    np.testing.assert_array_equal(got, want)


# ---- backends -------------------------------------------------------------------------

def test_get_array_module_refuses_lists():
    with pytest.raises(TypeError, match=word("x")):
        cpsparse.get_array_module(x=[1.0, 2.0])
    with pytest.raises(TypeError, match=word("weights")):
        cpsparse.get_array_module(q=np.zeros(2), weights=(1, 2))
    assert cpsparse.get_array_module(a=np.zeros(2), b=None) is np


@pytest.mark.gpu
def test_mixed_backends_are_refused():
    if not cpsparse.gpu_available():
        pytest.skip("needs CuPy and a CUDA device")
    import cupy as cp
    x = f32((2, 128))
    codes, scales = cpsparse.quantize_fp8(x)
    with pytest.raises(TypeError, match="(?i)mixed"):
        cpsparse.dequantize_fp8(cp.asarray(codes), scales)
    with pytest.raises(TypeError, match=r"codes|scales"):
        cpsparse.dequantize_fp8(codes, cp.asarray(scales))
    cache = IndexerKCache(4, 16, 32)
    with pytest.raises(TypeError, match=r"(?i)mixed"):
        cache.insert(cp.asarray(f32((2, 32))), i32([0, 1]))
    kw = b_mqa()
    kw["k_codes"] = cp.asarray(kw["k_codes"])
    with pytest.raises(TypeError, match="k_codes"):
        mqa_logits(**kw)
    kw = b_topk()
    kw["out"] = cp.empty((3, 4), cp.int32)
    with pytest.raises(TypeError, match="out"):
        topk_per_row(**kw)
    assert cpsparse.get_array_module(a=cp.zeros(2)) is cp
