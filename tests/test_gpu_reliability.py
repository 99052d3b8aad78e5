"""GPU reliability: CUDA graph capture + replay of a decode step, CuPy streams,
concurrent precompile, and sizes whose index arithmetic passes 2**31."""

import contextlib
import threading

import numpy as np
import pytest

import cpsparse
from cpsparse import raw_kernels
from cpsparse.raw_kernels import attention as katt

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    import cupy
    return cupy


def _decode_inputs(cp, rng, batch, context, heads=64, mla_heads=16, topk=512, next_n=1):
    bs = 64
    pages = -(-context // bs)
    table = rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages)
    icache = cpsparse.IndexerKCache(batch * pages, bs, 128, xp=cp)
    keys = cp.asarray(rng.standard_normal((batch * pages * bs, 128)).astype(np.float32))
    icache.insert(keys, cp.arange(batch * pages * bs, dtype=cp.int32))
    mcache = cpsparse.MLAKVCache(batch * pages, bs, xp=cp)
    mcache.insert(cp.asarray(rng.standard_normal((batch * pages * bs, 512)).astype(np.float32)),
                  cp.asarray(rng.standard_normal((batch * pages * bs, 64)).astype(np.float32)),
                  cp.arange(batch * pages * bs, dtype=cp.int32))
    q8, qs = cpsparse.quantize_fp8(cp.asarray(rng.standard_normal(
        (batch, next_n, heads, 128)).astype(np.float32)), eps=1e-10)
    w = cpsparse.fold_weights(cp.asarray(rng.standard_normal(
        (batch * next_n, heads)).astype(np.float32)), qs.reshape(batch * next_n, heads))
    q = cp.asarray((rng.standard_normal((batch * next_n, mla_heads, 576)) * 0.1).astype(
        np.float32))
    lens = cp.full(batch, context, dtype=cp.int32)
    return dict(icache=icache, mcache=mcache, q8=q8, w=w, q=q, lens=lens,
                table=cp.asarray(table), topk=topk, next_n=next_n, context=context)


def _decode_step(cp, d, buf, out_attn):
    logits = cpsparse.paged_mqa_logits(d["q8"], d["icache"], d["w"], d["lens"], d["table"],
                                       d["context"])
    cpsparse.topk_per_row_decode(logits, d["lens"], d["next_n"], d["topk"], out=buf)
    req = cp.repeat(cp.arange(d["lens"].size, dtype=cp.int32), d["next_n"])
    slots = cpsparse.local_to_global_slots(buf, req, d["table"], 64)
    out, lse = cpsparse.sparse_mla_attention(d["q"], d["mcache"], slots,
                                             cpsparse.softmax_scale())
    out_attn[...] = out


@contextlib.contextmanager
def _capturable_allocator(cp):
    """CuPy allocations from a stream-ordered pool (what graph capture needs) inside."""
    pool = cp.cuda.MemoryAsyncPool()
    old = cp.cuda.get_allocator()
    cp.cuda.set_allocator(pool.malloc)
    try:
        yield
    finally:
        cp.cuda.set_allocator(old)


def test_decode_step_captured_in_a_cuda_graph_replays_correctly(cp):
    rng = np.random.default_rng(0)
    d = _decode_inputs(cp, rng, batch=4, context=3000)
    buf = cp.full((4, d["topk"]), -1, cp.int32)
    eager = cp.zeros((4, 16, 512), cp.float32)
    _decode_step(cp, d, buf, eager)                     # warm-up: compile, pool blocks
    want_idx = cp.sort(buf, axis=1).get()
    stream = cp.cuda.Stream(non_blocking=True)
    replayed = cp.zeros_like(eager)
    with _capturable_allocator(cp), stream:
        buf[...] = -7
        stream.synchronize()
        stream.begin_capture()
        _decode_step(cp, d, buf, replayed)
        graph = stream.end_capture()
        replayed[...] = 0
        buf[...] = -7
        graph.launch(stream)
        stream.synchronize()
    assert np.array_equal(cp.sort(buf, axis=1).get(), want_idx)
    # Same key sets; the top-k order may differ between runs, which regroups the
    # bf16 softmax tiles: equal to attention precision, not bit for bit.
    got, want = replayed.get(), eager.get()
    assert np.linalg.norm(got - want) <= 2e-3 * np.linalg.norm(want)


def test_kernels_run_on_the_current_stream(cp):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        codes, scales = cpsparse.quantize_fp8(cp.asarray(x))
        logits = cp.asarray(rng.standard_normal((64, 4096)).astype(np.float32))
        idx = cpsparse.topk_per_row(logits, cp.zeros(64, cp.int32), cp.full(64, 4096, cp.int32),
                                    256)
    stream.synchronize()
    want_c, want_s = cpsparse.quantize_fp8(x)
    assert np.array_equal(codes.get(), want_c) and np.array_equal(scales.get(), want_s)
    assert (idx.get() >= 0).all()


def test_concurrent_precompile_from_many_threads(cp):
    raw_kernels._COMPILED.clear()
    errors = []

    def worker():
        try:
            cp.cuda.Device(0).use()
            raw_kernels.precompile()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    cc = cp.cuda.Device(0).compute_capability
    assert {name for _, name in raw_kernels._COMPILED} == set(raw_kernels.supported_modules(cc))


@pytest.mark.slow
def test_paged_logits_over_a_cache_larger_than_2_gib(cp):
    """128 requests x 131072 keys: cache byte offsets pass 2**31."""
    rng = np.random.default_rng(2)
    batch, context, bs = 128, 131072, 64
    pages = context // bs
    num_blocks = batch * pages
    cache = cpsparse.IndexerKCache(num_blocks, bs, 128, xp=cp)
    assert cache.data.nbytes > 2 ** 31
    # realistic keys (quantized normals): 64 pages' worth, tiled over the whole cache
    pool = cpsparse.IndexerKCache(64, bs, 128)
    pool.insert(rng.standard_normal((64 * bs, 128)).astype(np.float32),
                np.arange(64 * bs, dtype=np.int32))
    cache.data[...] = cp.tile(cp.asarray(pool.data), (num_blocks // 64, 1))
    table = cp.asarray(rng.permutation(num_blocks).astype(np.int32).reshape(batch, pages))
    q8 = cp.asarray(cpsparse.quantize_fp8(
        rng.standard_normal((batch, 1, 16, 128)).astype(np.float32), eps=1e-10)[0])
    w = cp.asarray(rng.standard_normal((batch, 16)).astype(np.float32))
    lens = cp.asarray(rng.integers(context - 500, context + 1, batch).astype(np.int32))
    logits = cpsparse.paged_mqa_logits(q8, cache, w, lens, table, context)
    # check the last request (its pages sit anywhere in the 2.2 GB cache) on the host
    b = batch - 1
    n = int(lens[b])
    host_cache = cpsparse.IndexerKCache(pages, bs, 128)
    host_cache.data[...] = cache.data[table[b].get()].get()
    want = cpsparse.paged_mqa_logits(q8[b:b + 1].get(), host_cache, w[b:b + 1].get(),
                                     np.array([n], np.int32),
                                     np.arange(pages, dtype=np.int32)[None], context)
    got = logits[b:b + 1].get()
    fin = np.isfinite(want)
    assert np.array_equal(fin, np.isfinite(got))
    assert np.linalg.norm(got[fin] - want[fin]) <= 1e-3 * np.linalg.norm(want[fin])


@pytest.mark.slow
def test_topk_rows_past_2_to_the_31_elements(cp):
    """16400 rows x 131072: row offsets pass 2**31 elements."""
    rows, width, k = 16400, 131072, 2048
    logits = cp.random.standard_normal((rows, width), dtype=cp.float32)
    starts = cp.zeros(rows, cp.int32)
    ends = cp.full(rows, width, cp.int32)
    idx = cpsparse.topk_per_row(logits, starts, ends, k)
    for r in (0, rows - 2, rows - 1):
        row = logits[r].get()
        sel = idx[r].get()
        assert len(np.unique(sel)) == k and (sel >= 0).all() and (sel < width).all()
        assert row[sel].min() >= np.delete(row, sel).max()
    del logits


@pytest.mark.parametrize("batch", [1, 3])
def test_pdl_launches_give_the_bits_of_serial_launches(cp, batch):
    """With programmatic dependent launch a kernel's CTAs may start while the kernel
    before it still runs (the indexer's kernels let the top-k launch on their entry), so
    a missing or late grid wait would read the previous step's data: the logits, the
    top-k slots (as sets: their order is not deterministic) and the attention (split-KV,
    so the combine reads the partials the attention just wrote) of two steps with
    different queries, run back to back on pooled memory, must equal those of serial
    launches (PDL off), eagerly and replayed from a graph."""
    rng = np.random.default_rng(5)
    d = _decode_inputs(cp, rng, batch=batch, context=9000, mla_heads=128, topk=2048)
    second = _decode_inputs(cp, np.random.default_rng(6), batch=batch, context=9000,
                            mla_heads=128, topk=2048)
    steps = [(d["q8"], d["w"], d["q"]), (second["q8"], second["w"], second["q"])]
    local = cp.asarray(np.sort(rng.choice(9000, (batch, 2048), replace=False), axis=1)
                       .astype(np.int32))
    req = cp.arange(batch, dtype=cp.int32)

    def step(q8, w, q):
        logits = cpsparse.paged_mqa_logits(q8, d["icache"], w, d["lens"], d["table"], 9000)
        slots = cpsparse.topk_per_row_decode(logits, d["lens"], 1, 2048,
                                             block_table=d["table"], block_size=64)
        fixed = cpsparse.local_to_global_slots(local, req, d["table"], 64)
        out, lse = cpsparse.sparse_mla_attention(q, d["mcache"], fixed,
                                                 cpsparse.softmax_scale())
        return logits, slots, out, lse

    def run_both():
        got = [step(*s) for s in steps]
        cp.cuda.get_current_stream().synchronize()
        return [[x.get() for x in g] for g in got]

    previous = raw_kernels.set_pdl(False)
    try:
        want = run_both()
        raw_kernels.set_pdl(True)
        eager = run_both()
        # the launches above really were PDL launches (cuLaunchKernelEx on this driver)
        assert raw_kernels.kernel("attention", "cps_mla_combine",
                                  katt.COMBINE_ARGS)._launch_ex is not None
        stream = cp.cuda.Stream(non_blocking=True)
        with _capturable_allocator(cp), stream:
            stream.begin_capture()
            outs = [step(*s) for s in steps]
            graph = stream.end_capture()
            for g in outs:                      # the graph's allocations: poisoned first
                for x in g:
                    x.fill(np.nan) if x.dtype.kind == "f" else x.fill(-9)
            graph.launch(stream)                # (once: its allocations are not freed)
            stream.synchronize()
            replayed = [[x.get() for x in g] for g in outs]
    finally:
        raw_kernels.set_pdl(previous)
    for got, how in ((eager, "eager"), (replayed, "graph")):
        for s in range(2):
            logits, slots, out, lse = got[s]
            assert np.array_equal(logits, want[s][0], equal_nan=True), (how, s)
            assert np.array_equal(np.sort(slots, axis=1), np.sort(want[s][1], axis=1)), (how, s)
            assert np.array_equal(out, want[s][2]) and np.array_equal(lse, want[s][3]), (how, s)
    assert not np.array_equal(want[0][2], want[1][2])       # the two steps differ


# A kernel that lets its dependents launch at once, then writes its output late (about
# 200 us on): the kernel after it sees that output only if it waits for the grid.
_LATE_WRITER = r"""
extern "C" __global__ void late_fill(int* out, int n, int value) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    for (int i = 0; i < 200; ++i) __nanosleep(1000);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = value;
}
"""


def test_pdl_kernel_waits_for_a_predecessor_that_triggers_early(cp):
    """A predecessor that lets its dependents launch on entry and writes the positions
    late, then local_to_global_slots (value checks off: no host read in between) launched
    with PDL: its slots must be those of the positions written, not of the ones the
    buffer held before (a kernel without its grid wait reads those)."""
    late_fill = cp.RawKernel(_LATE_WRITER, "late_fill", options=("-arch=sm_90",))
    table = cp.arange(8, dtype=cp.int32).reshape(1, 8)[:, ::-1].copy()   # page p -> 7 - p
    req = cp.zeros(4, cp.int32)
    previous = raw_kernels.set_pdl(True), cpsparse.set_device_value_checks(False)
    try:
        for value in (3, 200, 70):
            pos = cp.full((4, 16), 5, cp.int32)
            cp.cuda.get_current_stream().synchronize()
            late_fill((4,), (128,), (pos, np.int32(pos.size), np.int32(value)))
            slots = cpsparse.local_to_global_slots(pos, req, table, 64)
            want = (7 - value // 64) * 64 + value % 64
            assert (slots.get() == want).all(), (value, slots.get()[0, :4])
    finally:
        raw_kernels.set_pdl(previous[0])
        cpsparse.set_device_value_checks(previous[1])
