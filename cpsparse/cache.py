"""Paged caches: the indexer key cache and the fp8_ds_mla MLA cache.

Both are thin owners of one ``uint8`` array in the exact byte layout vLLM
uses, so a cache made by vLLM (handed over zero-copy through DLPack) can be
wrapped with :meth:`IndexerKCache.wrap` / :meth:`MLAKVCache.wrap` and read by
cpsparse, and the other way round.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, cast

import numpy

from cpsparse import _backend
from cpsparse import _validation as V
from cpsparse import paging
from cpsparse.raw_kernels import quant as _kquant
from cpsparse.reference import cache as _ref
from cpsparse.reference import fp4 as _fp4
from cpsparse.reference import fp8 as _fp8

if TYPE_CHECKING:
    from types import ModuleType

    from cpsparse._typing import Array, IntLike, ModuleLike, ScaleFormat

__all__ = ["IndexerKCache", "MLAKVCache", "Model1KVCache"]

LAYOUTS = ("fp8_ds_mla", "model1")


def _check_slot_mapping(xp, slot_mapping, n, num_slots):
    V.check_index("slot_mapping", slot_mapping, shape=(n,),
                  shape_desc="[N] (one slot per key)")
    V.check_slots(xp, slot_mapping, num_slots)


KEY_DTYPES = ("fp8", "mxfp4")


def _check_key_dtype(dtype, head_dim):
    V.check_choice("dtype", dtype, KEY_DTYPES)
    if dtype == "mxfp4" and head_dim % 32:
        raise ValueError(f"Invalid head_dim: an mxfp4 cache needs a multiple of 32 (one "
                         f"scale per 32 values), got {head_dim}")


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
    dtype : {"fp8", "mxfp4"}
        Key format. ``"mxfp4"`` (DeepGEMM's FP4 pages, 68 bytes a key at D = 128):
        per page ``block_size * D / 2`` bytes of packed e2m1 codes (the even
        element in the low nibble), then per key ``D / 32`` ue8m0 scale bytes
        padded to whole int32 words (see :mod:`cpsparse.reference.fp4`). The
        queries stay FP8. On CuPy, ``paged_mqa_logits`` runs a Hopper kernel over
        it (pages of >= 64 keys: the e2m1 codes are expanded to e4m3 in registers
        and fed to the fp8 wgmma path); insert, gather and prefill scoring run the
        reference (with a warning).

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
                 xp: ModuleLike = numpy, scale_fmt: ScaleFormat = "ue8m0",
                 dtype: str = "fp8") -> None:
        xp = _backend.backend_module(xp)
        V.check_nonnegative_int("num_blocks", num_blocks)
        V.check_positive_int("block_size", block_size)
        head_dim = V.check_positive_int("head_dim", head_dim)
        V.check_choice("scale_fmt", scale_fmt, ("ue8m0", None))
        _check_key_dtype(dtype, head_dim)
        data = xp.zeros((num_blocks, block_size * sum(_ref.indexer_layout(head_dim, dtype))),
                        dtype=xp.uint8)
        self._setup(data, block_size, head_dim, scale_fmt, dtype)

    @classmethod
    def wrap(cls, data: Array, block_size: IntLike = 64, head_dim: IntLike = 128,
             scale_fmt: ScaleFormat = "ue8m0", name: str = "data",
             dtype: str = "fp8") -> IndexerKCache:
        """Use an existing cache array without copying it.

        ``data`` is ``uint8 [num_blocks, block_size * (head_dim + 4)]``, or the
        ``[num_blocks, block_size, head_dim + 4]`` container view vLLM may hand
        over, or DeepGEMM's ``[num_blocks, block_size, 1, head_dim + 4]`` (same
        bytes; viewed as 2-D). ``dtype="mxfp4"``: DeepGEMM's FP4 pages,
        ``head_dim + 4`` becoming ``head_dim / 2 + 4`` (at head_dim 128).
        """
        self = cls.__new__(cls)
        _backend.get_array_module(**{name: data})
        V.check_positive_int("block_size", block_size)
        head_dim = V.check_positive_int("head_dim", head_dim)
        _check_key_dtype(dtype, head_dim)
        key = sum(_ref.indexer_layout(head_dim, dtype))
        what = "head_dim + 4" if dtype == "fp8" else "head_dim / 2 + 4"
        data = V.squeeze_axis(name, data, 2, 4)     # DeepGEMM's [num_blocks, bs, 1, D + 4]
        if getattr(data, "ndim", None) == 3:
            V.check_array(name, data, dtype="uint8", shape=(None, block_size, key),
                          shape_desc=f"[num_blocks, block_size, {what}]")
            data = data.reshape(data.shape[0], -1)
        V.check_array(name, data, ndim=2, dtype="uint8", shape=(None, block_size * key),
                      shape_desc=f"[num_blocks, block_size * ({what})]")
        self._setup(data, block_size, head_dim, scale_fmt, dtype)
        return self

    @classmethod
    def trusted_view(cls, data: Array, block_size: int, head_dim: int,
                     xp: ModuleType) -> IndexerKCache:
        """:meth:`wrap` of an array whose layout already passed :meth:`wrap`'s checks
        (an op's memo of its argument layouts): no checks, the 2-D view only."""
        self = cls.__new__(cls)
        self.block_size, self.head_dim, self.scale_fmt = block_size, head_dim, "ue8m0"
        self.dtype = "fp8"                       # raw arrays are fp8 pages
        self.data = data if data.ndim == 2 else data.reshape(data.shape[0], -1)
        self.xp = xp
        return self

    def _setup(self, data: Array, block_size: IntLike, head_dim: IntLike,
               scale_fmt: ScaleFormat, dtype: str = "fp8") -> None:
        self.block_size = V.check_positive_int("block_size", block_size)
        self.head_dim = V.check_positive_int("head_dim", head_dim)
        self.scale_fmt = V.check_choice("scale_fmt", scale_fmt, ("ue8m0", None))
        self.dtype = dtype
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
        return self.block_size * sum(_ref.indexer_layout(self.head_dim, self.dtype))

    def __repr__(self):
        kind = "" if self.dtype == "fp8" else f", dtype='{self.dtype}'"
        return (f"IndexerKCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"head_dim={self.head_dim}{kind}, xp={self.xp.__name__})")

    def codes_view(self) -> Array:
        """uint8 [num_blocks, block_size, head_dim] view of the codes (no copy; fp8)."""
        self._require_fp8("codes_view")
        bs, d = self.block_size, self.head_dim
        return self.data[:, :bs * d].reshape(self.num_blocks, bs, d)

    def scales_view(self) -> Array:
        """float32 [num_blocks, block_size] view of the per-token scales (no copy; fp8)."""
        self._require_fp8("scales_view")
        return self.data[:, self.block_size * self.head_dim:].view(self.xp.float32)

    def _require_fp8(self, what):
        if self.dtype != "fp8":
            raise ValueError(f"Invalid cache for {what}: expected an fp8 IndexerKCache, "
                             f"got dtype={self.dtype!r}")

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
        if self.dtype == "mxfp4":
            if _backend.use_kernels(xp):
                _backend.warn_fallback("IndexerKCache.insert", (self.head_dim, "mxfp4"),
                                       "an mxfp4 cache")
            packed, scale_bytes = _fp4.quantize(k)
            return _ref.indexer_insert(self.data, self.block_size, self.head_dim, packed,
                                       scale_bytes, slot_mapping, "mxfp4")
        if _backend.use_kernels(xp):
            if _kquant.supports_group(self.head_dim):
                return _kquant.indexer_insert(xp, self, k, slot_mapping, self.KEY_EPS)
            _backend.warn_fallback("IndexerKCache.insert", (self.head_dim,), "this head_dim")
        codes, scales = _fp8.quantize_groups(k, self.head_dim, self.scale_fmt, self.KEY_EPS)
        _ref.indexer_insert(self.data, self.block_size, self.head_dim, codes,
                            scales.reshape(-1), slot_mapping)

    def insert_quantized(self, codes: Array, scales: Array, slot_mapping: Array) -> None:
        """Store already quantized keys: codes uint8 [N, head_dim], scales float32 [N]
        (an fp8 cache)."""
        self._require_fp8("insert_quantized")
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
            ``n - cu[r]`` of that request. An mxfp4 cache gives packed e2m1
            codes uint8 [N, head_dim / 2] and ue8m0 scale bytes uint8
            [N, head_dim / 32] (what :func:`cpsparse.mqa_logits` takes as MXFP4 keys).
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
        if self.dtype == "mxfp4":
            if _backend.use_kernels(xp):
                _backend.warn_fallback("IndexerKCache.gather", (self.head_dim, "mxfp4"),
                                       "an mxfp4 cache")
            blocks, offsets = _ref.request_positions(cu_host, block_table, self.block_size)
            return _ref.indexer_read(self.data, self.block_size, self.head_dim, blocks,
                                     offsets, "mxfp4")
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
    layout : {"fp8_ds_mla", "model1"}
        ``"model1"`` makes a :class:`Model1KVCache` (DeepSeek-V4's layout).

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

    layout = "fp8_ds_mla"

    def __new__(cls, *args: Any, layout: str = "fp8_ds_mla", **kwargs: Any) -> MLAKVCache:
        V.check_choice("layout", layout, LAYOUTS)
        if cls is MLAKVCache and layout == "model1":
            cls = Model1KVCache
        return super().__new__(cls)

    def __init__(self, num_blocks: IntLike, block_size: IntLike = 64, kv_lora_rank: int = 512,
                 rope_dim: int = 64, xp: ModuleLike = numpy, layout: str = "fp8_ds_mla") -> None:
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
             name: str = "data", layout: str = "fp8_ds_mla",
             block_size: IntLike = 64) -> MLAKVCache:
        """Use an existing ``uint8 [num_blocks, block_size, token_bytes]`` array.

        FlashMLA's view ``[num_blocks, block_size, 1, token_bytes]`` is accepted too,
        and on NumPy a ``float8_e4m3fn`` array of those bytes (viewed as uint8).
        ``layout="model1"``: see :meth:`Model1KVCache.wrap` (``block_size`` is
        read there; the fp8_ds_mla layout takes it from the shape).
        """
        if V.check_choice("layout", layout, LAYOUTS) == "model1":
            return Model1KVCache.wrap(data, block_size=block_size, name=name)
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

    @property
    def value_dim(self) -> int:
        """The attention's default value width d_v: the latent (kv_lora_rank)."""
        return self.kv_lora_rank

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
        xp = self.xp
        if _backend.use_kernels(xp) and _kquant.supports_mla_insert(self):
            # one launch; the array-op encoding below cost ~1.6 ms of host a decode step
            return _kquant.mla_insert(xp, self, kv_c, k_pe, slot_mapping)
        records = _ref.mla_encode(kv_c, k_pe)          # elementwise: no host sync
        if _backend.use_kernels(xp) and self.token_bytes % 4 == 0 \
                and self.data.data.ptr % 4 == 0:  # type: ignore[union-attr]  # CuPy here
            return _kquant.scatter_records(xp, self.data, records, slot_mapping)
        _ref.mla_insert(self.data, records, slot_mapping)

    def gather(self, slots: Array) -> Array:
        """Dequantized rows float32 [N, L + R] of global ``slots`` [N] (no -1)."""
        xp = _backend.get_array_module(slots=slots, data=self.data)
        V.check_index("slots", slots, ndim=1, shape_desc="[N]")
        V.check_slots(xp, slots, self.num_slots, name="slots", allow_negative_one=False)
        return self._read(slots)

    def _read(self, slots: Array) -> Array:
        """Rows of slots, zero for one outside the cache (the reference reader)."""
        return _ref.mla_read(self.data, slots, self.kv_lora_rank, self.rope_dim)

    def gather_core(self, slots: Array) -> Array:
        """:meth:`gather` of slots known to be in range (no masking pass, no sync)."""
        return self.decode_records(self.records()[slots])


def _show_init_signature(cls):
    """The signature callers see is __init__'s: __new__ only picks the class of a layout."""
    init = inspect.signature(cls.__init__)
    cls.__signature__ = init.replace(parameters=list(init.parameters.values())[1:])


_show_init_signature(MLAKVCache)


class Model1KVCache(MLAKVCache):
    """Paged MLA cache in DeepSeek-V4's ``MODEL1`` layout (FlashMLA's MODEL1_FP8Sparse),
    byte for byte: ``MLAKVCache(..., layout="model1")`` makes one.

    ``data`` is ``uint8 [num_blocks, page_bytes]`` (a wrapped FlashMLA view:
    ``[num_blocks, block_size * 584]``, page stride ``page_bytes``). A page holds its
    ``block_size`` token rows first, each 448 e4m3 codes of the NoPE part then 64
    bfloat16 RoPE values (576 bytes), then per token 7 ue8m0 scale bytes (one per
    64 codes; ``scale = 2 ** (byte - 127)``, chosen as
    ``2 ** ceil(log2(max(amax / 448, 1e-4)))``) and one zero pad byte: 584 bytes
    a token, the page rounded up to a multiple of 576 bytes (37440 at
    ``block_size`` 64). The key is 512 wide (448 + 64) and is also the value:
    the attention's default ``d_v`` is 512.

    Parameters
    ----------
    num_blocks, block_size : int
    kv_lora_rank, rope_dim : int
        448 and 64 (the only MODEL1 shape; the defaults).
    xp : module or str
    layout : "model1"

    Examples
    --------
    >>> import numpy as np, cpsparse
    >>> cache = cpsparse.MLAKVCache(num_blocks=2, block_size=64, layout="model1")
    >>> type(cache).__name__, cache.data.shape, cache.head_dim
    ('Model1KVCache', (2, 37440), 512)
    >>> rng = np.random.default_rng(0)
    >>> k_nope = rng.standard_normal((2, 448)).astype(np.float32)
    >>> k_pe = rng.standard_normal((2, 64)).astype(np.float32)
    >>> cache.insert(k_nope, k_pe, np.array([0, 70], np.int32))
    >>> rows = cache.gather(np.array([70], np.int32))      # float32 [1, 512]
    >>> bool(np.abs(rows[0, :448] - k_nope[1]).max() < 0.07 * np.abs(k_nope[1]).max())
    True
    """

    layout = "model1"

    def __init__(self, num_blocks: IntLike, block_size: IntLike = 64,
                 kv_lora_rank: int | None = None, rope_dim: int | None = None,
                 xp: ModuleLike = numpy, layout: str = "model1") -> None:
        xp = _backend.backend_module(xp)
        V.check_nonnegative_int("num_blocks", num_blocks)
        _check_model1_dims(kv_lora_rank, rope_dim)
        block_size = V.check_positive_int("block_size", block_size)
        data = xp.zeros((num_blocks, _ref.model1_page_bytes(block_size)), dtype=xp.uint8)
        self._setup_model1(data, block_size)

    @classmethod
    def wrap(cls, data: Array, kv_lora_rank: int = 448, rope_dim: int = 64,
             name: str = "data", layout: str = "model1",
             block_size: IntLike = 64) -> Model1KVCache:
        """Use an existing MODEL1 cache without copying it: ``uint8 [num_blocks,
        page_bytes]``, or FlashMLA's ``[num_blocks, block_size, 1, 584]`` view of those
        pages (page stride ``page_bytes``), also as ``float8_e4m3fn`` on NumPy."""
        _backend.get_array_module(**{name: data})
        _check_model1_dims(kv_lora_rank, rope_dim)
        block_size = V.check_positive_int("block_size", block_size)
        page = _ref.model1_page_bytes(block_size)
        if getattr(data, "ndim", None) == 4:
            data = V.check_codes(name, data, ndim=4,
                                 shape=(None, block_size, 1, _ref.MODEL1_TOKEN_BYTES),
                                 shape_desc="[num_blocks, block_size, 1, 584]",
                                 contiguous=False)
            item, used = data.itemsize, block_size * _ref.MODEL1_TOKEN_BYTES
            strides = tuple(data.strides)
            if strides[1:] != (_ref.MODEL1_TOKEN_BYTES * item,) * 2 + (item,) or (
                    data.shape[0] > 1 and strides[0] != page * item):
                raise ValueError(f"Invalid layout of {name}: expected FlashMLA's MODEL1 "
                                 f"view, strides ({page * item}, 584, 584, 1) x itemsize, "
                                 f"got {strides}")
            # The pages' used bytes as [num_blocks, block_size * 584] rows, page stride
            # apart: exactly the bytes the view covers (the page padding is never read).
            xp = _backend.xp_of(data)
            data = xp.lib.stride_tricks.as_strided(data, shape=(data.shape[0], used),
                                                   strides=(strides[0], item))
            data = V.check_codes(name, data, ndim=2, contiguous=False)
        else:
            data = V.check_codes(name, data, ndim=2, shape=(None, page),
                                 shape_desc=f"[num_blocks, page_bytes] (page_bytes = {page} "
                                            f"for block_size={block_size})")
        self = cast("Model1KVCache", cls.__new__(cls))
        self._setup_model1(data, block_size)
        return self

    def _setup_model1(self, data: Array, block_size: int) -> None:
        self.data = data
        self.kv_lora_rank, self.rope_dim = _ref.MODEL1_NOPE, _ref.MODEL1_ROPE
        self._block_size = block_size
        self.xp = _backend.get_array_module(data=data)
        self._slot_ids = None

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def token_bytes(self) -> int:
        return _ref.MODEL1_TOKEN_BYTES

    @property
    def num_slots(self) -> int:
        return self.data.shape[0] * self._block_size

    @property
    def value_dim(self) -> int:
        """512: the MODEL1 key is also the value (NoPE and RoPE parts)."""
        return self.head_dim

    def __repr__(self):
        return (f"MLAKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"layout='model1', xp={self.xp.__name__})")

    def records(self) -> Array:
        """int32 [num_slots]: the slot ids (a token's bytes are not contiguous in
        MODEL1, so the attention's rows are slots that :meth:`decode_records`
        reads)."""
        if self._slot_ids is None:
            self._slot_ids = self.xp.arange(self.num_slots, dtype=self.xp.int32)
        return self._slot_ids

    def decode_records(self, records: Array) -> Array:
        """float32 [N, 512] rows of the slots ``records`` (from :meth:`records`)."""
        return _ref.model1_read(self.data, self._block_size, records)

    def insert_core(self, kv_c: Array, k_pe: Array, slot_mapping: Array) -> None:
        """:meth:`insert` (k_nope [N, 448] as ``kv_c``) without validation."""
        rows, scales = _ref.model1_encode(kv_c, k_pe)
        _ref.model1_insert(self.data, self._block_size, rows, scales, slot_mapping)

    def _read(self, slots: Array) -> Array:
        return _ref.model1_read(self.data, self._block_size, slots)


def _check_model1_dims(kv_lora_rank, rope_dim):
    if kv_lora_rank not in (None, _ref.MODEL1_NOPE) or rope_dim not in (None, _ref.MODEL1_ROPE):
        raise ValueError(f"Invalid kv_lora_rank / rope_dim of the model1 layout: expected "
                         f"{_ref.MODEL1_NOPE} / {_ref.MODEL1_ROPE}, got {kv_lora_rank} / "
                         f"{rope_dim}")


_show_init_signature(Model1KVCache)
