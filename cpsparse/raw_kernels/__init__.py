"""CUDA C++ sources of cpsparse's kernels and the one loader that compiles them.

Sources live beside this module as ``.cu`` (kernels) and ``.cuh`` (shared
device helpers) files. A *module* is a named list of those files; the loader
concatenates them into one source string (CuPy's disk cache keys on the
source string, not on included files, so nothing is ``#include``-d) and
compiles it once per (device, module, options) with ``cupy.RawModule``.

Each module declares the compute capabilities it runs on (:class:`Capabilities`,
see the registry at the bottom of this file):

=========  ==========================  =========================================
module     compute capability          why
=========  ==========================  =========================================
quant      8.0 and newer               plain CUDA
topk       9.0 and newer               thread-block clusters, distributed smem
indexer    9.0 only (sm_90a)           Hopper wgmma
attention  9.0 only (sm_90a)           Hopper wgmma
=========  ==========================  =========================================

* :func:`get_function` / :func:`get_module` raise :class:`KernelUnavailable`
  *before* compiling on a device outside the module's capabilities (NVRTC would
  fail there anyway, e.g. ``wgmma`` on sm_100).
* :func:`get_function` is thread-safe: concurrent first calls compile once.
* :func:`precompile` warms every module the current device runs.
* :func:`supported_modules` / :func:`supported_ops` say what runs on a given
  compute capability (no GPU needed).
* :func:`module_source` / :data:`MODULES` / :func:`compile_options` /
  :func:`arch_for` are what the CPU-side NVRTC compile test uses, so CI catches
  compile errors and spills without a GPU.

CuPy's cache directory (``CUPY_CACHE_DIR``) is honoured: compiled cubins are
reused across processes.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import struct
import threading
from typing import Any, Iterable, NamedTuple

import numpy

from cpsparse import _backend

__all__ = ["MODULES", "ModuleSpec", "Capabilities", "at_least", "exactly",
           "module_source", "compile_options", "arch_for", "get_module", "get_function",
           "precompile", "supported_modules", "supported_ops", "parse_capability",
           "require_device", "set_pdl",
           "MIN_COMPUTE_CAPABILITY", "KernelUnavailable"]

SOURCE_DIR = pathlib.Path(__file__).resolve().parent

BASE_OPTIONS = ("-std=c++17",)

ALTERNATIVES = ("pass NumPy arrays to run the float64 reference backend, or call "
                "cpsparse.set_kernels_enabled(False) to run the reference on CuPy arrays")


class KernelUnavailable(RuntimeError):
    """The GPU (or CuPy) cannot run cpsparse's kernels (or this kernel module)."""


def parse_capability(cc: str | int | tuple[int, int]) -> tuple[int, int]:
    """``(major, minor)`` from ``(9, 0)``, ``"9.0"``, ``"90"`` / ``"100"`` (CuPy's form) or ``90``.

    Examples
    --------
    >>> from cpsparse.raw_kernels import parse_capability
    >>> parse_capability("100"), parse_capability("9.0"), parse_capability((12, 0))
    ((10, 0), (9, 0), (12, 0))
    """
    if isinstance(cc, str):
        s = cc.strip()
        if "." in s:
            major, minor = s.split(".")
            return int(major), int(minor)
        if not s.isdigit() or len(s) < 2:
            raise ValueError(f"Invalid compute capability: {cc!r}")
        return int(s[:-1]), int(s[-1])     # CuPy: f"{major}{minor}", minor < 10
    if isinstance(cc, int) and not isinstance(cc, bool):
        return parse_capability(str(cc))
    major, minor = cc  # type: ignore[misc, assignment]  # a (major, minor) pair here
    return int(major), int(minor)


def _fmt(cc):
    return f"{cc[0]}.{cc[1]}"


class Capabilities:
    """The compute capabilities a kernel module runs on.

    The rule is one of two kinds (build them with :func:`at_least` / :func:`exactly`):

    * ``at_least(8, 0)``: compute capability 8.0 and every newer one (portable
      CUDA, compiled for ``sm_XY`` of the device);
    * ``exactly((9, 0))``: only the listed capabilities (arch-specific code such
      as Hopper ``wgmma``, compiled for ``sm_90a``, runs on no other chip).

    ``cc in caps`` accepts anything :func:`parse_capability` does.
    """

    __slots__ = ("minimum", "only")

    def __init__(self, minimum=None, only=()):
        if (minimum is None) == (not only):
            raise ValueError("Capabilities: give exactly one of minimum= or only=")
        self.minimum = None if minimum is None else parse_capability(minimum)
        self.only = frozenset(parse_capability(c) for c in only)

    def __contains__(self, cc):
        cc = parse_capability(cc)
        if self.minimum is not None:
            return cc >= self.minimum
        return cc in self.only

    @property
    def lowest(self):
        """The lowest compute capability in the set."""
        return self.minimum if self.minimum is not None else min(self.only)

    def __str__(self):
        if self.minimum is not None:
            return f"{_fmt(self.minimum)} and newer"
        return " or ".join(_fmt(c) for c in sorted(self.only)) + " only"

    def __repr__(self):
        if self.minimum is not None:
            return f"at_least{self.minimum}"
        return "exactly(" + ", ".join(repr(c) for c in sorted(self.only)) + ")"

    def __eq__(self, other):
        return (isinstance(other, Capabilities) and self.minimum == other.minimum
                and self.only == other.only)

    def __hash__(self):
        return hash((self.minimum, self.only))


def at_least(major, minor=0):
    """Compute capability ``major.minor`` and every newer one."""
    return Capabilities(minimum=(major, minor))


def exactly(*capabilities):
    """Only the listed compute capabilities, e.g. ``exactly((9, 0))``."""
    return Capabilities(only=capabilities)


class ModuleSpec(NamedTuple):
    """One registered kernel module (the values of :data:`MODULES`)."""
    files: tuple            # source files in order, .cuh first
    options: tuple          # extra NVRTC options
    capabilities: Capabilities
    ops: tuple = ()         # public cpsparse ops whose CuPy path runs this module
    needs: str = ""         # why the capability rule (for messages and docs)
    defines: tuple = ()     # (NAME, value) pairs emitted as #define before the sources
    pdl: bool = False       # every kernel starts with CPS_PDL_ENTRY or CPS_PDL_WAIT
                            # (common.cuh): launched with programmatic dependent launch


# module name -> ModuleSpec, in registration order
MODULES: dict[str, ModuleSpec] = {}


def register_module(name, files, options=(), *, capabilities, ops=(), needs="", defines=None,
                    pdl=False):
    """Declare a kernel module: its source files (``.cuh`` first), options, the
    compute capabilities it runs on (a :class:`Capabilities`, required) and the
    constants the Python launcher owns (``defines``: emitted as ``#define`` lines in
    front of the sources, so kernel and launcher cannot disagree).

    ``pdl``: every kernel of the module begins with ``CPS_PDL_ENTRY()`` or
    ``CPS_PDL_WAIT()`` (common.cuh; ``tests/test_kernel_signatures.py`` checks the
    sources, ``tests/test_kernel_compile.py`` the compiled code), so :class:`Kernel` may
    launch them with programmatic dependent launch (see :func:`set_pdl`)."""
    if not isinstance(capabilities, Capabilities):
        raise TypeError(f"capabilities of module {name} must be at_least(...) or "
                        f"exactly(...), got {capabilities!r}")
    for f in files:
        if not (SOURCE_DIR / f).is_file():
            raise FileNotFoundError(f"kernel source {f} of module {name} is missing")
    MODULES[name] = ModuleSpec(tuple(files), tuple(options), capabilities, tuple(ops), needs,
                               tuple((defines or {}).items()), bool(pdl))


def _spec(name):
    try:
        return MODULES[name]
    except KeyError:
        raise KeyError(f"unknown kernel module {name!r}; registered: "
                       f"{', '.join(MODULES)}") from None


def module_source(name):
    """The single source string of a module (its files concatenated in order)."""
    spec = _spec(name)
    parts = [f"// ---- constants owned by cpsparse.raw_kernels.{name} ----\n"] if spec.defines \
        else []
    parts += [f"#define {key} {int(value)}\n" for key, value in spec.defines]
    for f in spec.files:
        parts.append(f"// ---- {f} ----\n")
        parts.append((SOURCE_DIR / f).read_text())
        parts.append("\n")
    return "".join(parts)


def compile_options(name, arch="sm_90a"):
    """NVRTC options of a module for ``arch`` (what CuPy and the CPU test pass)."""
    return BASE_OPTIONS + _spec(name).options + (f"-arch={arch}",)


def arch_for(capability):
    """The ``-arch`` the loader compiles for on a device of ``capability``.

    ``sm_90a`` on 9.0 ('a' targets enable wgmma/setmaxnreg and only run on exactly
    that chip), ``sm_XY`` otherwise.
    """
    cc = parse_capability(capability)
    return f"sm_{cc[0]}{cc[1]}a" if cc == (9, 0) else f"sm_{cc[0]}{cc[1]}"


_arch_for = arch_for          # former private name


def supported_modules(capability: str | int | tuple[int, int]) -> list[str]:
    """Names of the kernel modules that run on ``capability`` (registration order).

    Examples
    --------
    >>> from cpsparse.raw_kernels import supported_modules
    >>> supported_modules((9, 0))
    ['quant', 'indexer', 'topk', 'attention']
    >>> supported_modules("10.0")
    ['quant', 'topk']
    """
    cc = parse_capability(capability)
    return [name for name, spec in MODULES.items() if cc in spec.capabilities]


def supported_ops(capability: str | int | tuple[int, int]) -> list[str]:
    """The public ops whose CuPy inputs run GPU kernels on ``capability``.

    On other capabilities those ops raise :class:`KernelUnavailable` for CuPy
    inputs (unless ``cpsparse.set_kernels_enabled(False)``).

    Examples
    --------
    >>> from cpsparse.raw_kernels import supported_ops
    >>> supported_ops((8, 0))
    ['quantize_fp8', 'IndexerKCache.insert', 'IndexerKCache.gather', 'MLAKVCache.insert']
    """
    return [op for name in supported_modules(capability) for op in MODULES[name].ops]


_LOCK = threading.Lock()
_COMPILED: dict[Any, Any] = {}


def _current_device(cp):
    """(device id, (major, minor)) of CuPy's current device."""
    try:
        dev = cp.cuda.Device()
        return dev.id, parse_capability(dev.compute_capability)
    except Exception as exc:  # noqa: BLE001 - no driver, no device
        raise KernelUnavailable(f"no usable CUDA device: {exc}") from exc


def _device_label(cp, device):
    """' (NVIDIA B200)' when CuPy can tell the device's name, else ''."""
    try:
        name = cp.cuda.runtime.getDeviceProperties(device)["name"]
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        name = str(name).strip("\x00 ")
        return f" ({name})" if name else ""
    except Exception:  # noqa: BLE001 - the name is only for the message
        return ""


def _refusal(cp, device, cc, name):
    spec = _spec(name)
    ops = f" (ops: {', '.join(spec.ops)})" if spec.ops else ""
    needs = f" [{spec.needs}]" if spec.needs else ""
    runs = ", ".join(supported_modules(cc)) or "none"
    return KernelUnavailable(
        f"cpsparse kernel module {name!r}{ops} does not run on this GPU: device {device}"
        f"{_device_label(cp, device)} has compute capability {_fmt(cc)}, and {name!r} "
        f"supports compute capability {spec.capabilities}{needs}. Kernel modules that "
        f"run on {_fmt(cc)}: {runs}. Alternatives: {ALTERNATIVES}.")


def require_device(cp, module=None):
    """``(device id, (major, minor))`` of the current device, or KernelUnavailable.

    With ``module``, the device must be within that module's capabilities;
    without, it must run at least one module (compute capability >=
    :data:`MIN_COMPUTE_CAPABILITY`). Nothing is compiled.
    """
    device, cc = _current_device(cp)
    if module is not None:
        if cc not in _spec(module).capabilities:
            raise _refusal(cp, device, cc, module)
    elif cc < MIN_COMPUTE_CAPABILITY:
        raise KernelUnavailable(
            f"cpsparse kernels need compute capability >= {_fmt(MIN_COMPUTE_CAPABILITY)}, "
            f"got {_fmt(cc)} on device {device}{_device_label(cp, device)}; {ALTERNATIVES}")
    return device, cc


def _cupy():
    cp = _backend.cupy_module()
    if cp is None:
        raise KernelUnavailable("CuPy is not installed; pass NumPy arrays to run the "
                                "float64 reference backend")
    return cp


def get_module(name):
    """The compiled ``cupy.RawModule`` of ``name`` on the current device.

    Raises KernelUnavailable, without compiling, when the device's compute
    capability is outside the module's (see :func:`supported_modules`).
    """
    cp = _cupy()
    try:                                  # the hot path: one cheap runtime call, one dict hit
        mod = _COMPILED.get((cp.cuda.runtime.getDevice(), name))
    except Exception:  # noqa: BLE001 - no device: _current_device says so below
        mod = None
    if mod is not None:
        return mod
    device, cc = _current_device(cp)
    key = (device, name)
    if cc not in _spec(name).capabilities:
        raise _refusal(cp, device, cc, name)
    with _LOCK:
        mod = _COMPILED.get(key)
        if mod is None:
            mod = cp.RawModule(code=module_source(name),
                               options=compile_options(name, arch_for(cc)))
            mod.compile()
            _COMPILED[key] = mod
    return mod


def get_function(module, kernel):
    """A ``cupy.RawKernel`` by module and ``extern "C"`` name, compiled on first use."""
    return get_module(module).get_function(kernel)


def precompile(modules: Iterable[str] | None = None) -> list[str]:
    """Compile the kernel modules the current device runs (or the named ones).

    Returns the names compiled. Call it at start-up to keep NVRTC out of the
    first forward pass (and out of CUDA graph capture).

    With ``modules=None`` every module whose capabilities include the device's
    is compiled and the others are skipped (on a device below compute
    capability 8.0 that is none: the result is ``[]``). Named modules are all
    checked before any is compiled: one the device cannot run raises.

    Parameters
    ----------
    modules : iterable of str, optional
        Kernel module names (``"quant"``, ``"indexer"``, ``"topk"``,
        ``"attention"``); None: every module the device runs.

    Returns
    -------
    list of str
        The names compiled.

    Raises
    ------
    KernelUnavailable
        Without CuPy or a CUDA device, or when ``modules`` names a module
        outside the device's compute capability.

    Examples
    --------
    On an H100/H200 (compute capability 9.0):

    >>> import cpsparse
    >>> cpsparse.precompile()          # doctest: +SKIP
    ['quant', 'indexer', 'topk', 'attention']

    On a B200 (10.0) the Hopper-only modules are skipped:

    >>> cpsparse.precompile()          # doctest: +SKIP
    ['quant', 'topk']
    >>> cpsparse.precompile(["indexer"])   # doctest: +SKIP
    Traceback (most recent call last):
    ...
    cpsparse.raw_kernels.KernelUnavailable: cpsparse kernel module 'indexer' ...
    """
    cp = _cupy()
    device, cc = _current_device(cp)
    if modules is None:
        names = supported_modules(cc)
    else:
        names = list(modules)
        for name in names:
            if cc not in _spec(name).capabilities:
                raise _refusal(cp, device, cc, name)
    for name in names:
        get_module(name)
    return names


# ---- launch helpers: one memo per device for kernels and device facts ------------

WARPS_PER_BLOCK = 8
i32, i64, f32 = numpy.int32, numpy.int64, numpy.float32
_INT32 = numpy.dtype(numpy.int32)


def blocks_for(n, per_block):
    """Blocks of ``per_block`` items covering ``n`` (at least one)."""
    return max(1, -(-int(n) // per_block))


class DeviceFacts(NamedTuple):
    """What the launchers need to know of a device (read once per device)."""
    id: int
    capability: tuple
    sms: int
    smem_per_sm: int          # bytes of shared memory per multiprocessor
    smem_per_block: int       # opt-in maximum of dynamic shared memory per block
    l2_bytes: int = 50 << 20  # bytes of L2 (the H100's and H200's 50 MB by default)


_DEVICES: dict[int, DeviceFacts] = {}  # device id -> DeviceFacts
# (device id, module, kernel) -> [RawKernel, smem limit set]
_KERNELS: dict[tuple[int, str, str], list[Any]] = {}


def current_device():
    """CuPy's current device id: the key of every per-device memo."""
    return _cupy().cuda.runtime.getDevice()


def device_facts():
    """:class:`DeviceFacts` of CuPy's current device (memoized)."""
    cp = _cupy()
    dev = cp.cuda.runtime.getDevice()
    facts = _DEVICES.get(dev)
    if facts is None:
        props = cp.cuda.runtime.getDeviceProperties(dev)
        facts = _DEVICES[dev] = DeviceFacts(
            dev, (int(props["major"]), int(props["minor"])), int(props["multiProcessorCount"]),
            int(props["sharedMemPerMultiprocessor"]), int(props["sharedMemPerBlockOptin"]),
            int(props["l2CacheSize"]))
    return facts


def empty(cp, shape, dtype):
    """An uninitialised CuPy array from the memory pool: ``cupy.ndarray(shape, dtype)``,
    the constructor ``cupy.empty`` calls after its Python-level argument handling
    (2 of its 4.5 us a call on the H200's host)."""
    return cp.ndarray(shape, dtype)


def grid_stride_blocks(n, threads):
    """Blocks of a grid-stride loop over ``n`` items: enough to fill the device."""
    return min(blocks_for(n, threads), device_facts().sms * 16)


class Kernel:
    """A compiled kernel and its launch: ``fn(grid, block, args, shared_mem=0)``.

    CuPy's ``RawKernel.__call__`` spends 5 us on a launch with one argument and
    about 10 us with sixteen (measured on the H200: ``benchmarks/profile_host.py``),
    most of it converting each argument; a decode step launches four kernels at
    batch 1, where that is more than the GPU work. A :class:`Kernel` knows its C
    parameter list (``signature``), so a launch is one ``struct.pack_into`` of the
    arguments into a buffer it owns and one ``cuLaunchKernel`` on CuPy's current
    stream (graph capture included).

    ``signature`` has one letter a parameter: ``P`` a pointer (a CuPy array, or
    None for NULL), ``i`` int32, ``q`` int64, ``f`` float32, ``T`` a 128-byte
    ``CUtensorMap`` passed by value (``bytes`` from a :class:`TensorMapEncoder`; the
    kernel declares it ``const __grid_constant__ CpsTensorMap``) (spaces ignored). The
    first lookup checks it against the compiled function's parameter sizes
    (``cuFuncGetParamInfo``, where the driver has it).

    ``pdl``: the kernel waits for the grid before it (``CPS_PDL_ENTRY`` or
    ``CPS_PDL_WAIT``), so it is
    launched by ``cuLaunchKernelEx`` with programmatic stream serialization while
    :func:`set_pdl` allows it and the device and driver have it (compute capability 9.0
    and newer); otherwise by ``cuLaunchKernel``.
    """

    # A parameter's slot in the launch buffer (8 bytes, a tensor map's 128) and the
    # size the compiled function declares for it.
    _SLOT = {"P": "Q", "q": "q", "i": "i4x", "f": "f4x", "T": "128s"}
    _PARAM_SIZE = {"P": 8, "q": 8, "i": 4, "f": 4, "T": 128}

    def __init__(self, raw, name, signature, pdl=False):
        self.raw, self.name, self.pdl = raw, name, bool(pdl)
        self.signature = signature.replace(" ", "")
        bad = set(self.signature) - set(self._SLOT)
        if bad:
            raise ValueError(f"Invalid signature of {name}: expected letters of "
                             f"{sorted(self._SLOT)}, got {signature!r}")
        n = len(self.signature)
        offsets = [0]
        for c in self.signature:
            offsets.append(offsets[-1] + struct.calcsize(self._SLOT[c]))
        self._lock = threading.Lock()           # one buffer per kernel: one launch at a time
        self._buffer = ctypes.create_string_buffer(max(offsets[-1], 8))
        base = ctypes.addressof(self._buffer)
        # (cuLaunchKernel copies each parameter from its pointer, at the offset and
        # alignment the function declares: the buffer's own slots need no alignment.)
        self._pointers = (ctypes.c_void_p * max(n, 1))(*[base + o for o in offsets[:-1]])
        self._params = ctypes.addressof(self._pointers) if n else 0
        self._pack = self._packer(name, self.signature)
        self._fptr = None

    @classmethod
    def _packer(cls, name, signature):
        """``pack(buffer, args)``: the arguments' values into their slots, written out
        per signature (one generated function: no per-argument loop or dispatch)."""
        names = [f"a{j}" for j in range(len(signature))]
        values = [f"(0 if {a} is None else {a}.data.ptr)" if c == "P" else a
                  for a, c in zip(names, signature)]
        fmt = "<" + "".join(cls._SLOT[c] for c in signature)
        unpack = f"    {', '.join(names)}, = args\n" if names else ""
        code = (f"def pack(buffer, args):\n{unpack}"
                f"    pack_into({fmt!r}, buffer, 0{''.join(', ' + v for v in values)})\n")
        scope = {"pack_into": struct.pack_into}
        exec(compile(code, f"<cpsparse launch of {name}>", "exec"), scope)  # noqa: S102
        return scope["pack"]

    def bind(self, cp):
        """Resolve the CUfunction on the current device and check the signature."""
        fn = self.raw.kernel                  # compiles / loads on first use
        sizes = _param_sizes(fn.ptr)
        want = [self._PARAM_SIZE[c] for c in self.signature]
        if sizes is not None and sizes != want:
            raise RuntimeError(f"cpsparse kernel {self.name}: the launcher's signature "
                               f"{self.signature!r} gives parameter sizes {want}, the "
                               f"compiled kernel has {sizes}")
        self._fptr = fn.ptr
        self._stream = cp.cuda.get_current_stream
        self._launch_kernel = _driver_launch()
        self._launch_ex = None
        if self.pdl and device_facts().capability >= (9, 0):
            self._launch_ex = _pdl_launch()       # None where the driver lacks it
        self._config = _pdl_config()           # __call__'s, refilled at each PDL launch
        return self

    def __call__(self, grid, block, args, shared_mem=0):
        g = tuple(grid) + (1, 1)
        b = tuple(block) + (1, 1)
        with self._lock:
            self._pack(self._buffer, args)
            if self._launch_ex is not None and _PDL[0]:
                c = self._config
                c.gridDimX, c.gridDimY, c.gridDimZ = g[0], g[1], g[2]
                c.blockDimX, c.blockDimY, c.blockDimZ = b[0], b[1], b[2]
                c.sharedMemBytes, c.hStream = int(shared_mem), self._stream().ptr
                _check_launch(self._launch_ex(ctypes.byref(c), self._fptr, self._params, None))
            else:
                self._launch_kernel(self._fptr, g[0], g[1], g[2], b[0], b[1], b[2],
                                    shared_mem, self._stream().ptr, self._params, 0)

    def launcher(self, grid, block, shared_mem=0):
        """``launch(args)``: :meth:`__call__` with ``grid``, ``block`` and ``shared_mem``
        fixed once. Everything a launch reads is a local of the closure (no attribute
        lookups, no tuples built): for a launcher that memoizes a call shape's plan."""
        g = tuple(grid) + (1, 1)
        b = tuple(block) + (1, 1)
        gx, gy, gz, bx, by, bz, smem = g[0], g[1], g[2], b[0], b[1], b[2], int(shared_mem)
        lock, pack, buffer, params = self._lock, self._pack, self._buffer, self._params
        fptr, stream, launch_kernel = self._fptr, self._stream, self._launch_kernel
        launch_ex, pdl, check = self._launch_ex, _PDL, _check_launch
        if launch_ex is not None:      # the launcher's own config: its grid is fixed
            config = _pdl_config(gx, gy, gz, bx, by, bz, smem)
            config_ref = ctypes.byref(config)

        def launch(args):
            with lock:
                pack(buffer, args)
                if launch_ex is not None and pdl[0]:
                    config.hStream = stream().ptr
                    check(launch_ex(config_ref, fptr, params, None))
                else:
                    launch_kernel(fptr, gx, gy, gz, bx, by, bz, smem, stream().ptr, params, 0)
        # fptr is a bare address: the closure holds its Kernel (and so CuPy's function and
        # module) so that the code stays loaded while anything can still launch it.
        setattr(launch, "kernel", self)
        return launch


def _driver_launch():
    """CuPy's binding of ``cuLaunchKernel`` (Cython, no argument conversion)."""
    from cupy_backends.cuda.api import driver
    return driver.launchKernel


_LIBCUDA: list[Any] = []


class _LaunchConfig(ctypes.Structure):
    """cuda.h's CUlaunchConfig."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]


class _LaunchAttributeValue(ctypes.Union):
    """cuda.h's CUlaunchAttributeValue: 64 bytes, 8-byte aligned; the one member used here
    is an int (programmaticStreamSerializationAllowed)."""
    _fields_ = [("flag", ctypes.c_int), ("align", ctypes.c_uint64), ("pad", ctypes.c_char * 64)]


class _LaunchAttribute(ctypes.Structure):
    """cuda.h's CUlaunchAttribute: a 4-byte id, 4 bytes of padding, the 64-byte union."""
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4),
                ("value", _LaunchAttributeValue)]


# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h's CUlaunchAttributeID); its
# value, programmaticStreamSerializationAllowed, is the union's first int.
_PROGRAMMATIC_STREAM_SERIALIZATION = 6
# set_pdl's switch, read at every launch.
_PDL = [os.environ.get("CPSPARSE_PDL", "1") != "0"]


def set_pdl(enabled: bool) -> bool:
    """Allow or forbid programmatic dependent launch (PDL); returns the previous setting.

    With PDL, the kernels of a module registered with ``pdl=True`` (indexer, top-k,
    attention) are launched with CUDA's programmatic stream serialization: a kernel's
    CTAs are scheduled while the kernel before it on the stream is still running, and
    wait in the kernel (``griddepcontrol.wait``) for it to complete before they touch
    global memory. That hides a launch's latency behind the previous kernel's tail,
    which is much of a small decode step's time; results are the same bits either way.
    On by default on compute capability 9.0 and newer; the environment variable
    ``CPSPARSE_PDL=0`` turns it off at import. A launch captured in a CUDA graph keeps
    the setting it was captured with. See docs/production.md, "Programmatic dependent
    launch".

    Parameters
    ----------
    enabled : bool
        True: launch the kernels that wait for their predecessor with PDL.

    Returns
    -------
    bool
        The previous setting.

    Examples
    --------
    >>> import cpsparse
    >>> previous = cpsparse.set_pdl(False)
    >>> cpsparse.set_pdl(previous)
    False
    """
    previous = _PDL[0]
    _PDL[0] = bool(enabled)
    return previous


def _pdl_config(gx=1, gy=1, gz=1, bx=1, by=1, bz=1, smem=0):
    """A CUlaunchConfig carrying the programmatic-serialization attribute (the attribute
    array lives as long as the config: it holds a reference)."""
    attr = (_LaunchAttribute * 1)()
    attr[0].id = _PROGRAMMATIC_STREAM_SERIALIZATION
    attr[0].value.flag = 1
    config = _LaunchConfig(gx, gy, gz, bx, by, bz, smem, None, ctypes.addressof(attr), 1)
    setattr(config, "_attrs", attr)
    return config


def _pdl_launch():
    """The driver's ``cuLaunchKernelEx`` through ctypes, or None where it is missing."""
    return _driver_fn("cuLaunchKernelEx")


def _driver_error(status):
    """CuPy's exception for a failed driver call (what its own launches raise)."""
    from cupy_backends.cuda.api import driver
    return driver.CUDADriverError(status)


def _check_launch(rc):
    if rc != 0:
        raise _driver_error(rc)


# The driver entry points CuPy does not bind, with their C parameter lists (each one
# optional: an older driver lacks the newer ones, and only what uses them goes without).
_DRIVER_ARGTYPES = {
    "cuFuncGetParamInfo": [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                           ctypes.POINTER(ctypes.c_size_t)],                    # CUDA 12.4
    "cuOccupancyMaxActiveClusters": [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                     ctypes.POINTER(_LaunchConfig)],            # CUDA 12.0
    "cuLaunchKernelEx": [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.c_void_p],                                      # CUDA 12.0
    "cuTensorMapEncodeTiled": [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p,
                               ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                               ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int],  # 12.0
}

# cuda.h's CUtensorMapDataType values and CUtensorMapSwizzle modes the kernels use.
TMAP_UINT8, TMAP_FLOAT32 = 0, 7
TMAP_SWIZZLE_NONE, TMAP_SWIZZLE_128B = 0, 3
_TMAP_ELEMENT_BYTES = {TMAP_UINT8: 1, TMAP_FLOAT32: 4}
_TMAP_L2_PROMOTION_256B = 3          # (CUtensorMapL2promotion; interleave none, OOB fill zeros)


class TensorMapEncoder:
    """``encode(ptr) -> bytes``: the 128-byte ``CUtensorMap`` (``cuTensorMapEncodeTiled``)
    of a C-contiguous tensor of one shape at device address ``ptr``, a kernel parameter of
    signature letter ``T`` (:class:`Kernel`).

    ``dims`` and ``box`` are innermost first (a row-major [rows, cols] array is
    ``(cols, rows)``); ``strides``, the byte strides of dims 1 onwards, default to the
    contiguous ones. A box reaching past ``dims``
    is zero-filled, and its bytes still count towards the copy's ``complete_tx``. No
    interleave, L2 promotion of 256 bytes.

    The shape is checked and the driver's arguments built once, here; a call encodes one
    address, and the last ``memo`` addresses' maps are kept (a launch that rotates over a
    few key buffers pays the encode once each: an encode through ctypes costs
    microseconds of host time, more than the rest of a launch).

    Raises ValueError where the map would break TMA's rules (``ptr`` not 16-byte aligned,
    a box dimension outside 1..256, a box row not a multiple of 16 bytes, an outer stride
    not a multiple of 16 bytes), RuntimeError where the driver is missing or refuses it.
    """

    def __init__(self, dtype, dims, box, swizzle=TMAP_SWIZZLE_NONE, memo=8, strides=None):
        esize = _TMAP_ELEMENT_BYTES[dtype]
        dims, box = [int(d) for d in dims], [int(b) for b in box]
        if strides is None:
            strides = []
            for d in dims[:-1]:
                strides.append((strides[-1] if strides else esize) * d)
        strides = [int(s) for s in strides]
        if any(s % 16 for s in strides) or (box[0] * esize) % 16 \
                or not all(1 <= b <= 256 for b in box) or not all(d >= 1 for d in dims):
            raise ValueError(f"Invalid tensor map: dims {dims}, box {box} (1..256, rows of "
                             f"16-byte multiples), byte strides {strides} (16-byte multiples)")
        rank = len(dims)
        self.dims, self.box = dims, box
        self._args = (dtype, rank, (ctypes.c_uint64 * rank)(*dims),
                      (ctypes.c_uint64 * max(rank - 1, 1))(*strides),
                      (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
                      0, swizzle, _TMAP_L2_PROMOTION_256B, 0)
        self._buffer = ctypes.create_string_buffer(128 + 64)   # the map is written 64-aligned
        self._at = -ctypes.addressof(self._buffer) % 64 + ctypes.addressof(self._buffer)
        self._memo: dict[int, bytes] = {}
        self._memo_size = int(memo)
        self._lock = threading.Lock()

    def __call__(self, ptr):
        known = self._memo.get(ptr)
        if known is not None:
            return known
        if ptr % 16:
            raise ValueError(f"Invalid tensor map: address {ptr:#x} is not 16-byte aligned")
        encode = _driver_fn("cuTensorMapEncodeTiled")
        if encode is None:
            raise RuntimeError("cuTensorMapEncodeTiled: no CUDA driver of 12.0 or newer")
        dtype, rank, *rest = self._args
        with self._lock:                    # (one output buffer; the memo's eviction)
            rc = encode(self._at, dtype, rank, ptr, *rest)
            if rc != 0:
                raise RuntimeError(f"cuTensorMapEncodeTiled refused dims {self.dims}, box "
                                   f"{self.box}: CUresult {rc}")
            got = ctypes.string_at(self._at, 128)
            if self._memo_size:
                if len(self._memo) >= self._memo_size:
                    self._memo.pop(next(iter(self._memo)))      # the oldest
                self._memo[ptr] = got
        return got


def tensor_map(ptr, dtype, dims, box, swizzle=TMAP_SWIZZLE_NONE, strides=None):
    """One ``CUtensorMap`` (:class:`TensorMapEncoder` of this shape, called once)."""
    return TensorMapEncoder(dtype, dims, box, swizzle, memo=0, strides=strides)(ptr)


def _libcuda():
    """The driver library through ctypes (None where it does not load); its entry points
    of _DRIVER_ARGTYPES are typed where the driver has them (see :func:`_driver_fn`)."""
    if not _LIBCUDA:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            lib = None
        for name, argtypes in _DRIVER_ARGTYPES.items():
            fn = getattr(lib, name, None) if lib is not None else None
            if fn is not None:
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
        _LIBCUDA.append(lib)
    return _LIBCUDA[0]


def _driver_fn(name):
    """The driver's entry point ``name`` (one of _DRIVER_ARGTYPES), or None where the
    driver does not load or does not have it."""
    lib = _libcuda()
    return None if lib is None else getattr(lib, name, None)


def _param_sizes(fptr):
    """Byte sizes of a CUfunction's parameters (``cuFuncGetParamInfo``, CUDA 12.4+), or
    None where the driver does not say."""
    param_info = _driver_fn("cuFuncGetParamInfo")
    if param_info is None:
        return None
    sizes: list[int] = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    while len(sizes) < 256:
        rc = param_info(ctypes.c_void_p(fptr), len(sizes), ctypes.byref(offset),
                                    ctypes.byref(size))
        if rc != 0:        # CUDA_ERROR_INVALID_VALUE (1): past the last parameter
            return sizes if rc == 1 else None
        sizes.append(size.value)
    return None


def max_active_clusters(fn, cluster, threads, smem):
    """How many clusters of ``cluster`` CTAs of :class:`Kernel` ``fn`` (its cluster size
    compiled in, ``threads`` a CTA, ``smem`` bytes of dynamic shared memory) the current
    device runs at once (``cuOccupancyMaxActiveClusters``); 0 when it runs none or the
    driver does not say."""
    occupancy = _driver_fn("cuOccupancyMaxActiveClusters")
    if occupancy is None:
        return 0
    config = _LaunchConfig(cluster, 1, 1, threads, 1, 1, smem, None, None, 0)
    count = ctypes.c_int(0)
    rc = occupancy(ctypes.byref(count), ctypes.c_void_p(fn.raw.kernel.ptr), ctypes.byref(config))
    return count.value if rc == 0 else 0


# CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED (cuda.h's CUfunction_attribute).
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
PORTABLE_CLUSTER = 8     # the most CTAs a cluster may hold without that attribute


def kernel(module, name, signature, smem=0, carveout=None, cluster=1):
    """The :class:`Kernel` ``name`` of ``module`` on the current device (memoized), with
    its dynamic shared-memory limit raised to at least ``smem`` bytes.

    ``signature`` is its C parameter list (see :class:`Kernel`). ``cluster``: the CTAs
    a cluster of the kernel (its ``__cluster_dims__``); above ``PORTABLE_CLUSTER`` the
    function is allowed a non-portable cluster size (Hopper takes 16).
    """
    key = (current_device(), module, name)
    entry = _KERNELS.get(key)
    if entry is None:
        raw = get_function(module, name)           # refuses an unknown module
        spec = MODULES.get(module)
        fn = Kernel(raw, name, signature, pdl=spec is not None and spec.pdl).bind(_cupy())
        if carveout is not None:     # function attributes: set on the CuPy function
            fn.raw.preferred_shared_memory_carveout = carveout
        if cluster > PORTABLE_CLUSTER:
            from cupy_backends.cuda.api import driver
            driver.funcSetAttribute(fn.raw.kernel.ptr, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        entry = _KERNELS[key] = [fn, 0]
    if smem > entry[1]:
        entry[0].raw.max_dynamic_shared_size_bytes = int(smem)
        entry[1] = int(smem)
    return entry[0]


def index_i32(cp, a):
    """``a`` as the int32 the kernels take: itself if int32, else a saturating copy.

    int64 index arrays (vLLM's ``slot_mapping``, NumPy's and torch's default
    integers) cost one elementwise pass; a value outside int32 saturates to
    -2**31 or 2**31 - 1, which every kernel treats as out of range (masked or
    skipped), never wrapping onto a valid index.
    """
    if a is None or a.dtype is _INT32 or a.dtype == _INT32:    # `is`: the fast path
        return a
    a = cp.ascontiguousarray(a)
    out = cp.empty(a.shape, dtype=cp.int32)
    n = a.size
    if n:
        fn = kernel("quant", "cps_index_to_i32", quant.INDEX_TO_I32_ARGS)
        fn((grid_stride_blocks(n, 256),), (256,), (a, out, n))
    return out


# ---- registry ----------------------------------------------------------------
# Each op's launcher (raw_kernels/<op>.py, beside its .cu) registers its module when
# imported: its sources, the compute capabilities it runs on, the constants it owns.
# tests/test_kernel_compile.py compiles each module for every arch it claims
# (sm_80, sm_90a, sm_100, sm_120) and checks that the ones it refuses fail.
from cpsparse.raw_kernels import quant, indexer, topk, attention  # noqa: E402,F401

# The lowest compute capability any module runs on (8.0). Before modules
# declared their own capabilities this was the single requirement (9.0);
# require_device(cp) without a module still checks it.
MIN_COMPUTE_CAPABILITY = min(spec.capabilities.lowest for spec in MODULES.values())
