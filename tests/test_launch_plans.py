"""The kernels' launch plans on the CPU: which compiled kernel a shape gets, its shared
memory and the shapes it refuses. These are pure functions of the shapes and the device's
facts; where a plan asks for a compiled kernel, a fake stands in (the kernel's name, its
shared memory and cluster size are what is checked). The GPU suite runs the same plans
for real. CI has no GPU, so these tests are what sees a plan change there (found by a
mutation pass over ``cpsparse/raw_kernels/*.py``)."""

import numpy as np
import pytest

from cpsparse import raw_kernels
from cpsparse.raw_kernels import attention as katt
from cpsparse.raw_kernels import indexer as kin
from cpsparse.raw_kernels import topk as ktopk

H200 = raw_kernels.DeviceFacts(0, (9, 0), 132, 233472, 232448)


@pytest.fixture
def fake_device(monkeypatch):
    """An H200's facts, device 0, and kernels that are only their launch parameters:
    ``kernels`` lists (module, name, smem, cluster) of every kernel a plan asks for."""
    kernels = []

    class Fake:
        def __init__(self, module, name, smem, cluster):
            self.name, self.smem, self.cluster = name, smem, cluster
            kernels.append((module, name, smem, cluster))

    def kernel(module, name, signature, smem=0, carveout=None, cluster=1):
        return Fake(module, name, smem, cluster)

    monkeypatch.setattr(raw_kernels, "device_facts", lambda: H200)
    monkeypatch.setattr(raw_kernels, "current_device", lambda: 0)
    monkeypatch.setattr(raw_kernels, "kernel", kernel)
    for mod in (katt, kin):
        monkeypatch.setattr(mod, "_PLANS", {})
    return kernels


# ---- top-k ----------------------------------------------------------------------------

@pytest.mark.parametrize("width", list(range(1, 70)) + [8191, 16384, 32768])
def test_topk_row_buffer_holds_the_row_at_every_misalignment(width):
    """An r* CTA reads the row's 16-byte units from the aligned address at or below its
    start: 0-3 values before it. The buffer holds the most units any start needs, and no
    more."""
    units = [-(-(m + width) // 4) for m in range(4)]
    assert ktopk.row_buffer_bytes(width) == 16 * max(units)


@pytest.mark.parametrize("width, want", [(100, "r256"), (16384, "r256"), (16385, "c1")])
def test_topk_rows_in_shared_memory_up_to_row_width(fake_device, monkeypatch, width, want):
    """One CTA a row takes the row into shared memory (r256, sized to the width) for rows
    of at most ROW_WIDTH values, the candidate buffers of c1 past it."""
    monkeypatch.setattr(ktopk, "cluster_capacity", lambda c: 0)
    fn, cluster, threads, smem = ktopk._plan(1000, width, None, None)
    assert (fn.name, cluster) == (f"cps_topk_{want}", 1)
    assert smem == (ktopk.row_buffer_bytes(width) if want == "r256"
                    else ktopk.cand_buffer_bytes(ktopk.CAND_ONE_CTA))
    assert fake_device[-1] == ("topk", fn.name, smem, 1)


def test_topk_row_variant_refuses_rows_past_its_buffer(fake_device):
    """r256 holds at most ROW_MAX_WIDTH values (a 128 KB buffer); a wider row or an unknown
    cluster size is refused before any kernel is asked for."""
    assert ktopk._plan(1, ktopk.ROW_MAX_WIDTH, None, "r256")[3] == \
        ktopk.row_buffer_bytes(ktopk.ROW_MAX_WIDTH)
    with pytest.raises(ValueError, match="at most 32768"):
        ktopk._plan(1, ktopk.ROW_MAX_WIDTH + 1, None, "r256")
    with pytest.raises(ValueError, match="Invalid cluster"):
        ktopk._plan(1, 131072, 3, None)
    assert len(fake_device) == 1


def test_topk_slot_mapping_needs_a_power_of_two_page():
    """The decode kernel maps positions to slots with a shift and a mask: pages of a
    power-of-two size only (others take the op's second launch); decode mode from the
    lengths' rank."""
    sizes = [0, 1, 2, 16, 48, 64, 96, 128, 1024]
    assert [ktopk.supports_slots(s) for s in sizes] == \
        [False, True, True, True, False, True, False, True, True]
    assert ktopk.decode_mode(np.zeros(3, np.int32)) == ktopk.MODE_DECODE
    assert ktopk.decode_mode(np.zeros((3, 2), np.int32)) == ktopk.MODE_DECODE_2D
    assert len({ktopk.MODE_ROWS, ktopk.MODE_DECODE, ktopk.MODE_DECODE_2D}) == 3


# ---- sparse MLA attention ---------------------------------------------------------------

def test_attention_kernels_cover_even_value_widths_of_their_head_dim():
    """The fp8 / bf16 kernels take 576-wide query heads, MODEL1 512-wide, and d_v even in
    (0, 512]."""
    d_vs = [512, 511, 510, 2, 1, 0, 513]
    want = [True, False, True, True, False, False, False]
    assert [katt.supports((4, 16, 576), d) for d in d_vs] == want
    assert [katt.supports_model1((4, 16, 512), d) for d in d_vs] == want
    assert not katt.supports((4, 16, 512), 512) and not katt.supports_model1((4, 16, 576), 512)
    assert not katt.supports((16, 576), 512)


@pytest.mark.parametrize("splits, ok", [(0, False), (1, True), (64, True), (65, False)])
def test_attention_plan_refuses_splits_past_its_scratch(fake_device, splits, ok):
    """A caller's split count must be 1..MAX_SPLITS (the combine kernel's bound); more than
    one split adds the combine kernel to the plan."""
    if not ok:
        with pytest.raises(ValueError, match="Invalid splits"):
            katt._plan(1, 128, 2048, "fp8", False, 0.1, splits)
        return
    units, got, fn, combine, _ = katt._plan(1, 128, 2048, "fp8", False, 0.1, splits)
    assert (units, got, fn.name) == (2, splits, "cps_sparse_mla_fp8")
    assert (combine is None) == (splits == 1)


@pytest.mark.parametrize("kind", ["fp8", "bf16", "model1"])
@pytest.mark.parametrize("out_name, suffix", [("float16", "_out_f16"),
                                              ("bfloat16", "_out_bf16")])
def test_attention_plan_of_a_16bit_out(fake_device, kind, out_name, suffix):
    """A 16-bit out: unsplit, the kind's kernel of that format (its epilogue writes the
    out); split, the float32 kernel (its partials are float32 either way) and the merge
    of that format, which writes the out."""
    _, _, fn, combine, _ = katt._plan(200, 128, 2048, kind, False, 0.1, 1, out_name)
    assert (fn.name, combine) == (f"cps_sparse_mla_{kind}{suffix}", None)
    _, _, fn, combine, _ = katt._plan(1, 128, 2048, kind, False, 0.1, 4, out_name)
    assert (fn.name, combine.name) == (f"cps_sparse_mla_{kind}",
                                       "cps_mla_combine_few_rows" + suffix)
    _, _, fn, combine, _ = katt._plan(1, 128, 2048, kind, False, 0.1, 4)
    assert (fn.name, combine.name) == (f"cps_sparse_mla_{kind}", "cps_mla_combine_few_rows")


def test_attention_partials_hold_rows_then_lse(monkeypatch):
    """The split-KV scratch: [T, H, splits, d_v] partial rows, then [T, H, splits] lse in
    the same float32 buffer; none for one split."""
    monkeypatch.setattr(raw_kernels, "empty", lambda cp, shape, dtype: (shape, dtype))
    assert katt._partials(np, 3, 128, 4, 512) == ((3 * 128 * 4 * 513,), np.float32)
    assert katt._partials(np, 3, 128, 1, 512) is None


# ---- indexer scoring ------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256])
def test_decode_plan_pages_of_a_power_of_two_from_4(block_size):
    """The per-page decode kernels shift and mask positions into pages: a power of two
    of at least 4 keys, else no plan (the reference runs)."""
    plan = kin.decode_plan(8, 1, 64, 32768, block_size, 132, 233472)
    ok = block_size >= 4 and block_size & (block_size - 1) == 0
    assert (plan is not None) == ok


@pytest.mark.parametrize("next_n, heads, nc, nch", [
    (1, 64, 64, 1), (1, 57, 64, 1), (1, 65, 128, 1), (2, 64, 128, 1), (4, 128, 128, 4),
    (3, 16, 64, 1), (5, 16, 128, 1)])
def test_decode_plan_column_chunks(next_n, heads, nc, nch):
    """A CTA's columns (next_n rows of the heads padded to 8) in one 64-column chunk when
    they fit, else 128-column chunks."""
    variant, got_nc, got_nch, hp = kin.decode_plan(8, next_n, heads, 32768, 64, 132, 233472)[:4]
    assert (got_nc, got_nch, hp) == (nc, nch, -(-heads // 8) * 8)
    assert variant == ("n64" if nc == 64 else "n128m")


@pytest.mark.parametrize("next_n, heads", [(5, 128), (9, 64), (65, 8)])
def test_decode_plan_refuses_more_query_columns_than_a_cta_holds(next_n, heads):
    """More than MAX_QROWS columns (or MAX_ROWS query rows) a CTA: no plan."""
    assert kin.decode_plan(8, next_n, heads, 32768, 64, 132, 233472) is None
    assert kin.decode_plan(8, next_n - 1, heads, 32768, 64, 132, 233472) is not None


@pytest.mark.parametrize("block_size", [4, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("batch, width", [(1, 1000), (1, 65536), (1, 1 << 20), (4096, 1 << 20)])
def test_decode_plan_pieces_fit_the_page_id_buffer(block_size, batch, width):
    """A piece's page ids fit the CTA's BT_CAP buffer, one more for a piece that starts
    inside a page, at every page size (4096 requests of 1M keys: pieces at the cap)."""
    pt = kin.decode_plan(batch, 1, 64, width, block_size, 132, 233472)[5]
    assert pt * kin.TILE // block_size + 1 <= kin.BT_CAP


def test_fixed_head_and_warp_specialized_kernels_cover_only_their_shapes():
    """The kernels built for 64 padded heads exist on the wgmma path only; the
    warp-specialized decode takes head_dim 128 alone."""
    assert kin.has_fixed_head_kernel("wgmma", 64)
    assert not kin.has_fixed_head_kernel("mma", 64)
    assert not kin.has_fixed_head_kernel("wgmma", 128)
    assert kin.uses_ws_decode("wgmma", 1, 64, 128, 64)
    assert not kin.uses_ws_decode("wgmma", 1, 64, 64, 64)


@pytest.mark.parametrize("block_size, path, planned", [
    (64, "wgmma", True), (128, "wgmma", True), (32, "wgmma", False), (64, "mma", False)])
def test_mxfp4_decode_only_on_wgmma_over_pages_of_64_or_more(fake_device, block_size, path,
                                                                planned):
    """MXFP4 keys are scored by the wgmma kernels from pages of >= 64 keys; elsewhere the
    plan is None (the op falls back to the reference, with its warning)."""
    got_path, plan, fn = kin.paged_plan(8, 3, 64, 128, 32768, block_size, path, fp4=True)
    assert got_path == path and (plan is not None) == planned and (fn is not None) == planned
    if planned:
        assert fn.name.startswith("cps_paged_mqa_logits_fp4_wgmma_"), fn.name


@pytest.mark.parametrize("batch, width, fp4, stream", [
    (1, 32768, False, False),      # 4.3 MB of pages: a replayed call finds them in L2
    (8, 32768, False, True),       # 34.6 MB: past half the 50 MB L2
    (64, 32768, False, True),
    (256, 4096, False, True),
    (4, 131072, False, True),
    (4, 131072, True, True),       # MXFP4, 68 bytes a key: 35.7 MB
    (8, 32768, True, False),       # 17.8 MB
    (4, 32768, True, False),       # 8.9 MB
])
def test_decode_pages_stream_past_half_the_l2(batch, width, fp4, stream):
    """The ws decode kernels copy the pages evict-first (l2_stream) exactly when the batch's
    pages (fp8 132 bytes a key, MXFP4 68) exceed half the L2."""
    keys = batch * width                   # a cache of as many keys as the batch reads
    assert kin.l2_streams(batch, width, fp4, 50 << 20, keys) is stream
    pages = batch * width * (68 if fp4 else 132)
    assert kin.l2_streams(batch, width, fp4, 2 * pages, keys) is False
    assert kin.l2_streams(batch, width, fp4, 2 * pages - 1, keys) is True
    # a cache of fewer keys than batch x width bounds the bytes read
    assert kin.l2_streams(batch, width, fp4, 2 * pages - 1, batch * width - 1) is False
    assert kin.l2_streams(batch, width, fp4, 2 * pages - 1, batch * width) is True


# ---- prefill scoring: the tensor maps of the ws kernels --------------------------------

@pytest.mark.parametrize("heads", [64, 60, 24, 128, 8])
def test_prefill_tensor_maps_give_the_kernels_boxes(monkeypatch, heads):
    """prefill_map_encoders: the query codes as [m][heads][D] in boxes of a query block
    (D x hp x 128 // hp: the bytes the kernel expects on QFULL, 128 hp rpc), the key codes
    as [n][D] in boxes of a stage under the 128-byte swizzle of its ring and the scales as
    [n] in boxes of a stage (together the KEYS (D + 4) bytes it expects on a KFULL), zeros
    out of bounds (CPU: the driver faked, its arguments recorded)."""
    calls = []

    def encode(at, dtype, rank, ptr, dims, strides, box, estr, inter, swizzle, l2, oob):
        calls.append((dtype, list(dims[:rank]), list(strides[:rank - 1]), list(box[:rank]),
                      swizzle, oob))
        return 0
    monkeypatch.setattr(raw_kernels, "_driver_fn", lambda name: encode)
    m, n = 1000, 5000
    hp = -(-heads // 8) * 8
    for encoder, ptr in zip(kin.prefill_map_encoders(m, heads, n), (1 << 20, 2 << 20, 3 << 20)):
        assert len(encoder(ptr)) == 128
    u8, f32, swz = raw_kernels.TMAP_UINT8, raw_kernels.TMAP_FLOAT32, raw_kernels.TMAP_SWIZZLE_128B
    keys = kin.TILE * kin.WS_MATH
    assert calls == [(u8, [kin.D, heads, m], [kin.D, heads * kin.D], [kin.D, hp, 128 // hp],
                      swz, 0),
                     (u8, [kin.D, n], [kin.D], [kin.D, keys], swz, 0),
                     (f32, [n], [], [keys], raw_kernels.TMAP_SWIZZLE_NONE, 0)]
