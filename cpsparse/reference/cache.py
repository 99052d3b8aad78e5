"""Byte layouts of the two paged caches, array-generic (no validation here).

Indexer key cache (vLLM, byte-compatible): ``uint8 [num_blocks, B * (D + 4)]``.
Inside a page: ``B * D`` fp8 codes, token-major, then ``B`` float32 scales.

MLA cache ``fp8_ds_mla`` (FlashMLA / vLLM): ``uint8 [num_blocks, B, T]`` with
one record of ``T = L + 4 * (L // 128) + 2 * R`` bytes per token (656 for
L = 512, R = 64): L e4m3 codes of the latent, L // 128 float32 scales, then R
bfloat16 RoPE values.

MLA cache ``model1`` (DeepSeek-V4, FlashMLA's MODEL1_FP8Sparse), 584 bytes a token:
``uint8 [num_blocks, P]``. A page holds the B token rows first, each 448 e4m3
codes of the NoPE part then 64 bfloat16 RoPE values (576 bytes), then per token
7 ue8m0 scale bytes (one per 64 codes, ``2 ** (byte - 127)``) and a zero pad
byte; P is ``B * 584`` rounded up to a multiple of 576.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy

from cpsparse import paging
from cpsparse.reference import fp8
from cpsparse.reference._xp import xp_of

if TYPE_CHECKING:
    from cpsparse._typing import Array

MLA_QUANT_BLOCK = 128


def _as_u8(xp, a, n):
    """Little-endian bytes of a 4- or 2-byte array, shaped [..., n]."""
    a = xp.ascontiguousarray(a)
    return a.view(xp.uint8).reshape(a.shape[:-1] + (n,)) if a.ndim else a.view(xp.uint8)


# ---- indexer key cache -------------------------------------------------------

def indexer_layout(head_dim: int, fmt: str = "fp8") -> tuple[int, int]:
    """(code bytes, scale bytes) of one key: fp8 ``(D, 4)`` (one float32 scale);
    mxfp4 ``(D / 2, 4 * ceil(D / 128))`` (packed e2m1, then one ue8m0 byte per 32
    values, padded with 127 = 2**0 to whole int32 words, as DeepGEMM packs them)."""
    if fmt == "fp8":
        return head_dim, 4
    return head_dim // 2, 4 * -(-head_dim // 128)


def indexer_insert(data: Array, block_size: int, head_dim: int, codes: Array, scales: Array,
                   slot_mapping: Array, fmt: str = "fp8") -> None:
    """Scatter codes and scales into the pages: fp8 codes [N, D] uint8 and scales
    [N] float32, or mxfp4 packed codes [N, D / 2] and scale bytes [N, D / 32].

    Slot -1 is skipped, and so is any slot outside the cache (never written).
    """
    xp = xp_of(data)
    cb, sb = indexer_layout(head_dim, fmt)
    page = block_size * (cb + sb)
    valid = (slot_mapping >= 0) & (slot_mapping < data.shape[0] * block_size)
    slots = slot_mapping[valid].astype(xp.int64)
    if slots.size == 0:
        return
    blk, off = slots // block_size, slots % block_size
    flat = data.reshape(-1)
    code_pos = (blk * page + off * cb)[:, None] + xp.arange(cb)
    flat[code_pos] = codes[valid]
    scale_pos = (blk * page + block_size * cb + sb * off)[:, None] + xp.arange(sb)
    if fmt == "fp8":
        flat[scale_pos] = _as_u8(xp, scales[valid].astype(xp.float32)[:, None], 4)
    else:
        words = xp.full((slots.shape[0], sb), 127, dtype=xp.uint8)
        words[:, :scales.shape[1]] = scales[valid]
        flat[scale_pos] = words


def indexer_read(data: Array, block_size: int, head_dim: int, blocks: Array,
                 offsets: Array, fmt: str = "fp8") -> tuple[Array, Array]:
    """codes and scales of (page, offset) pairs, as :func:`indexer_insert` takes them.

    A page id outside ``[0, num_blocks)`` reads nothing: zero codes, zero scale (fp8)
    or scale bytes 0 (mxfp4, 2**-127: a zero key).
    """
    xp = xp_of(data)
    cb, sb = indexer_layout(head_dim, fmt)
    page = block_size * (cb + sb)
    blocks = blocks.astype(xp.int64)
    offsets = offsets.astype(xp.int64)
    ok = (blocks >= 0) & (blocks < data.shape[0])
    blocks, offsets = blocks[ok], offsets[ok]
    flat = data.reshape(-1)
    codes = xp.zeros((ok.shape[0], cb), dtype=xp.uint8)
    codes[ok] = flat[(blocks * page + offsets * cb)[:, None] + xp.arange(cb)]
    sbytes = flat[(blocks * page + block_size * cb + sb * offsets)[:, None] + xp.arange(sb)]
    if fmt != "fp8":
        scales = xp.zeros((ok.shape[0], head_dim // 32), dtype=xp.uint8)
        scales[ok] = sbytes[:, :head_dim // 32]
        return codes, scales
    scales = xp.zeros(ok.shape[0], dtype=xp.float32)
    scales[ok] = xp.ascontiguousarray(sbytes).view(xp.float32).reshape(-1)
    return codes, scales


def request_positions(cu_seq_lens: Array, block_table: Array,
                      block_size: int) -> tuple[Array, Array]:
    """(page, offset) of every token of a packed batch; cu_seq_lens is host int64.

    A position past its request's table row gets page -1 (read as nothing).
    """
    xp = xp_of(block_table)
    req, pos = paging.expand(numpy.diff(cu_seq_lens))
    col = pos // block_size
    inside = col < block_table.shape[1]
    req, col, inside = xp.asarray(req), xp.asarray(col), xp.asarray(inside)
    blocks = xp.full(req.shape, -1, dtype=xp.int64)
    blocks[inside] = block_table[req[inside], col[inside]]
    return blocks, xp.asarray(pos % block_size)


# ---- MLA fp8_ds_mla cache ----------------------------------------------------

def mla_token_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    return kv_lora_rank + 4 * (kv_lora_rank // MLA_QUANT_BLOCK) + 2 * rope_dim


# The group maximum's floor of fp8_ds_mla: scale = max(amax, MLA_SCALE_EPS) / 448.
MLA_SCALE_EPS = fp8.E4M3_MAX * fp8.FLT_MIN


def mla_quantize(kv_c: Array) -> tuple[Array, Array]:
    """codes [N, L] uint8 and scales [N, L // 128] float32 with
    ``scale = max(amax / 448, FLT_MIN)`` (not a power of two).

    ``max(amax, 448 * FLT_MIN) / 448`` equals that exactly: 448 * FLT_MIN is
    exact and correctly rounded division is monotone.
    """
    return fp8.quantize_groups(kv_c, MLA_QUANT_BLOCK, None, MLA_SCALE_EPS)


def mla_encode(kv_c: Array, k_pe: Array) -> Array:
    """fp8_ds_mla records uint8 [N, T] of latent [N, L] and RoPE part [N, R]."""
    xp = xp_of(kv_c)
    codes, scales = mla_quantize(kv_c)
    n, lora = codes.shape
    rope = fp8.bf16_encode(fp8.to_float32(k_pe))
    return xp.concatenate([codes, _as_u8(xp, scales, 4 * (lora // MLA_QUANT_BLOCK)),
                           _as_u8(xp, rope, 2 * rope.shape[-1])], axis=1)


def mla_decode(records: Array, kv_lora_rank: int, rope_dim: int) -> Array:
    """float32 [N, L + R]: dequantized latent then RoPE part, from records [N, T]."""
    xp = xp_of(records)
    lora, groups = kv_lora_rank, kv_lora_rank // MLA_QUANT_BLOCK
    codes = records[:, :lora]
    scales = xp.ascontiguousarray(records[:, lora:lora + 4 * groups]).view(xp.float32)
    rope_bits = xp.ascontiguousarray(records[:, lora + 4 * groups:
                                             lora + 4 * groups + 2 * rope_dim]).view(xp.uint16)
    latent = fp8.dequantize_groups(xp.ascontiguousarray(codes), scales, MLA_QUANT_BLOCK)
    return xp.concatenate([latent, fp8.bf16_decode(rope_bits)], axis=1)


def mla_insert(data: Array, records: Array, slot_mapping: Array) -> None:
    """Write records [N, T] into data [num_blocks, B, T]; slot -1 and any slot outside
    the cache are skipped (never written)."""
    flat = data.reshape(-1, data.shape[-1])
    valid = (slot_mapping >= 0) & (slot_mapping < flat.shape[0])
    flat[slot_mapping[valid].astype(xp_of(data).int64)] = records[valid]


def mla_read(data: Array, slots: Array, kv_lora_rank: int, rope_dim: int) -> Array:
    """Dequantized rows float32 [N, L + R] of global slots; a slot outside the cache
    reads nothing and gives a zero row."""
    xp = xp_of(data)
    flat = data.reshape(-1, data.shape[-1])
    slots = slots.astype(xp.int64)
    ok = (slots >= 0) & (slots < flat.shape[0])
    rows = xp.zeros((slots.shape[0], kv_lora_rank + rope_dim), dtype=xp.float32)
    rows[ok] = mla_decode(flat[slots[ok]], kv_lora_rank, rope_dim)
    return rows


# ---- MLA cache, MODEL1 layout (DeepSeek-V4) ------------------------------------

MODEL1_NOPE, MODEL1_ROPE, MODEL1_TILE = 448, 64, 64
MODEL1_ROW = MODEL1_NOPE + 2 * MODEL1_ROPE            # 576 bytes: codes, then bf16 RoPE
MODEL1_SCALES = MODEL1_NOPE // MODEL1_TILE            # 7 ue8m0 bytes, then 1 pad byte
MODEL1_TOKEN_BYTES = MODEL1_ROW + MODEL1_SCALES + 1   # 584
MODEL1_SCALE_FLOOR = 1e-4                              # least scale before the ue8m0 rounding


def model1_page_bytes(block_size: int) -> int:
    """Bytes of one MODEL1 page: ``block_size * 584`` rounded up to a multiple of 576."""
    return -(-block_size * MODEL1_TOKEN_BYTES // MODEL1_ROW) * MODEL1_ROW


def model1_encode(k_nope: Array, k_pe: Array) -> tuple[Array, Array]:
    """(rows uint8 [N, 576], scale bytes uint8 [N, 8]) of k_nope [N, 448], k_pe [N, 64].

    Per 64-value tile: ``scale = 2 ** ceil(log2(max(float32(amax / 448), 1e-4)))``
    (FlashMLA's quantizer), codes = e4m3(value / scale), byte = log2(scale) + 127:
    the ue8m0 group quantizer of the fp8 module with its floor 1e-4 * 448 on amax
    (the same power of two: 1e-4 is far from one).
    """
    xp = xp_of(k_nope)
    codes, scales = fp8.quantize_groups(k_nope, MODEL1_TILE, "ue8m0",
                                        MODEL1_SCALE_FLOOR * fp8.E4M3_MAX)
    rope = _as_u8(xp, fp8.bf16_encode(fp8.to_float32(k_pe)), 2 * MODEL1_ROPE)
    scale_bytes = xp.zeros((codes.shape[0], MODEL1_SCALES + 1), dtype=xp.uint8)
    scale_bytes[:, :MODEL1_SCALES] = (fp8.ceil_log2(scales) + 127).astype(xp.uint8)
    return xp.concatenate([codes, rope], axis=1), scale_bytes


def _model1_views(data: Array, block_size: int) -> tuple[Array, Array]:
    """(rows [num_blocks, B, 576], scale bytes [num_blocks, B, 8]) views of the pages
    (views, not copies: only the last axis is split)."""
    nb = data.shape[0]
    rows = data[:, :block_size * MODEL1_ROW].reshape(nb, block_size, MODEL1_ROW)
    end = block_size * MODEL1_TOKEN_BYTES
    scales = data[:, block_size * MODEL1_ROW:end].reshape(nb, block_size, MODEL1_SCALES + 1)
    return rows, scales


def model1_insert(data: Array, block_size: int, rows: Array, scale_bytes: Array,
                  slot_mapping: Array) -> None:
    """Write encoded tokens into MODEL1 pages data [num_blocks, P]; slot -1 and any
    slot outside the cache are skipped."""
    xp = xp_of(data)
    page_rows, page_scales = _model1_views(data, block_size)
    valid = (slot_mapping >= 0) & (slot_mapping < data.shape[0] * block_size)
    slots = slot_mapping[valid].astype(xp.int64)
    page, off = slots // block_size, slots % block_size
    page_rows[page, off] = rows[valid]
    page_scales[page, off] = scale_bytes[valid]


def model1_read(data: Array, block_size: int, slots: Array) -> Array:
    """float32 [N, 512] (dequantized NoPE, then RoPE) of global slots; a slot outside
    the cache reads nothing and gives a zero row."""
    xp = xp_of(data)
    page_rows, page_scales = _model1_views(data, block_size)
    slots = slots.astype(xp.int64)
    ok = (slots >= 0) & (slots < data.shape[0] * block_size)
    page, off = slots[ok] // block_size, slots[ok] % block_size
    out = xp.zeros((slots.shape[0], MODEL1_NOPE + MODEL1_ROPE), dtype=xp.float32)
    rows, scales = page_rows[page, off], page_scales[page, off, :MODEL1_SCALES]
    codes = fp8.e4m3_decode(xp.ascontiguousarray(rows[:, :MODEL1_NOPE])).astype(xp.float64)
    nope = (codes.reshape(-1, MODEL1_SCALES, MODEL1_TILE)
            * fp8.ue8m0_value(scales)[..., None]).reshape(
        -1, MODEL1_NOPE)
    rope = fp8.bf16_decode(xp.ascontiguousarray(rows[:, MODEL1_NOPE:]).view(xp.uint16))
    out[ok] = xp.concatenate([nope.astype(xp.float32), rope], axis=1)
    return out
