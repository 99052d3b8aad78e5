"""Input validation for every public op: one place, one message style.

Messages follow the pattern "Invalid <what> of <argument>: expected ..., got
...". Structural checks (type, dtype, ndim, shape, contiguity, backend) run on
every call. Checks that read array *values* (window bounds, slots, page ids)
run on host arrays always, and on device arrays unless the current stream is
capturing a CUDA graph (a device-to-host read is illegal there); they can be
switched off for device arrays with :func:`cpsparse.set_device_value_checks`.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, TypeVar

import numpy

from cpsparse import _backend, paging, raw_kernels
from cpsparse.reference._xp import to_host

if TYPE_CHECKING:
    from cpsparse._typing import FloatLike, IntLike

_DEVICE_VALUE_CHECKS = [True]
_T = TypeVar("_T")

# Index arguments (slots, page ids, lengths, windows, indices, request ids) come as the
# caller has them: int32, or int64 like vLLM's slot_mapping and NumPy's/torch's default
# integers. The NumPy reference reads both; the CUDA launchers take int32 and convert an
# int64 array with one saturating pass (cpsparse.raw_kernels.index_i32).
INDEX_DTYPES = ("int32", "int64")
# e4m3 codes: uint8 on both backends, or ml_dtypes.float8_e4m3fn arrays on NumPy
# (viewed as uint8, no copy).
CODE_DTYPES = ("uint8", "float8_e4m3fn")
FLOAT_DTYPES = ("float16", "float32", "float64", "bfloat16")


class CallMemo:
    """What one op's structural checks concluded, by the layouts of its arguments.

    Structural checks (types, dtypes, ranks, shape relations, contiguity, the
    backend) depend only on each array's type, shape, strides and dtype and on the
    scalar arguments, and a serving loop calls an op with the same layouts every
    step: the op keys its checks by :func:`layouts` and runs them on a miss only
    (on the H200's host they cost 10-20 us a call, more than the launch). Value
    checks read the arrays and run on every call. The memo holds no array; it is
    bounded (cleared when full: a workload has a handful of layouts).
    """

    __slots__ = ("name", "_seen", "_size")
    _ALL: list[CallMemo] = []

    def __init__(self, name: str, size: int = 512) -> None:
        self.name, self._size = name, size
        self._seen: dict[Any, Any] = {}
        CallMemo._ALL.append(self)

    @classmethod
    def clear_all(cls):
        """Empty every op's memo: an entry may hold a launch prepared for the kernels
        compiled then (the top-k, scoring and sparse attention ops'), which a new compilation
        of a module replaces."""
        for memo in cls._ALL:
            memo.clear()

    def get(self, key):
        """The value stored for ``key`` (None for a None key or a miss)."""
        return None if key is None else self._seen.get(key)

    def put(self, key, value):
        """Store ``value`` for ``key`` (a None key is not stored); returns ``value``."""
        if key is not None:
            if len(self._seen) >= self._size:
                self._seen.clear()
            self._seen[key] = value
        return value

    def __len__(self):
        return len(self._seen)

    def clear(self):
        self._seen.clear()


def memo_launch(xp, launch):
    """A call's memoized kernel launch, ``(device, run)`` as an op's call memo keeps it
    (:func:`cpsparse.raw_kernels.topk.call_launch` and the others), when it is the whole
    call now: the kernels on, no value checks to run (they read the arrays), the device
    it was prepared on. None otherwise: the call takes the checked path."""
    if launch is not None and _backend.use_kernels(xp) and not value_checks_enabled(xp) \
            and launch[0] == raw_kernels.current_device():
        return launch[1]
    return None


def layouts(*arrays):
    """Hashable key of the arguments' layouts: (type, shape, strides, dtype) of each
    array, None for None; None when an argument is not an array (the checks then
    say why). Scalars go into the key beside it, with their type (``True == 1``)."""
    try:
        return tuple([None if a is None else (type(a), a.shape, a.strides, a.dtype)
                      for a in arrays])
    except AttributeError:
        return None


def as_codes(a):
    """The uint8 view of e4m3 codes that passed :func:`check_codes` (NumPy's
    float8_e4m3fn arrays are viewed, uint8 ones returned as they are)."""
    return a.view(numpy.uint8) if _name_of(a.dtype) == "float8_e4m3fn" else a


def set_device_value_checks(enabled: bool) -> bool:
    """Enable or disable value checks (which synchronise) on CuPy inputs.

    Value checks on NumPy inputs always run. On CuPy inputs they cost a
    device-to-host copy per call; production loops may turn them off (see
    "Masking, value checks and production mode" in :doc:`the contract
    </contract>`).

    Parameters
    ----------
    enabled : bool
        True: check slots, page ids, windows and lengths of CuPy inputs too.

    Returns
    -------
    bool
        The previous setting.

    Examples
    --------
    >>> import cpsparse
    >>> previous = cpsparse.set_device_value_checks(False)
    >>> cpsparse.set_device_value_checks(previous)
    False
    """
    previous = _DEVICE_VALUE_CHECKS[0]
    _DEVICE_VALUE_CHECKS[0] = bool(enabled)
    return previous


def value_checks_enabled(xp):
    if xp is numpy:
        return True
    return _DEVICE_VALUE_CHECKS[0] and not _backend.is_stream_capturing(xp)


_DTYPE_NAMES: dict[Any, str] = {}


def _name_of(dtype):
    """numpy.dtype(dtype).name, memoized by dtype (the hot path of every op call)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = numpy.dtype(dtype).name
    return name


def check_array(name, a, *, ndim=None, dtype=None, shape=None, shape_desc=None,
                contiguous=True):
    """Check one array argument.

    Parameters
    ----------
    name : str
        The argument's name, used in the message.
    ndim : int, optional
    dtype : str or tuple of str, optional
        Accepted dtype name(s) (``"bfloat16"`` is ml_dtypes' NumPy dtype).
    shape : tuple, optional
        Expected shape; ``None`` entries match any size.
    shape_desc : str, optional
        Human-readable form of the expected shape, e.g. ``"[M, H, D]"``.
    contiguous : bool
        Require C-contiguity (kernels index raw pointers).
    """
    try:
        got_dtype, got_shape = a.dtype, a.shape
    except AttributeError:
        if a is None:
            raise TypeError(f"Invalid {name}: expected an array, got None") from None
        raise TypeError(f"Invalid type of {name}: expected numpy.ndarray or cupy.ndarray, "
                        f"got {type(a).__qualname__}") from None
    rank = len(got_shape)
    if ndim is not None and rank != ndim:
        desc = shape_desc or f"{ndim} dimensions"
        raise ValueError(f"Invalid shape of {name}: expected {desc} ({ndim}-D), "
                         f"got {tuple(got_shape)} ({rank}-D)")
    if dtype is not None:
        got = _name_of(got_dtype)
        if got != dtype if isinstance(dtype, str) else got not in dtype:
            accepted = (dtype,) if isinstance(dtype, str) else tuple(dtype)
            raise TypeError(f"Invalid dtype of {name}: expected {' or '.join(accepted)}, "
                            f"got {got}")
    if shape is not None:
        ok = len(shape) == rank
        if ok:
            for e, g in zip(shape, got_shape):
                if e is not None and e != g:
                    ok = False
                    break
        if not ok:
            want = shape_desc or str(tuple(shape))
            filled = "(" + ", ".join("*" if e is None else str(e) for e in shape) + ")"
            raise ValueError(f"Invalid shape of {name}: expected {want} = {filled}, "
                             f"got {tuple(got_shape)}")
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"Invalid layout of {name}: expected a C-contiguous array, "
                         f"got strides {tuple(a.strides)} for shape {tuple(got_shape)}")
    return a


def check_index(name, a, **kwargs):
    """An index argument: int32 or int64 (see INDEX_DTYPES); other checks as check_array."""
    return check_array(name, a, dtype=INDEX_DTYPES, **kwargs)


def check_codes(name, a, **kwargs):
    """e4m3 codes as uint8 or float8_e4m3fn; returns the uint8 view the ops compute on."""
    check_array(name, a, dtype=CODE_DTYPES, **kwargs)
    return as_codes(a)


def squeeze_axis(name, a, axis, ndim):
    """Drop a size-1 ``axis`` of an ``ndim``-D peer view (FlashMLA's ``[T, 1, topk]``
    indices, DeepGEMM's ``[num_blocks, block_size, 1, D + 4]`` cache): no copy."""
    if getattr(a, "ndim", None) == ndim and a.shape[axis] == 1:
        return a.reshape(a.shape[:axis] + a.shape[axis + 1:])
    return a


# What an op's ``out_dtype`` may be: float32 (the default), or a 16-bit output the
# kernels round to in their epilogue (bfloat16 is FlashMLA's; ml_dtypes' dtype).
OUT_DTYPES = ("float32", "bfloat16", "float16")
_OUT_DTYPES: dict[Any, Any] = {}


def out_dtype_key(out_dtype):
    """Hashable key of an ``out_dtype`` argument for a memo: its type and value (the
    repr of anything but None or a string, which need not hash)."""
    return type(out_dtype), (out_dtype if out_dtype is None or isinstance(out_dtype, str)
                             else repr(out_dtype))


def check_out_dtype(xp, out_dtype):
    """The numpy dtype of an op's ``out_dtype`` (None: float32), memoized by value:
    float32, bfloat16 (a name, ml_dtypes' type or dtype) or float16."""
    key = (xp,) + out_dtype_key(out_dtype)
    dtype = _OUT_DTYPES.get(key)
    if dtype is not None:
        return dtype
    expected = "float32, bfloat16 or float16"
    if out_dtype is None:
        dtype = numpy.dtype(numpy.float32)
    elif isinstance(out_dtype, str) and out_dtype == "bfloat16":
        try:
            import ml_dtypes                  # numpy knows "bfloat16" once it is imported
        except ImportError:
            raise TypeError("Invalid out_dtype: bfloat16 needs the ml_dtypes package "
                            "(its NumPy dtype), which is not installed") from None
        dtype = numpy.dtype(ml_dtypes.bfloat16)
    else:
        try:
            dtype = numpy.dtype(out_dtype)
        except (TypeError, ValueError):
            raise TypeError(f"Invalid out_dtype: expected {expected}, "
                            f"got {out_dtype!r}") from None
    if dtype.name not in OUT_DTYPES or not dtype.isnative:   # (">f2" is named float16)
        raise TypeError(f"Invalid out_dtype: expected {expected} in the machine's byte "
                        f"order, got {dtype.str if dtype.name in OUT_DTYPES else dtype.name}")
    if dtype.name == "bfloat16" and xp is not numpy:
        try:
            xp.empty(0, dtype=dtype)
        except Exception:                     # CuPy before 14 has no bfloat16 arrays
            raise TypeError(f"Invalid out_dtype: bfloat16 on CuPy needs CuPy >= 14, got "
                            f"CuPy {getattr(xp, '__version__', '?')}") from None
    if len(_OUT_DTYPES) > 64:
        _OUT_DTYPES.clear()
    _OUT_DTYPES[key] = dtype
    return dtype


def check_bool(name: str, value: object) -> bool:
    """A bool (numpy.bool_ too): a flag that silently took 0 / 1 / "no" would hide a
    caller's mistake."""
    if isinstance(value, (bool, numpy.bool_)):
        return bool(value)
    raise TypeError(f"Invalid {name}: expected a bool, got {value!r}")


def check_positive_int(name: str, value: IntLike) -> int:
    if type(value) is int and value > 0:          # the hot path: no abc instance check
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"Invalid {name}: expected a positive int, got {value!r}")
    if value <= 0:
        raise ValueError(f"Invalid {name}: expected a positive int, got {value}")
    return int(value)


def check_nonnegative_int(name: str, value: IntLike) -> int:
    if type(value) is int and value >= 0:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"Invalid {name}: expected a non-negative int, got {value!r}")
    if value < 0:
        raise ValueError(f"Invalid {name}: expected a non-negative int, got {value}")
    return int(value)


def check_float32_positive(name: str, value: FloatLike) -> float:
    """A real number > 0 that stays positive and finite in float32."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, numpy.floating)):
        raise TypeError(f"Invalid {name}: expected a float > 0, got {value!r}")
    with numpy.errstate(over="ignore", under="ignore"):
        as32 = numpy.float32(value)
    if not (numpy.isfinite(as32) and as32 > 0):
        raise ValueError(f"Invalid {name}: expected a float > 0 that is finite and non-zero "
                         f"in float32, got {value!r}")
    return float(value)


def check_choice(name: str, value: _T, choices: tuple[object, ...]) -> _T:
    if value not in choices:
        raise ValueError(f"Invalid {name}: expected one of {list(choices)}, got {value!r}")
    return value


def check_block_multiple(name, size, block_size):
    if size % block_size:
        raise ValueError(f"Invalid last dimension of {name}: expected a multiple of "
                         f"block_size={block_size}, got {size}")


# ---- value checks (read array contents) ------------------------------------

def check_windows(xp, ks, ke, num_keys, *, ks_name="ks", ke_name="ke"):
    """0 <= ks <= ke <= num_keys for every row."""
    if not value_checks_enabled(xp) or ks.size == 0:
        return
    ks_h = to_host(ks).astype(numpy.int64)
    ke_h = to_host(ke).astype(numpy.int64)
    bad = numpy.flatnonzero(ks_h > ke_h)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"Invalid window: expected {ks_name} <= {ke_name} for every row, "
                         f"got {ks_name}[{i}]={ks_h[i]} > {ke_name}[{i}]={ke_h[i]}")
    bad = numpy.flatnonzero(ks_h < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"Invalid {ks_name}: expected values >= 0, got "
                         f"{ks_name}[{i}]={ks_h[i]}")
    bad = numpy.flatnonzero(ke_h > num_keys)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"Invalid {ke_name}: expected values <= {num_keys} (the number of "
                         f"keys), got {ke_name}[{i}]={ke_h[i]}")


def check_context_lens(xp, context_lens, block_table, block_size, max_context_len,
                       num_blocks=None):
    """Context lengths are >= 0, fit max_context_len, the block table and the pages."""
    if not value_checks_enabled(xp) or context_lens.size == 0:
        return
    lens = to_host(context_lens).astype(numpy.int64)
    lens = lens.reshape(lens.shape[0], -1)
    bad = numpy.argwhere(lens < 0)
    if bad.size:
        i = int(bad[0][0])
        raise ValueError(f"Invalid context_lens: expected values >= 0, got "
                         f"{int(lens[i].min())} for request {i}")
    lens = lens.max(axis=1)
    longest = int(lens.max())
    if max_context_len is not None and longest > max_context_len:
        raise ValueError(f"Invalid max_context_len: expected >= the longest context "
                         f"length {longest}, got {max_context_len}")
    check_block_table(xp, lens, block_table, block_size, num_blocks)


def check_block_table(xp, lens, block_table, block_size, num_blocks=None, *,
                      name="block_table", what=""):
    """Each request's pages fit the table and are valid ids (lens: host int64 [R]).

    A used page id must be >= 0, below ``num_blocks`` when given, and small enough that
    its slots ``page * block_size + offset`` fit int32 (a larger one wraps onto another
    request's page). ``what`` names the cache the ids refer to, for the message.
    """
    if not value_checks_enabled(xp) or lens.size == 0:
        return
    need = paging.cdiv(lens, block_size)
    have = block_table.shape[1]
    bad: numpy.ndarray = numpy.flatnonzero(need > have)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"Invalid shape of {name}: request {i} has context length "
                         f"{int(lens[i])}, which needs {int(need[i])} blocks of "
                         f"{block_size}, but {name} has only {have} columns")
    table = to_host(block_table).astype(numpy.int64)
    used = numpy.arange(have)[None, :] < need[:, None]
    limit = (paging.INT32_MAX + 1) // block_size if num_blocks is None else min(
        num_blocks, (paging.INT32_MAX + 1) // block_size)
    bad = numpy.argwhere(used & ((table < 0) | (table >= limit)))
    if bad.size:
        r, j = (int(v) for v in bad[0])
        page = int(table[r, j])
        if num_blocks is not None and 0 <= page < num_blocks:
            expected = (f"expected its slots to fit int32 (page id < "
                        f"{(paging.INT32_MAX + 1) // block_size} with block_size={block_size})")
        elif num_blocks is None:
            expected = (f"expected 0 <= id < {limit} (slots page * {block_size} + offset "
                        f"must fit int32)")
        else:
            expected = f"expected 0 <= id < num_blocks={num_blocks}{what}"
        raise ValueError(f"Invalid {name}: request {r} uses page id {page} in column {j}, "
                         f"{expected}")


def check_cu_seq_lens(xp, cu_seq_lens, name="cu_seq_lens"):
    """Non-decreasing and starting at 0; returns host int64 copy."""
    cu = to_host(cu_seq_lens).astype(numpy.int64)
    if cu.size == 0:
        raise ValueError(f"Invalid shape of {name}: expected [R + 1] with R >= 0, got (0,)")
    if cu[0] != 0:
        raise ValueError(f"Invalid {name}: expected {name}[0] == 0, got {int(cu[0])}")
    bad = numpy.flatnonzero(numpy.diff(cu) < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"Invalid {name}: expected non-decreasing values, got "
                         f"{name}[{i}]={int(cu[i])} > {name}[{i + 1}]={int(cu[i + 1])}")
    return cu


def check_slots(xp, slots, num_slots, name="slot_mapping", allow_negative_one=True):
    """Slots in [0, num_slots), or -1 (skip / padding) when allowed."""
    if not value_checks_enabled(xp) or slots.size == 0:
        return
    s = to_host(slots)
    low = -1 if allow_negative_one else 0
    bad = numpy.flatnonzero((s < low) | (s >= num_slots))
    if bad.size:
        i = numpy.unravel_index(int(bad[0]), s.shape)
        idx = ", ".join(str(int(v)) for v in i)
        allowed = "-1 or " if allow_negative_one else ""
        raise ValueError(f"Invalid {name}: expected {allowed}0 <= slot < {num_slots}, "
                         f"got {name}[{idx}]={int(s[i])}")
