"""One production-mode bad-index case on the GPU, in its own process.

``python tests/gpu_bad_index_worker.py OP VALUE`` runs op OP with the index value
VALUE planted in some of its index entries, with device value checks off, eagerly
and (where the op is graph-safe) inside a captured CUDA graph, as int32 and as
int64 index arrays. It compares every result with the NumPy reference, which
bounds indices the same way (cpsparse.reference, called directly: no
validation). Prints one JSON line ``{"op", "value", "checks": [...]}`` and exits
0 when everything matched; an illegal address kills the process (non-zero exit),
which is the point of running each case apart (tests/test_gpu_bad_indices.py).

VALUE is an integer, ``num`` (the bound itself: num_slots or num_blocks), or
``past_table`` (a context or position past the block table's columns).
"""

import json
import sys

import numpy as np

import cpsparse
from cpsparse import reference as R
from cpsparse.attention import softmax_scale

BLOCK = 64
SCALE = softmax_scale(128, 64)
INT32_VALUES = (-2 ** 31, -123456, -2, 2 ** 31 - 1)


def _np(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def close(got, want, rtol, norm=False):
    """Same non-finite pattern (-inf masks, NaN) and finite values within rtol: of the
    largest magnitude (max) or, for logits, DESIGN section 11's ||got - ref|| / ||ref||."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return False
    same_nonfinite = np.array_equal(np.isfinite(got), np.isfinite(want)) and np.array_equal(
        got[~np.isfinite(got)], want[~np.isfinite(want)], equal_nan=True)
    fin = np.isfinite(want)
    if not same_nonfinite or not fin.any():
        return same_nonfinite
    diff = got[fin] - want[fin]
    if norm:
        return float(np.linalg.norm(diff)) <= rtol * max(float(np.linalg.norm(want[fin])), 1e-30)
    return float(np.abs(diff).max()) <= rtol * max(1.0, float(np.abs(want[fin]).max()))


class Case:
    """Inputs of one op; ``plant(v)`` returns the index arrays with v planted."""

    graph_safe = True

    def __init__(self, cp, rng):
        self.cp, self.rng = cp, rng


class AttentionFp8(Case):
    bound = "num_slots"

    def __init__(self, cp, rng):
        super().__init__(cp, rng)
        self.cache = cpsparse.MLAKVCache(8, BLOCK, xp=np)
        self.num = self.cache.num_slots
        slots = rng.choice(self.num, 200, replace=False).astype(np.int32)
        self.cache.insert(rng.standard_normal((200, 512)).astype(np.float32),
                          rng.standard_normal((200, 64)).astype(np.float32), slots)
        # Every slot no valid index names (slot 0 among them) is NaN: never read.
        used = np.zeros(self.num, bool)
        used[slots] = True
        rec = self.cache.records()
        rec[~used] = 0xFF                                  # NaN codes, NaN scales/RoPE
        self.idx = np.where(rng.random((6, 96)) < 0.2, -1, rng.choice(slots, (6, 96)))
        self.q = rng.standard_normal((6, 16, 576)).astype(np.float32)
        self.kv_dev = cpsparse.MLAKVCache.wrap(cp.asarray(self.cache.data))

    def plant(self, v):
        if v == "past_table":
            return None
        idx = self.idx.astype(np.int64)
        idx[:, ::7] = v
        idx[2] = v                                         # a row with nothing valid
        return idx

    def prepare(self):
        self.q_dev = self.cp.asarray(self.q)

    def run(self, idx_dev):
        return cpsparse.sparse_mla_attention(self.q_dev, self.kv_dev, idx_dev, SCALE)

    def want(self, idx):
        lora = 512
        return R.attention.sparse_mla_attention(
            self.q, self.cache.records(), idx, SCALE, lora,
            lambda rec: R.cache.mla_decode(rec, lora, 64))

    def check(self, got, want):
        return close(_np(got[0]), want[0], 2e-2) and close(_np(got[1]), want[1], 2e-2)


class AttentionFp8Heads128(AttentionFp8):
    """128 heads (two head groups: the second CTA of a token reads the same slots), whole
    and in 4 splits (each split's CTAs mask their share's bad slots, the merge reads
    partials of rows with nothing valid)."""

    def __init__(self, cp, rng):
        super().__init__(cp, rng)
        self.q = rng.standard_normal((6, 128, 576)).astype(np.float32)

    def run(self, idx_dev):
        from cpsparse.raw_kernels import attention as katt
        whole = cpsparse.sparse_mla_attention(self.q_dev, self.kv_dev, idx_dev, SCALE)
        split = katt.sparse_mla_attention(self.cp, self.q_dev, self.kv_dev.records(),
                                          idx_dev, SCALE, 512, True, splits=4)
        return tuple(self.cp.concatenate([a, b]) for a, b in zip(whole, split))

    def want(self, idx):
        out, lse = super().want(idx)
        return np.concatenate([out, out]), np.concatenate([lse, lse])


class AttentionBf16(AttentionFp8):
    def __init__(self, cp, rng):
        Case.__init__(self, cp, rng)
        self.num = 300
        self.kv = rng.standard_normal((self.num, 576)).astype(np.float32)
        slots = rng.choice(self.num, 150, replace=False)
        unused = np.setdiff1d(np.arange(self.num), slots)
        self.kv[unused] = np.nan                           # slot 0 included (if unused)
        self.kv[0] = np.nan
        slots = slots[slots != 0]
        self.idx = np.where(rng.random((6, 96)) < 0.2, -1, rng.choice(slots, (6, 96)))
        self.q = rng.standard_normal((6, 16, 576)).astype(np.float32)
        self.kv_dev = cp.asarray(self.kv)

    def want(self, idx):
        return R.attention.sparse_mla_attention(self.q, self.kv, idx, SCALE, 512)


class AttentionModel1(AttentionFp8):
    """MODEL1 with FlashMLA's extras in the kernel (lengths, a window cache, a sink): the
    bad value in the main list must read as -1, so the NumPy op on the list with those
    entries set to -1 is the answer."""

    def __init__(self, cp, rng):
        Case.__init__(self, cp, rng)
        self.cache = cpsparse.MLAKVCache(8, BLOCK, layout="model1")
        self.window = cpsparse.MLAKVCache(2, 32, layout="model1")
        self.num = self.cache.num_slots
        slots = rng.choice(self.num, 200, replace=False).astype(np.int32)
        self.cache.insert(rng.standard_normal((200, 448)).astype(np.float32),
                          rng.standard_normal((200, 64)).astype(np.float32), slots)
        self.window.insert(rng.standard_normal((64, 448)).astype(np.float32),
                           rng.standard_normal((64, 64)).astype(np.float32),
                           np.arange(64, dtype=np.int32))
        rows, scales = R.cache._model1_views(self.cache.data, BLOCK)
        unused = np.ones(self.num, bool)
        unused[slots] = False
        rows[unused.reshape(8, BLOCK)] = 0xFF              # NaN codes and RoPE
        scales[unused.reshape(8, BLOCK)] = 0xFF            # and scales of 2**128
        self.idx = np.where(rng.random((6, 96)) < 0.2, -1, rng.choice(slots, (6, 96)))
        self.e_idx = rng.integers(-1, 64, (6, 40))
        self.lens = np.array([96, 50, 0, 96, 7, 200], np.int32)
        self.sink = rng.standard_normal(16).astype(np.float32)
        self.q = (0.1 * rng.standard_normal((6, 16, 512))).astype(np.float32)
        self.kv_dev = cpsparse.MLAKVCache.wrap(cp.asarray(self.cache.data), layout="model1")
        self.window_dev = cpsparse.MLAKVCache.wrap(cp.asarray(self.window.data),
                                                   layout="model1", block_size=32)

    def prepare(self):
        cp = self.cp
        self.q_dev = cp.asarray(self.q)
        self.extras_dev = dict(extra_kv_cache=self.window_dev,
                               extra_indices=cp.asarray(self.e_idx),
                               topk_length=cp.asarray(self.lens),
                               attn_sink=cp.asarray(self.sink))

    def run(self, idx_dev):
        return cpsparse.sparse_mla_attention(self.q_dev, self.kv_dev, idx_dev, SCALE,
                                             **self.extras_dev)

    def want(self, idx):
        masked = np.where((idx >= 0) & (idx < self.num), idx, -1)
        return cpsparse.sparse_mla_attention(
            self.q, self.cache, masked, SCALE, extra_kv_cache=self.window,
            extra_indices=self.e_idx, topk_length=self.lens, attn_sink=self.sink)


class IndexerInsert(Case):
    def __init__(self, cp, rng):
        super().__init__(cp, rng)
        self.num = 4 * BLOCK
        self.k = rng.standard_normal((20, 128)).astype(np.float32)
        self.slots = rng.choice(self.num, 20, replace=False)
        self.start = rng.integers(0, 256, (4, BLOCK * 132), dtype=np.uint8)   # poison
        self.cache = None

    def plant(self, v):
        if v == "past_table":
            return None
        s = self.slots.astype(np.int64)
        s[::3] = v
        return s

    def prepare(self):
        self.cache = cpsparse.IndexerKCache.wrap(self.cp.asarray(self.start))
        self.k_dev = self.cp.asarray(self.k)

    def run(self, slots_dev):
        self.cache.insert(self.k_dev, slots_dev)
        return self.cache.data

    def want(self, slots):
        data = self.start.copy()
        codes, scales = R.fp8.quantize_groups(self.k, 128, "ue8m0", cpsparse.IndexerKCache.KEY_EPS)
        R.cache.indexer_insert(data, BLOCK, 128, codes, scales.reshape(-1), slots)
        return data

    def check(self, got, want):
        return np.array_equal(_np(got), want)


class MLAInsert(IndexerInsert):
    graph_safe = False          # the reference path on CuPy (boolean masks sync)

    def __init__(self, cp, rng):
        Case.__init__(self, cp, rng)
        self.num = 2 * BLOCK
        self.kv_c = rng.standard_normal((20, 512)).astype(np.float32)
        self.k_pe = rng.standard_normal((20, 64)).astype(np.float32)
        self.slots = rng.choice(self.num, 20, replace=False)
        self.start = rng.integers(0, 256, (2, BLOCK, 656), dtype=np.uint8)

    def prepare(self):
        cp = self.cp
        self.cache = cpsparse.MLAKVCache.wrap(cp.asarray(self.start))
        self.kv_c_dev, self.k_pe_dev = cp.asarray(self.kv_c), cp.asarray(self.k_pe)

    def run(self, slots_dev):
        self.cache.insert(self.kv_c_dev, self.k_pe_dev, slots_dev)
        return self.cache.data

    def want(self, slots):
        data = self.start.copy()
        R.cache.mla_insert(data, R.cache.mla_encode(self.kv_c, self.k_pe), slots)
        return data


class IndexerGather(Case):
    graph_safe = False          # reads cu_seq_lens on the host

    def __init__(self, cp, rng):
        super().__init__(cp, rng)
        self.num = 6
        self.data = rng.integers(0, 256, (6, BLOCK * 132), dtype=np.uint8)
        self.table = np.array([[0, 1, 2], [3, 4, 5]], np.int64)
        self.cu = np.array([0, 150, 250], np.int32)

    def plant(self, v):
        if v == "past_table":
            return None
        t = self.table.copy()
        t[0, 1] = v
        t[1, 0] = v
        return t

    def prepare(self):
        self.cache = cpsparse.IndexerKCache.wrap(self.cp.asarray(self.data))
        self.cu_dev = self.cp.asarray(self.cu)

    def run(self, table_dev):
        return self.cache.gather(table_dev, self.cu_dev)

    def want(self, table):
        blocks, offsets = R.cache.request_positions(self.cu.astype(np.int64), table, BLOCK)
        return R.cache.indexer_read(self.data, BLOCK, 128, blocks, offsets)

    def check(self, got, want):
        return np.array_equal(_np(got[0]), want[0]) and np.array_equal(_np(got[1]), want[1])


class PagedLogits(Case):
    heads = 16                           # the per-page kernel
    dtype = "fp8"

    def __init__(self, cp, rng):
        super().__init__(cp, rng)
        self.num = 8
        self.cache = cpsparse.IndexerKCache(8, BLOCK, dtype=self.dtype)
        self.cache.insert(rng.standard_normal((8 * BLOCK, 128)).astype(np.float32),
                          np.arange(8 * BLOCK, dtype=np.int32))
        self.q, _ = cpsparse.quantize_fp8(rng.standard_normal((3, 2, self.heads, 128)).astype(
            np.float32), eps=1e-10)
        self.w = rng.standard_normal((6, self.heads)).astype(np.float32)
        self.lens = np.array([200, 130, 250], np.int64)
        self.table = np.array([[1, 0, 5, 2], [7, 3, 0, 0], [4, 6, 2, 1]], np.int64)

    def plant(self, v):
        t = self.table.copy()
        if v == "past_table":            # contexts longer than the table's 4 columns
            return t[:, :2]
        t[0, 1] = v
        t[2, 3] = v
        return t

    def prepare(self):
        cp = self.cp
        self.dev = (cp.asarray(self.q),
                    cpsparse.IndexerKCache.wrap(cp.asarray(self.cache.data), BLOCK,
                                                dtype=self.dtype),
                    cp.asarray(self.w))
        self.lens_dev = {t: cp.asarray(self.lens.astype(t)) for t in ("int32", "int64")}

    def run(self, table_dev):
        q, cache, w = self.dev
        return cpsparse.paged_mqa_logits(q, cache, w, self.lens_dev[table_dev.dtype.name],
                                         table_dev, 256)

    def want(self, table):
        return R.indexer.paged_mqa_logits(self.q, self.cache.data, BLOCK, self.w, self.lens,
                                          table, 256, self.dtype)

    def check(self, got, want):
        return close(_np(got), want, 1e-3, norm=True)


class PrefillLogits(Case):
    def __init__(self, cp, rng):
        super().__init__(cp, rng)
        self.num = 100
        self.q, _ = cpsparse.quantize_fp8(rng.standard_normal((40, 16, 128)).astype(
            np.float32), eps=1e-10)
        self.k, ksc = cpsparse.quantize_fp8(rng.standard_normal((100, 128)).astype(np.float32))
        self.ksc = ksc[:, 0]
        self.w = rng.standard_normal((40, 16)).astype(np.float32)
        self.ks = rng.integers(0, 50, 40)
        self.ke = self.ks + rng.integers(0, 50, 40)

    def plant(self, v):
        if v == "past_table":
            return None
        ks, ke = self.ks.copy(), self.ke.copy()
        ks[::4] = v
        ke[1::4] = v
        return np.stack([ks, ke])

    def prepare(self):
        cp = self.cp
        self.dev = tuple(cp.asarray(a) for a in (self.q, self.k, self.ksc, self.w))

    def run(self, windows_dev):
        return cpsparse.mqa_logits(*self.dev, windows_dev[0], windows_dev[1])

    def want(self, windows):
        return R.indexer.mqa_logits(self.q, self.k, self.ksc, self.w, windows[0], windows[1])

    def check(self, got, want):
        return close(_np(got), want, 1e-3, norm=True)


class TopkRows(PrefillLogits):
    def __init__(self, cp, rng):
        Case.__init__(self, cp, rng)
        self.num = 5000
        self.logits = rng.standard_normal((8, 5000)).astype(np.float32)
        self.ks = rng.integers(0, 1000, 8)
        self.ke = self.ks + rng.integers(0, 4000, 8)

    def prepare(self):
        self.dev = self.cp.asarray(self.logits)

    def run(self, windows_dev):
        return cpsparse.topk_per_row(self.dev, windows_dev[0], windows_dev[1], 64)

    def want(self, windows):
        return R.indexer.topk_per_row(self.logits, windows[0], windows[1], 64)

    def check(self, got, want):
        # Same sets per row (the kernel's order is free).
        return np.array_equal(np.sort(_np(got), axis=1), np.sort(want, axis=1))


class PagedLogitsWs(PagedLogits):
    heads = 64                           # the warp-specialized kernel (ws_h64n2)

    def prepare(self):
        super().prepare()
        from cpsparse.raw_kernels import indexer as kin
        fn = kin.paged_plan(3, 2, self.heads, 128, 256, BLOCK, fp4=self.dtype == "mxfp4")[2]
        want = kin.ws_kernel_name(2, self.dtype == "mxfp4")
        if fn.name != want:
            raise AssertionError(f"the plan picked {fn.name}, not {want}")


class PagedLogitsWsMxfp4(PagedLogitsWs):
    dtype = "mxfp4"                      # ... with MXFP4 keys (fp4_ws_h64n2)


class SlotMapping(Case):
    def __init__(self, cp, rng):
        super().__init__(cp, rng)
        self.num = 3                                       # requests
        self.idx = rng.integers(-1, 4 * BLOCK, (6, 50))
        self.req = np.array([0, 0, 1, 2, 2, 1], np.int64)
        self.table = rng.integers(0, 20, (3, 4))

    def plant(self, v):
        idx, req, table = self.idx.copy(), self.req.copy(), self.table.copy()
        if v == "past_table":
            idx[:, ::5] = 4 * BLOCK + 3                    # past the 4 columns
        elif v == "page_2**26":
            table[1, 2] = 2 ** 26                          # slot wraps int32 onto page 0
            idx[2, :] = 2 * BLOCK + 5
        else:
            idx[:, ::5] = v
            req[3] = v
            table[2, 1] = v
        return idx, req, table

    def prepare(self):
        pass

    def run(self, arrays_dev):
        return cpsparse.local_to_global_slots(*arrays_dev, block_size=BLOCK)

    def want(self, arrays):
        return R.attention.local_to_global_slots(*arrays, BLOCK)

    def check(self, got, want):
        return np.array_equal(_np(got), want)


CASES = {"attention_fp8": AttentionFp8, "attention_fp8_h128": AttentionFp8Heads128,
         "attention_bf16": AttentionBf16,
         "attention_model1": AttentionModel1,
         "indexer_insert": IndexerInsert, "mla_insert": MLAInsert,
         "indexer_gather": IndexerGather, "paged_mqa_logits": PagedLogits,
         "paged_mqa_logits_ws": PagedLogitsWs,
         "paged_mqa_logits_ws_mxfp4": PagedLogitsWsMxfp4,
         "mqa_logits": PrefillLogits, "topk_per_row": TopkRows,
         "local_to_global_slots": SlotMapping}
VALUES = ("-2147483648", "-123456", "-2", "num", "2147483647", "4294967296", "past_table")
EXTRA_VALUES = {"local_to_global_slots": ("page_2**26",)}


def _to_dev(cp, arrays, dtype):
    if isinstance(arrays, tuple):
        return tuple(cp.asarray(a.astype(dtype)) for a in arrays)
    return cp.asarray(arrays.astype(dtype))


def _cast(arrays, dtype):
    if isinstance(arrays, tuple):
        return tuple(a.astype(dtype) for a in arrays)
    return arrays.astype(dtype)


def main(op, value):
    import cupy as cp
    cpsparse.set_device_value_checks(False)
    case = CASES[op](cp, np.random.default_rng(7))
    v = case.num if value == "num" else (value if not value.lstrip("-").isdigit() else int(value))
    planted = case.plant(v)
    checks = []
    if planted is None:
        print(json.dumps({"op": op, "value": value, "checks": [], "skipped": True}))
        return 0
    for dtype in (np.int32, np.int64):
        if isinstance(v, int) and dtype is np.int32 and not -2 ** 31 <= v < 2 ** 31:
            continue                         # only an int64 array can hold it
        host = _cast(planted, dtype)
        want = case.want(host)
        case.prepare()
        got = case.run(_to_dev(cp, planted, dtype))
        cp.cuda.get_current_stream().synchronize()
        checks.append({"mode": "eager", "dtype": np.dtype(dtype).name,
                       "ok": bool(case.check(got, want))})
        if case.graph_safe:
            case.prepare()
            dev = _to_dev(cp, planted, dtype)
            case.run(dev)                    # warm: compile, set smem limits, fill caches
            case.prepare()
            cp.cuda.get_current_stream().synchronize()
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                stream.begin_capture()
                got = case.run(dev)
                graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            checks.append({"mode": "graph", "dtype": np.dtype(dtype).name,
                           "ok": bool(case.check(got, want))})
    print(json.dumps({"op": op, "value": value, "checks": checks}))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
