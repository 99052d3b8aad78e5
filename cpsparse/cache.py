"""Paged caches: the indexer key cache and the fp8_ds_mla MLA cache.

Both are thin owners of one ``uint8`` array in the exact byte layout vLLM
uses, so a cache made by vLLM (handed over zero-copy through DLPack) can be
wrapped with :meth:`IndexerKCache.wrap` / :meth:`MLAKVCache.wrap` and read by
cpsparse, and the other way round.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy

from cpsparse import _backend
from cpsparse import _validation as V
from cpsparse import paging
from cpsparse.raw_kernels import quant as _kquant
from cpsparse.reference import cache as _ref
from cpsparse.reference import fp8 as _fp8

if TYPE_CHECKING:
    from types import ModuleType

    from cpsparse._typing import Array, IntLike, ModuleLike, ScaleFormat

__all__ = ["IndexerKCache", "MLAKVCache"]


def _check_slot_mapping(xp, slot_mapping, n, num_slots):
    V.check_index("slot_mapping", slot_mapping, shape=(n,),
                  shape_desc="[N] (one slot per key)")
    V.check_slots(xp, slot_mapping, num_slots)


def _check_kv_lora_rank(kv_lora_rank):
    V.check_positive_int("kv_lora_rank", kv_lora_rank)
    if kv_lora_rank % _ref.MLA_QUANT_BLOCK:
        raise ValueError(f"Invalid kv_lora_rank: expected a multiple of "
                         f"{_ref.MLA_QUANT_BLOCK} (one fp8_ds_mla scale per "
                         f"{_ref.MLA_QUANT_BLOCK} values), got {kv_lora_rank}")


class IndexerKCache:
    """Paged FP8 key cache of the lightning indexer (vLLM byte layout).

    ``data`` is ``uint8 [num_blocks, block_size * (head_dim + 4)]``. Inside a
    page the first ``block_size * head_dim`` bytes are the e4m3 codes,
    token-major; the last ``4 * block_size`` bytes are one float32 scale per
    token. Slot ``s`` is page ``s // block_size``, offset ``s % block_size``.

    Parameters
    ----------
    num_blocks : int
    block_size : int
        Tokens per page (64 in DeepSeek-V3.2).
    head_dim : int
        Indexer head dimension D (128); one scale per key (quant block = D).
    xp : module or str
        ``numpy`` or ``cupy``: where the pages live.
    scale_fmt : {"ue8m0", None}
        Scale format used by :meth:`insert` (DeepSeek-V3.2 uses ue8m0).

    Examples
    --------
    >>> import numpy as np, cpsparse
    >>> cache = cpsparse.IndexerKCache(num_blocks=4, block_size=64, head_dim=128)
    >>> cache.data.shape
    (4, 8448)
    >>> k = np.random.default_rng(0).standard_normal((3, 128)).astype(np.float32)
    >>> cache.insert(k, np.array([5, -1, 130], dtype=np.int32))   # -1 is skipped
    >>> codes, scales = cache.gather(np.array([[0, 1, 2]], np.int32),
    ...                              np.array([0, 131], np.int32))
    >>> codes.shape, scales.shape
    ((131, 128), (131,))
    >>> bool(np.array_equal(codes[5], cpsparse.quantize_fp8(k[:1])[0][0]))
    True
    """

    KEY_EPS = 1e-4

    def __init__(self, num_blocks: IntLike, block_size: IntLike = 64, head_dim: IntLike = 128,
                 xp: ModuleLike = numpy, scale_fmt: ScaleFormat = "ue8m0") -> None:
        xp = _backend.backend_module(xp)
        V.check_nonnegative_int("num_blocks", num_blocks)
        V.check_positive_int("block_size", block_size)
        V.check_positive_int("head_dim", head_dim)
        V.check_choice("scale_fmt", scale_fmt, ("ue8m0", None))
        data = xp.zeros((num_blocks, block_size * (head_dim + 4)), dtype=xp.uint8)
        self._setup(data, block_size, head_dim, scale_fmt)

    @classmethod
    def wrap(cls, data: Array, block_size: IntLike = 64, head_dim: IntLike = 128,
             scale_fmt: ScaleFormat = "ue8m0", name: str = "data") -> IndexerKCache:
        """Use an existing cache array without copying it.

        ``data`` is ``uint8 [num_blocks, block_size * (head_dim + 4)]``, or the
        ``[num_blocks, block_size, head_dim + 4]`` container view vLLM may hand
        over, or DeepGEMM's ``[num_blocks, block_size, 1, head_dim + 4]`` (same
        bytes; viewed as 2-D).
        """
        self = cls.__new__(cls)
        _backend.get_array_module(**{name: data})
        V.check_positive_int("block_size", block_size)
        V.check_positive_int("head_dim", head_dim)
        data = V.squeeze_axis(name, data, 2, 4)     # DeepGEMM's [num_blocks, bs, 1, D + 4]
        if getattr(data, "ndim", None) == 3:
            V.check_array(name, data, dtype="uint8", shape=(None, block_size, head_dim + 4),
                          shape_desc="[num_blocks, block_size, head_dim + 4]")
            data = data.reshape(data.shape[0], -1)
        V.check_array(name, data, ndim=2, dtype="uint8",
                      shape=(None, block_size * (head_dim + 4)),
                      shape_desc="[num_blocks, block_size * (head_dim + 4)]")
        self._setup(data, block_size, head_dim, scale_fmt)
        return self

    @classmethod
    def trusted_view(cls, data: Array, block_size: int, head_dim: int,
                     xp: ModuleType) -> IndexerKCache:
        """:meth:`wrap` of an array whose layout already passed :meth:`wrap`'s checks
        (an op's memo of its argument layouts): no checks, the 2-D view only."""
        self = cls.__new__(cls)
        self.block_size, self.head_dim, self.scale_fmt = block_size, head_dim, "ue8m0"
        self.data = data if data.ndim == 2 else data.reshape(data.shape[0], -1)
        self.xp = xp
        return self

    def _setup(self, data: Array, block_size: IntLike, head_dim: IntLike,
               scale_fmt: ScaleFormat) -> None:
        self.block_size = V.check_positive_int("block_size", block_size)
        self.head_dim = V.check_positive_int("head_dim", head_dim)
        self.scale_fmt = V.check_choice("scale_fmt", scale_fmt, ("ue8m0", None))
        self.data = data
        self.xp = _backend.get_array_module(data=data)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def page_bytes(self) -> int:
        return self.block_size * (self.head_dim + 4)

    def __repr__(self):
        return (f"IndexerKCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"head_dim={self.head_dim}, xp={self.xp.__name__})")

    def codes_view(self) -> Array:
        """uint8 [num_blocks, block_size, head_dim] view of the codes (no copy)."""
        bs, d = self.block_size, self.head_dim
        return self.data[:, :bs * d].reshape(self.num_blocks, bs, d)

    def scales_view(self) -> Array:
        """float32 [num_blocks, block_size] view of the per-token scales (no copy)."""
        return self.data[:, self.block_size * self.head_dim:].view(self.xp.float32)

    def insert(self, k: Array, slot_mapping: Array) -> None:
        """Quantize keys ``k`` [N, head_dim] (one ue8m0 scale each) and store them.

        Slot -1 is skipped (padding tokens). Two keys for one slot: the last wins.
        """
        xp = _backend.get_array_module(k=k, slot_mapping=slot_mapping, data=self.data)
        V.check_array("k", k, ndim=2, dtype=V.FLOAT_DTYPES, shape=(None, self.head_dim),
                      shape_desc="[N, head_dim]")
        _check_slot_mapping(xp, slot_mapping, k.shape[0], self.num_slots)
        self.insert_core(xp, k, slot_mapping)

    def insert_core(self, xp: ModuleType, k: Array, slot_mapping: Array) -> None:
        """:meth:`insert` without validation (the layer path validated its batch)."""
        if _backend.use_kernels(xp):
            if _kquant.supports_group(self.head_dim):
                return _kquant.indexer_insert(xp, self, k, slot_mapping, self.KEY_EPS)
            _backend.warn_fallback("IndexerKCache.insert", (self.head_dim,), "this head_dim")
        codes, scales = _fp8.quantize_groups(k, self.head_dim, self.scale_fmt, self.KEY_EPS)
        _ref.indexer_insert(self.data, self.block_size, self.head_dim, codes,
                            scales.reshape(-1), slot_mapping)

    def insert_quantized(self, codes: Array, scales: Array, slot_mapping: Array) -> None:
        """Store already quantized keys: codes uint8 [N, head_dim], scales float32 [N]."""
        xp = _backend.get_array_module(codes=codes, scales=scales, slot_mapping=slot_mapping,
                                       data=self.data)
        codes = V.check_codes("codes", codes, ndim=2, shape=(None, self.head_dim),
                              shape_desc="[N, head_dim]")
        V.check_array("scales", scales, dtype="float32", shape=(codes.shape[0],),
                      shape_desc="[N]")
        _check_slot_mapping(xp, slot_mapping, codes.shape[0], self.num_slots)
        _ref.indexer_insert(self.data, self.block_size, self.head_dim, codes, scales,
                            slot_mapping)

    def gather(self, block_table: Array, cu_seq_lens: Array) -> tuple[Array, Array]:
        """Read the keys of a packed batch of requests.

        Parameters
        ----------
        block_table : int32 [R, max_blocks]
            Page ids of each request, in position order.
        cu_seq_lens : int32 [R + 1]
            Cumulative key counts; request r owns rows ``cu[r]:cu[r+1]``.

        Returns
        -------
        codes : uint8 [N, head_dim], scales : float32 [N]
            ``N = cu_seq_lens[-1]``; row n of request r is position
            ``n - cu[r]`` of that request.
        """
        xp = _backend.get_array_module(block_table=block_table, cu_seq_lens=cu_seq_lens,
                                       data=self.data)
        V.check_index("block_table", block_table, ndim=2,
                      shape_desc="[R, max_blocks]")
        V.check_index("cu_seq_lens", cu_seq_lens,
                      shape=(block_table.shape[0] + 1,), shape_desc="[R + 1]")
        cu = V.check_cu_seq_lens(xp, cu_seq_lens)
        lens = numpy.diff(cu)
        V.check_block_table(xp, lens, block_table, self.block_size, self.num_blocks)
        return self.gather_core(xp, block_table, cu_seq_lens, cu)

    def gather_core(self, xp: ModuleType, block_table: Array, cu_seq_lens: Array,
                    cu_host: numpy.ndarray[Any, Any], key_req_ids: Array | None = None
                    ) -> tuple[Array, Array]:
        """:meth:`gather` without validation. ``cu_host`` is the host int64 copy of
        ``cu_seq_lens``; ``key_req_ids`` (int32 [N], the request of each key, on the
        cache's device) spares the upload the kernel path needs otherwise (the batch
        metadata carries it)."""
        if _backend.use_kernels(xp):
            if _kquant.supports_group(self.head_dim):
                if key_req_ids is None:
                    key_req_ids = xp.asarray(paging.expand(numpy.diff(cu_host))[0]
                                             .astype(numpy.int32))
                return _kquant.indexer_gather(xp, self, block_table, cu_seq_lens,
                                              int(cu_host[-1]), key_req_ids)
            _backend.warn_fallback("IndexerKCache.gather", (self.head_dim,), "this head_dim")
        blocks, offsets = _ref.request_positions(cu_host, block_table, self.block_size)
        return _ref.indexer_read(self.data, self.block_size, self.head_dim, blocks, offsets)


class MLAKVCache:
    """Paged MLA latent cache in the ``fp8_ds_mla`` layout (FlashMLA, vLLM).

    ``data`` is ``uint8 [num_blocks, block_size, token_bytes]``; each token
    record holds ``kv_lora_rank`` e4m3 codes of the latent ``kv_c``, one
    float32 scale per 128 of them (``max(amax / 448, FLT_MIN)``, not a power of
    two), then ``rope_dim`` bfloat16 values of ``k_pe``: 656 bytes for
    DeepSeek-V3.2 (512 + 16 + 128).

    Parameters
    ----------
    num_blocks, block_size : int
    kv_lora_rank : int
        Latent width L, a multiple of 128 (512).
    rope_dim : int
        RoPE width R (64).
    xp : module or str

    Examples
    --------
    >>> import numpy as np, cpsparse
    >>> cache = cpsparse.MLAKVCache(num_blocks=2, block_size=64)
    >>> cache.data.shape
    (2, 64, 656)
    >>> rng = np.random.default_rng(0)
    >>> kv_c = rng.standard_normal((2, 512)).astype(np.float32)
    >>> k_pe = rng.standard_normal((2, 64)).astype(np.float32)
    >>> cache.insert(kv_c, k_pe, np.array([0, 70], np.int32))
    >>> rows = cache.gather(np.array([70, 0], np.int32))      # float32 [2, 576]
    >>> bool(np.abs(rows[0, :512] - kv_c[1]).max() < 0.07 * np.abs(kv_c[1]).max())
    True
    """

    def __init__(self, num_blocks: IntLike, block_size: IntLike = 64, kv_lora_rank: int = 512,
                 rope_dim: int = 64, xp: ModuleLike = numpy) -> None:
        xp = _backend.backend_module(xp)
        V.check_nonnegative_int("num_blocks", num_blocks)
        _check_kv_lora_rank(kv_lora_rank)
        V.check_nonnegative_int("rope_dim", rope_dim)
        nbytes = _ref.mla_token_bytes(kv_lora_rank, rope_dim)
        data = xp.zeros((num_blocks, V.check_positive_int("block_size", block_size), nbytes),
                        dtype=xp.uint8)
        self._setup(data, kv_lora_rank, rope_dim)

    @classmethod
    def wrap(cls, data: Array, kv_lora_rank: int = 512, rope_dim: int = 64,
             name: str = "data") -> MLAKVCache:
        """Use an existing ``uint8 [num_blocks, block_size, token_bytes]`` array.

        FlashMLA's view ``[num_blocks, block_size, 1, token_bytes]`` is accepted too,
        and on NumPy a ``float8_e4m3fn`` array of those bytes (viewed as uint8).
        """
        self = cls.__new__(cls)
        _backend.get_array_module(**{name: data})
        _check_kv_lora_rank(kv_lora_rank)
        V.check_nonnegative_int("rope_dim", rope_dim)
        data = V.squeeze_axis(name, data, 2, 4)     # FlashMLA's [num_blocks, bs, 1, bytes]
        data = V.check_codes(name, data, ndim=3,
                             shape=(None, None, _ref.mla_token_bytes(kv_lora_rank, rope_dim)),
                             shape_desc="[num_blocks, block_size, token_bytes]")
        self._setup(data, kv_lora_rank, rope_dim)
        return self

    @classmethod
    def trusted_view(cls, data: Array, kv_lora_rank: int, rope_dim: int,
                     xp: ModuleType) -> MLAKVCache:
        """:meth:`wrap` of an array whose layout already passed :meth:`wrap`'s checks
        (an op's memo of its argument layouts): no checks."""
        self = cls.__new__(cls)
        if data.ndim == 4:                       # FlashMLA's [num_blocks, bs, 1, bytes]
            data = data.reshape(data.shape[0], data.shape[1], data.shape[3])
        if data.dtype != numpy.uint8:            # NumPy's float8_e4m3fn bytes
            data = data.view(numpy.uint8)
        self.data, self.kv_lora_rank, self.rope_dim, self.xp = data, kv_lora_rank, rope_dim, xp
        self._records = data.reshape(-1, data.shape[-1])
        return self

    def _setup(self, data: Array, kv_lora_rank: int, rope_dim: int) -> None:
        self.data = data
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.xp = _backend.get_array_module(data=data)
        self._records = data.reshape(-1, data.shape[-1])     # one view, made once

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def block_size(self) -> int:
        return self.data.shape[1]

    @property
    def token_bytes(self) -> int:
        return self.data.shape[2]

    @property
    def num_slots(self) -> int:
        return self.data.shape[0] * self.data.shape[1]

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def __repr__(self):
        return (f"MLAKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"kv_lora_rank={self.kv_lora_rank}, rope_dim={self.rope_dim}, "
                f"xp={self.xp.__name__})")

    def records(self) -> Array:
        """uint8 [num_slots, token_bytes] view: one record per slot."""
        return self._records

    def decode_records(self, records: Array) -> Array:
        """float32 [N, L + R] rows of records [N, token_bytes] (the reference decoder)."""
        return _ref.mla_decode(records, self.kv_lora_rank, self.rope_dim)

    def insert(self, kv_c: Array, k_pe: Array, slot_mapping: Array) -> None:
        """Quantize and store latents kv_c [N, L] and RoPE keys k_pe [N, R]; slot -1 skipped."""
        xp = _backend.get_array_module(kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping,
                                       data=self.data)
        V.check_array("kv_c", kv_c, ndim=2, dtype=V.FLOAT_DTYPES,
                      shape=(None, self.kv_lora_rank), shape_desc="[N, kv_lora_rank]")
        V.check_array("k_pe", k_pe, ndim=2, dtype=V.FLOAT_DTYPES,
                      shape=(kv_c.shape[0], self.rope_dim), shape_desc="[N, rope_dim]")
        _check_slot_mapping(xp, slot_mapping, kv_c.shape[0], self.num_slots)
        self.insert_core(kv_c, k_pe, slot_mapping)

    def insert_core(self, kv_c: Array, k_pe: Array, slot_mapping: Array) -> None:
        """:meth:`insert` without validation (the layer path validated its batch)."""
        records = _ref.mla_encode(kv_c, k_pe)          # elementwise: no host sync
        xp = self.xp
        if _backend.use_kernels(xp) and self.token_bytes % 4 == 0 \
                and self.data.data.ptr % 4 == 0:  # type: ignore[union-attr]  # CuPy here
            return _kquant.scatter_records(xp, self.data, records, slot_mapping)
        _ref.mla_insert(self.data, records, slot_mapping)

    def gather(self, slots: Array) -> Array:
        """Dequantized rows float32 [N, L + R] of global ``slots`` [N] (no -1)."""
        xp = _backend.get_array_module(slots=slots, data=self.data)
        V.check_index("slots", slots, ndim=1, shape_desc="[N]")
        V.check_slots(xp, slots, self.num_slots, name="slots", allow_negative_one=False)
        return _ref.mla_read(self.data, slots, self.kv_lora_rank, self.rope_dim)

    def gather_core(self, slots: Array) -> Array:
        """:meth:`gather` of slots known to be in range (no masking pass, no sync)."""
        return self.decode_records(self.records()[slots])
