"""Byte layouts of the two paged caches, array-generic (no validation here).

Indexer key cache (vLLM, byte-compatible): ``uint8 [num_blocks, B * (D + 4)]``.
Inside a page: ``B * D`` fp8 codes, token-major, then ``B`` float32 scales.

MLA cache ``fp8_ds_mla`` (FlashMLA / vLLM): ``uint8 [num_blocks, B, T]`` with
one record of ``T = L + 4 * (L // 128) + 2 * R`` bytes per token (656 for
L = 512, R = 64): L e4m3 codes of the latent, L // 128 float32 scales, then R
bfloat16 RoPE values.
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

def indexer_insert(data: Array, block_size: int, head_dim: int, codes: Array, scales: Array,
                   slot_mapping: Array) -> None:
    """Scatter codes [N, D] uint8 and scales [N] float32 into the pages.

    Slot -1 is skipped, and so is any slot outside the cache (never written).
    """
    xp = xp_of(data)
    page = block_size * (head_dim + 4)
    valid = (slot_mapping >= 0) & (slot_mapping < data.shape[0] * block_size)
    slots = slot_mapping[valid].astype(xp.int64)
    if slots.size == 0:
        return
    blk, off = slots // block_size, slots % block_size
    flat = data.reshape(-1)
    code_pos = (blk * page + off * head_dim)[:, None] + xp.arange(head_dim)
    flat[code_pos] = codes[valid]
    scale_pos = (blk * page + block_size * head_dim + 4 * off)[:, None] + xp.arange(4)
    flat[scale_pos] = _as_u8(xp, scales[valid].astype(xp.float32)[:, None], 4)


def indexer_read(data: Array, block_size: int, head_dim: int, blocks: Array,
                 offsets: Array) -> tuple[Array, Array]:
    """codes [N, D] uint8 and scales [N] float32 of (page, offset) pairs.

    A page id outside ``[0, num_blocks)`` reads nothing: zero codes, zero scale.
    """
    xp = xp_of(data)
    page = block_size * (head_dim + 4)
    blocks = blocks.astype(xp.int64)
    offsets = offsets.astype(xp.int64)
    ok = (blocks >= 0) & (blocks < data.shape[0])
    blocks, offsets = blocks[ok], offsets[ok]
    flat = data.reshape(-1)
    codes = xp.zeros((ok.shape[0], head_dim), dtype=xp.uint8)
    codes[ok] = flat[(blocks * page + offsets * head_dim)[:, None] + xp.arange(head_dim)]
    sbytes = flat[(blocks * page + block_size * head_dim + 4 * offsets)[:, None] + xp.arange(4)]
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


def mla_quantize(kv_c: Array) -> tuple[Array, Array]:
    """codes [N, L] uint8 and scales [N, L // 128] float32 with
    ``scale = max(amax / 448, FLT_MIN)`` (not a power of two).

    ``max(amax, 448 * FLT_MIN) / 448`` equals that exactly: 448 * FLT_MIN is
    exact and correctly rounded division is monotone.
    """
    return fp8.quantize_groups(kv_c, MLA_QUANT_BLOCK, None, fp8.E4M3_MAX * fp8.FLT_MIN)


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
