"""Run every row of docs/bad_input.md: the documented error, before any launch."""

import pathlib
import re

import numpy as np
import pytest

import cpsparse
from cpsparse.metadata import build_batch

TABLE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "bad_input.md"


def parse_rows():
    rows = []
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("function", "---"):
            continue
        func, arg, bad, error, message = cells
        m = re.match(r"`(.*)`\s*(\*gpu\*)?$", bad)
        assert m, f"bad value cell not a code span: {bad!r}"
        rows.append((func, arg, m.group(1), bool(m.group(2)), error, message))
    return rows


ROWS = parse_rows()


def baseline(func):
    """(callable, kwargs) of a valid call of ``func``."""
    rng = np.random.default_rng(0)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    i32 = lambda v: np.array(v, np.int32)  # noqa: E731
    if func == "quantize_fp8":
        return cpsparse.quantize_fp8, dict(x=f32(4, 512), block_size=128, scale_fmt="ue8m0",
                                           eps=1e-4)
    if func == "dequantize_fp8":
        return cpsparse.dequantize_fp8, dict(codes=np.zeros((4, 256), np.uint8),
                                             scales=np.ones((4, 2), np.float32), block_size=128)
    if func == "IndexerKCache":
        return cpsparse.IndexerKCache, dict(num_blocks=4, block_size=64, head_dim=128, xp=np,
                                            scale_fmt="ue8m0")
    if func == "IndexerKCache.insert":
        return cpsparse.IndexerKCache(4).insert, dict(k=f32(3, 128), slot_mapping=i32([0, 5, 70]))
    if func == "IndexerKCache.gather":
        cache = cpsparse.IndexerKCache(4)
        return cache.gather, dict(block_table=i32([[0, 1], [2, 3]]),
                                  cu_seq_lens=i32([0, 70, 100]))
    if func == "MLAKVCache":
        return cpsparse.MLAKVCache, dict(num_blocks=2, block_size=64, kv_lora_rank=512,
                                         rope_dim=64)
    if func == "MLAKVCache.insert":
        return cpsparse.MLAKVCache(2).insert, dict(kv_c=f32(3, 512), k_pe=f32(3, 64),
                                                   slot_mapping=i32([0, 1, 2]))
    if func == "MLAKVCache.gather":
        return cpsparse.MLAKVCache(2).gather, dict(slots=i32([0, 1]))
    if func == "mqa_logits":
        return cpsparse.mqa_logits, dict(
            q_codes=np.zeros((4, 8, 128), np.uint8), k_codes=np.zeros((10, 128), np.uint8),
            k_scales=np.ones(10, np.float32), weights=f32(4, 8), ks=i32([0, 0, 0, 0]),
            ke=i32([1, 2, 3, 4]))
    if func == "paged_mqa_logits":
        cache = cpsparse.IndexerKCache(4)
        cache.insert(f32(70, 128), np.arange(70, dtype=np.int32))
        return cpsparse.paged_mqa_logits, dict(
            q_codes=np.zeros((1, 2, 8, 128), np.uint8), cache=cache, weights=f32(2, 8),
            context_lens=i32([70]), block_table=i32([[0, 1]]), max_context_len=200)
    if func == "topk_per_row":
        return cpsparse.topk_per_row, dict(logits=f32(4, 10), row_starts=i32([0] * 4),
                                           row_ends=i32([10] * 4), k=2, out=None)
    if func == "topk_per_row_decode":
        return cpsparse.topk_per_row_decode, dict(logits=f32(4, 80), context_lens=i32([70, 60]),
                                                  next_n=2, k=8)
    if func == "sparse_mla_attention":
        return cpsparse.sparse_mla_attention, dict(
            q=f32(3, 4, 576), kv_cache=f32(128, 576),
            indices=i32([[0, 1, 2, 3], [4, 5, -1, -1], [7, 7, 9, 127]]), sm_scale=0.1)
    if func == "dense_mla_attention":
        return cpsparse.dense_mla_attention, dict(q=f32(5, 2, 576), kv=f32(5, 576), sm_scale=0.1,
                                                  cu_seqlens_q=i32([0, 2, 5]),
                                                  cu_seqlens_k=i32([0, 2, 5]))
    if func == "local_to_global_slots":
        return cpsparse.local_to_global_slots, dict(indices=i32([[0, 65, -1]]), req_ids=i32([0]),
                                                    block_table=i32([[7, 3]]), block_size=64)
    if func == "fold_weights":
        return cpsparse.fold_weights, dict(weights=f32(2, 4), q_scales=np.ones((2, 4), np.float32))
    if func == "hadamard_rotate":
        return cpsparse.hadamard_rotate, dict(x=f32(2, 8))
    if func == "build_batch":
        return build_batch, dict(query_lens=[1, 70], context_lens=[70, 0],
                                 block_table=i32([[0, 1], [2, 3]]), block_size=64, index_topk=64)
    raise KeyError(func)


def test_every_row_names_a_known_function():
    assert len(ROWS) >= 90
    for func, *_ in ROWS:
        baseline(func)


@pytest.mark.parametrize("func", sorted({r[0] for r in ROWS}))
def test_baselines_are_valid(func):
    fn, kwargs = baseline(func)
    fn(**kwargs)


@pytest.mark.parametrize("func,arg,bad,gpu,error,message", ROWS,
                         ids=[f"{r[0]}-{r[1]}-{i}" for i, r in enumerate(ROWS)])
def test_documented_error(func, arg, bad, gpu, error, message):
    if gpu and not cpsparse.gpu_available():
        pytest.skip("row mixes a CuPy array in: needs a GPU")
    primer, primer_kwargs = baseline(func)
    primer(**primer_kwargs)      # the ops' memo of valid layouts must not hide the error
    fn, kwargs = baseline(func)
    namespace = dict(kwargs, np=np)
    if gpu:
        import cupy
        namespace["cupy_of"] = cupy.asarray
    kwargs[arg] = eval(bad, namespace)  # noqa: S307 - the table is ours
    with pytest.raises({"TypeError": TypeError, "ValueError": ValueError}[error],
                       match=re.escape(message)):
        fn(**kwargs)
