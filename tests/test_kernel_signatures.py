"""The launchers' parameter lists (raw_kernels.Kernel signatures) match the .cu sources.

A launch packs its arguments by the Python signature, so a parameter added in a
``.cu`` file but not in its launcher would shift every later argument. The GPU
checks the sizes again at the first lookup (cuFuncGetParamInfo); this test
catches it on the CPU, from the declarations themselves.
"""

import ctypes
import re
import struct

import pytest

from cpsparse import raw_kernels
from cpsparse.raw_kernels import attention, indexer, quant, topk

# (source, kernel name or the macro that declares a family of kernels, signature)
DECLARED = [
    *[("attention.cu", name + out, args) for out in attention.OUT_SUFFIX.values()
      for name, args in (
        ("cps_sparse_mla_bf16", attention.ATTENTION_ARGS),
        ("cps_sparse_mla_fp8", attention.ATTENTION_ARGS),
        ("cps_mla_combine", attention.COMBINE_ARGS),
        ("cps_mla_combine_few_rows", attention.COMBINE_ARGS),
        ("cps_sparse_mla_model1", attention.MODEL1_ARGS))],
    ("attention.cu", "cps_f32_to_bf16", attention.TO_BF16_ARGS),
    ("attention.cu", "cps_f16_to_bf16", attention.TO_BF16_ARGS),
    ("attention.cu", "cps_local_to_global_slots", attention.SLOTS_ARGS),
    ("indexer.cu", "cps_mqa_logits_mma", indexer.MQA_ARGS),
    ("indexer.cu", "CPS_MQA_WS_KERNEL", indexer.MQA_WS_ARGS),
    ("indexer.cu", "CPS_PAGED_KERNEL", indexer.PAGED_ARGS),
    ("indexer.cu", "CPS_PAGED_WS_KERNEL", indexer.PAGED_WS_ARGS),
    ("quant.cu", "cps_quantize_fp8", quant.QUANTIZE_ARGS),
    ("quant.cu", "cps_indexer_k_quant_and_cache", quant.INSERT_ARGS),
    ("quant.cu", "cps_indexer_k_gather", quant.GATHER_ARGS),
    ("quant.cu", "cps_index_to_i32", quant.INDEX_TO_I32_ARGS),
    ("quant.cu", "cps_scatter_records", quant.SCATTER_ARGS),
    ("quant.cu", "cps_mla_quant_and_cache", quant.MLA_INSERT_ARGS),
    ("quant.cu", "cps_hold_ns", quant.HOLD_ARGS),
    ("topk.cu", "TK_KERNEL", topk.ARGS),
    ("topk.cu", "TK_SROW_KERNEL", topk.ARGS),
]


def _letter(param):
    p = " ".join(param.split())
    if "*" in p:
        return "P"
    if re.fullmatch(r"const __grid_constant__ CpsTensorMap \w+", p):
        return "T"
    if "long long" in p or "int64_t" in p:
        return "q"
    if p.startswith("float") or p.startswith("const float"):
        return "f"
    if re.match(r"(const )?(int|unsigned|int32_t)\b", p):
        return "i"
    raise AssertionError(f"unknown parameter type: {param!r}")


def _declarations(source, first_statement=False):
    """{kernel or macro name: letters} of every __global__ function in ``source``
    (with ``first_statement``: {name: the body's first statement} instead)."""
    text = (raw_kernels.SOURCE_DIR / source).read_text().replace("\\\n", "\n")
    found = {}
    for m in re.finditer(r"__global__\s+void\s+(.*?)\(([^()]*(?:\([^()]*\)[^()]*)*)\)\s*\{",
                         text, re.S):
        head, params = m.group(1), m.group(2)
        if re.fullmatch(r"\s*\w+\s*", params):     # a parameter-list macro (ATT_PARAMS)
            body = re.search(r"#define\s+" + params.strip() + r"\s+(.*?)\n\s*\n", text, re.S)
            assert body, f"{source}: parameter list {params.strip()} is not a #define"
            params = body.group(1)
        # the name is the last identifier before the parameter list (attributes first)
        name = re.findall(r"[\w#]+", head)[-1]
        if name == "NAME" or "##" in name:
            defined = re.findall(r"#define\s+(\w+)\(", text[:m.start()])
            name = defined[-1]
        letters = "".join(_letter(p) for p in params.split(",") if p.strip())
        found[name] = " ".join(text[m.end():text.index(";", m.end()) + 1].split()) \
            if first_statement else letters
    return found


@pytest.mark.parametrize("source,name,signature", DECLARED, ids=[d[1] for d in DECLARED])
def test_signature_matches_source(source, name, signature):
    found = _declarations(source)
    assert name in found, f"{name} not declared in {source}: {sorted(found)}"
    assert found[name] == signature.replace(" ", ""), (source, name)


def test_every_kernel_has_a_signature():
    declared = {(s, n) for s, n, _ in DECLARED}
    for source in ("attention.cu", "indexer.cu", "quant.cu", "topk.cu"):
        for name in _declarations(source):
            assert (source, name) in declared, f"{source}: {name} has no launcher signature"


_SOURCES = {"attention": "attention.cu", "indexer": "indexer.cu", "quant": "quant.cu",
            "topk": "topk.cu"}


@pytest.mark.parametrize("module", sorted(_SOURCES))
def test_pdl_modules_wait_for_the_previous_grid_first(module):
    """A module launched with PDL (register_module(pdl=True)) may start while the kernel
    before it still writes its inputs: each of its kernels must wait for that grid
    (CPS_PDL_ENTRY or CPS_PDL_WAIT) before anything else; a module launched without PDL
    does not carry the wait (where it would be dead code that reads as if it mattered)."""
    pdl = raw_kernels.MODULES[module].pdl
    first = _declarations(_SOURCES[module], first_statement=True)
    assert first, module
    # every __global__ of the module's files is one the parse above saw (a kernel declared
    # another way, or in a header, would escape it; test_kernel_compile.py checks the
    # compiled code of every kernel regardless)
    code = [re.sub(r"//.*", "", (raw_kernels.SOURCE_DIR / f).read_text())
            for f in raw_kernels.MODULES[module].files]
    assert sum(c.count("__global__") for c in code) == len(first), (module, sorted(first))
    for name, statement in first.items():
        assert (statement in ("CPS_PDL_ENTRY();", "CPS_PDL_WAIT();")) == pdl, \
            (module, name, statement)
    assert set(_SOURCES) == set(raw_kernels.MODULES)
    assert {m for m in _SOURCES if raw_kernels.MODULES[m].pdl} == {"attention", "indexer", "topk"}


class _Stream:                    # CuPy's current stream, as a launch reads it
    ptr = 77


class _Raw:                       # stands in for a cupy.RawKernel: its CUfunction address
    class kernel:
        ptr = 1234


class _CP:
    class cuda:
        get_current_stream = staticmethod(lambda: _Stream)


def test_pdl_launch_carries_the_attribute(monkeypatch):
    """A PDL module's Kernel launches through cuLaunchKernelEx with one launch attribute,
    programmatic stream serialization (id 6, value 1), the grid, block, shared memory and
    stream of the call, on both launch paths; set_pdl(False) takes cuLaunchKernel again
    (CPU: both driver calls recorded, the config read back from its bytes)."""
    ex_calls, plain_calls = [], []

    def launch_ex(config_ref, fptr, params, extra):
        c = config_ref._obj
        attrs = (raw_kernels._LaunchAttribute * c.numAttrs).from_address(c.attrs)
        ex_calls.append(((c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY,
                          c.blockDimZ, c.sharedMemBytes, c.hStream),
                         [(a.id, a.value.flag) for a in attrs], fptr, params, extra))
        return 0

    # cuda.h's layouts: CUlaunchConfig, CUlaunchAttribute (its union 8-byte aligned)
    config_t, attr_t = raw_kernels._LaunchConfig, raw_kernels._LaunchAttribute
    assert ctypes.sizeof(config_t) == 56 and ctypes.sizeof(attr_t) == 72
    assert (config_t.sharedMemBytes.offset, config_t.hStream.offset, config_t.attrs.offset,
            config_t.numAttrs.offset) == (24, 32, 40, 48)
    assert attr_t.value.offset == 8 and ctypes.alignment(attr_t) == 8
    monkeypatch.setattr(raw_kernels, "_param_sizes", lambda fptr: [8, 4])
    monkeypatch.setattr(raw_kernels, "_driver_launch", lambda: lambda *a: plain_calls.append(a))
    monkeypatch.setattr(raw_kernels, "_pdl_launch", lambda: launch_ex)
    monkeypatch.setattr(raw_kernels, "device_facts", lambda: raw_kernels.DeviceFacts(
        0, (9, 0), 132, 233472, 232448))
    monkeypatch.setattr(raw_kernels, "_PDL", [True])
    fn = raw_kernels.Kernel(_Raw(), "k", "Pi", pdl=True).bind(_CP)
    launch = fn.launcher((5,), (128, 2), 4096)
    launch((None, 9))
    fn((6, 2), (64,), (None, 9), shared_mem=100)
    monkeypatch.setattr(_Stream, "ptr", 88)             # the current stream, at each launch
    launch((None, 9))
    assert ex_calls == [((5, 1, 1, 128, 2, 1, 4096, 77), [(6, 1)], 1234, fn._params, None),
                        ((6, 2, 1, 64, 1, 1, 100, 77), [(6, 1)], 1234, fn._params, None),
                        ((5, 1, 1, 128, 2, 1, 4096, 88), [(6, 1)], 1234, fn._params, None)]
    assert not plain_calls
    assert raw_kernels.set_pdl(False) is True
    launch((None, 9))
    fn((6, 2), (64,), (None, 9), shared_mem=100)
    assert len(ex_calls) == 3 and len(plain_calls) == 2
    assert raw_kernels.set_pdl(True) is False
    # a failed launch raises (CuPy's driver error) with the driver's status

    class DriverError(Exception):
        def __init__(self, status):
            super().__init__(status)
            self.status = status
    monkeypatch.setattr(raw_kernels, "_driver_error", DriverError)
    fn._launch_ex = lambda *a: 719                       # CUDA_ERROR_LAUNCH_FAILED
    with pytest.raises(DriverError) as failed:
        fn((1,), (32,), (None, 9))
    assert failed.value.status == 719
    # no PDL where the kernel does not wait, or the device predates it (8.x)
    assert raw_kernels.Kernel(_Raw(), "k", "Pi").bind(_CP)._launch_ex is None
    monkeypatch.setattr(raw_kernels, "device_facts", lambda: raw_kernels.DeviceFacts(
        0, (8, 0), 108, 167936, 166912))
    assert raw_kernels.Kernel(_Raw(), "k", "Pi", pdl=True).bind(_CP)._launch_ex is None


def test_packer_writes_each_parameter_in_its_slot():
    class Array:                       # stands in for a CuPy array: only .data.ptr is read
        class data:
            ptr = 0x7F00DEADBEE0

    pack = raw_kernels.Kernel._packer("t", "PqifP")
    buffer = ctypes.create_string_buffer(40)
    pack(buffer, (Array(), -5, -7, 0.1, None))
    assert struct.unpack("<Qqi4xf4xQ", buffer.raw) == (
        0x7F00DEADBEE0, -5, -7, struct.unpack("<f", struct.pack("<f", 0.1))[0], 0)
    with pytest.raises(ValueError):
        pack(buffer, (Array(), 1, 2, 0.5))              # one argument short


def test_tensor_map_parameters_take_128_bytes_by_value(monkeypatch):
    """A ``T`` parameter (a CUtensorMap by value) fills a 128-byte slot between 8-byte
    ones; the launch's parameter pointers point at each slot, and the first lookup
    expects 128 bytes from the driver for it (CPU: the driver's answer faked)."""
    monkeypatch.setattr(raw_kernels, "_driver_launch", lambda: None)
    monkeypatch.setattr(raw_kernels, "_param_sizes", lambda fptr: [4, 128, 8])
    fn = raw_kernels.Kernel(_Raw(), "k", "iTq").bind(_CP)
    tmap = bytes(range(128))
    fn._pack(fn._buffer, (3, tmap, -1))
    assert struct.unpack("<i4x128sq", fn._buffer.raw) == (3, tmap, -1)
    base = ctypes.addressof(fn._buffer)
    assert list(fn._pointers) == [base, base + 8, base + 136]
    with pytest.raises(RuntimeError, match="parameter sizes"):
        raw_kernels.Kernel(_Raw(), "k", "iPq").bind(_CP)


def test_tensor_map_refuses_what_tma_cannot_copy(monkeypatch):
    """tensor_map checks TMA's rules before the driver sees them: a 16-byte aligned
    address, box sides of 1..256, box rows and outer strides in 16-byte multiples; what
    passes reaches cuTensorMapEncodeTiled with the contiguous strides (CPU: the driver
    faked, its arguments recorded)."""
    calls = []

    def encode(at, dtype, rank, ptr, dims, strides, box, estr, inter, swz, l2, oob):
        calls.append((at % 64, dtype, rank, ptr, list(dims[:rank]), list(strides[:rank - 1]),
                      list(box[:rank]), list(estr[:rank]), inter, swz, oob))
        ctypes.memmove(at, bytes([7]) * 128, 128)
        return 0
    monkeypatch.setattr(raw_kernels, "_driver_fn", lambda name: encode)
    u8, f32 = raw_kernels.TMAP_UINT8, raw_kernels.TMAP_FLOAT32
    got = raw_kernels.tensor_map(1 << 20, u8, (128, 1000), (128, 256),
                                 raw_kernels.TMAP_SWIZZLE_128B)
    assert got == bytes([7]) * 128
    assert calls == [(0, 0, 2, 1 << 20, [128, 1000], [128], [128, 256], [1, 1], 0, 3, 0)]
    raw_kernels.tensor_map(1 << 20, f32, (5,), (256,))
    assert calls[-1][1:8] == (7, 1, 1 << 20, [5], [], [256], [1])
    for ptr, dtype, dims, box in ((8, f32, (5,), (256,)),             # 8-byte aligned
                                  (16, f32, (5,), (2,)),              # an 8-byte box row
                                  (16, u8, (128, 9), (128, 257)),      # a box side > 256
                                  (16, u8, (24, 9), (16, 8))):        # a 24-byte stride
        with pytest.raises(ValueError, match="Invalid tensor map"):
            raw_kernels.tensor_map(ptr, dtype, dims, box)
    assert len(calls) == 2
    # an encoder keeps its last addresses' maps: a rotation over a few buffers encodes
    # each once, and the oldest leaves first
    encoder = raw_kernels.TensorMapEncoder(f32, (5,), (256,), memo=2)
    for ptr in (16, 32, 16, 32, 48, 16):
        assert encoder(ptr) == bytes([7]) * 128
    assert [c[3] for c in calls[2:]] == [16, 32, 48, 16]
    monkeypatch.setattr(raw_kernels, "_driver_fn", lambda name: lambda *a: 1)
    with pytest.raises(RuntimeError, match="CUresult 1"):
        raw_kernels.tensor_map(16, f32, (5,), (256,))


def test_bind_checks_int64_parameters_as_eight_bytes(monkeypatch):
    """The first lookup compares the signature's sizes with the compiled kernel's: a
    pointer and an int64 take 8 bytes, an int32 and a float32 4 (CPU: the driver's answer
    faked)."""
    monkeypatch.setattr(raw_kernels, "_driver_launch", lambda: None)
    monkeypatch.setattr(raw_kernels, "_param_sizes", lambda fptr: [8, 8, 4, 4])
    raw_kernels.Kernel(_Raw(), "k", "Pqif").bind(_CP)
    for wrong in ("Piif", "PqPf", "Pqi"):
        with pytest.raises(RuntimeError, match="parameter sizes"):
            raw_kernels.Kernel(_Raw(), "k", wrong).bind(_CP)


@pytest.mark.parametrize("dtype", ["uint32", "float32", "int64", "int16"])
def test_index_arrays_other_than_int32_are_converted(monkeypatch, dtype):
    """index_i32 hands an int32 array to the kernels as it is and converts every other
    dtype, a 4-byte one too (uint32 or float32 bits read as int32 would be other indices),
    with the conversion kernel (CPU: NumPy for CuPy, the kernel recorded)."""
    import numpy as np
    launched = []

    class Fn:
        def __call__(self, grid, block, args):
            launched.append((grid, block, args[2]))

    monkeypatch.setattr(raw_kernels, "kernel", lambda module, name, signature: Fn())
    monkeypatch.setattr(raw_kernels, "device_facts", lambda: raw_kernels.DeviceFacts(
        0, (9, 0), 132, 233472, 232448))
    same = np.arange(5, dtype=np.int32)
    assert raw_kernels.index_i32(np, same) is same
    assert raw_kernels.index_i32(np, None) is None
    got = raw_kernels.index_i32(np, np.arange(5, dtype=dtype))
    assert got.dtype == np.int32 and got.shape == (5,)
    assert launched == [((1,), (256,), 5)]


def test_bad_signature_letter_is_refused():
    with pytest.raises(ValueError, match="Invalid signature"):
        raw_kernels.Kernel(None, "t", "Px")


def test_kernel_lookup_sets_function_attributes_once(monkeypatch):
    """kernel(): memoized per (device, module, name); the carveout and the raised
    shared-memory limit land on the CuPy function (CPU: CuPy and the device faked)."""

    class Raw:                                  # stands in for cupy.RawKernel
        preferred_shared_memory_carveout = None
        max_dynamic_shared_size_bytes = 0

        class kernel:
            ptr = 1234

    class Cuda:
        class runtime:
            @staticmethod
            def getDevice():
                return 7

        @staticmethod
        def get_current_stream():
            return None

    class CP:
        cuda = Cuda

    raw = Raw()
    monkeypatch.setattr(raw_kernels, "_cupy", lambda: CP)
    monkeypatch.setattr(raw_kernels, "get_function", lambda module, name: raw)
    monkeypatch.setattr(raw_kernels, "_param_sizes", lambda fptr: [8, 4])
    monkeypatch.setattr(raw_kernels, "_driver_launch", lambda: None)
    monkeypatch.setattr(raw_kernels, "_KERNELS", {})
    fn = raw_kernels.kernel("m", "k", "Pi", smem=1000, carveout=100)
    assert fn.raw is raw and raw.preferred_shared_memory_carveout == 100
    assert raw.max_dynamic_shared_size_bytes == 1000
    assert raw_kernels.kernel("m", "k", "Pi", smem=500) is fn
    assert raw.max_dynamic_shared_size_bytes == 1000          # never lowered
    raw_kernels.kernel("m", "k", "Pi", smem=2000)
    assert raw.max_dynamic_shared_size_bytes == 2000
    monkeypatch.setattr(raw_kernels, "_param_sizes", lambda fptr: [8, 8])
    with pytest.raises(RuntimeError, match="parameter sizes"):
        raw_kernels.kernel("m", "k2", "Pi")                   # int32 declared, 8 compiled


def test_launcher_fixes_the_launch_and_keeps_its_kernel(monkeypatch):
    """Kernel.launcher: the same driver call as __call__ (grid and block padded to three
    dimensions, the stream's handle, the packed parameters), and the closure holds its
    Kernel so that the code a bare function address names stays loaded (CPU: the driver
    call recorded)."""
    calls = []

    monkeypatch.setattr(raw_kernels, "_param_sizes", lambda fptr: [8, 4])
    monkeypatch.setattr(raw_kernels, "_driver_launch", lambda: lambda *a: calls.append(a))
    fn = raw_kernels.Kernel(_Raw(), "k", "Pi").bind(_CP)
    launch = fn.launcher((5,), (128, 2), 4096)
    launch((None, 9))
    assert struct.unpack("<Qi4x", fn._buffer.raw) == (0, 9)       # packed by the closure
    fn._buffer.raw = bytes(16)
    fn((5,), (128, 2), (None, 9), shared_mem=4096)
    assert calls[0] == calls[1] == (1234, 5, 1, 1, 128, 2, 1, 4096, 77, fn._params, 0)
    assert launch.kernel is fn
    assert struct.unpack("<Qi4x", fn._buffer.raw) == (0, 9)


class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class _Flags:
    c_contiguous = True


class _FakeArray:
    """A device array as the launchers see it: shape, dtype, address (C-contiguous)."""
    flags = _Flags()

    def __init__(self, shape, dtype, ptr=0x1000):
        import numpy as np
        self.shape, self.dtype, self.ndim = shape, np.dtype(dtype), len(shape)
        self.data = _Ptr(ptr)


def test_ws_decode_launch_arguments_on_both_paths(monkeypatch):
    """The warp-specialized decode launch of the checked path (_paged_ws) and the call
    memo's prepared one (call_launch) pass the kernel the same arguments in
    PAGED_WS_ARGS order: one CTA an SM (at most one a stage of the batch: ws_grid), the
    batch and the item cap in stages from the plan, the pages' L2 policy from their bytes
    against the L2 (CPU: the kernel and the device faked; the prepared launch declines an
    operand off 16 bytes)."""
    import numpy as np
    from cpsparse.raw_kernels import indexer as kin

    launches = []

    class Fn:
        def launcher(self, grid, block, smem):
            return lambda args: launches.append((grid, block, smem, args))

    Arr = _FakeArray

    class Cache:
        dtype, block_size, num_blocks = "fp8", 64, 40

        def __init__(self):
            self.data = Arr((40, 64 * 132), np.uint8)

    class Facts:
        sms = 3                                  # fewer SMs than the batch's 2 x 2 stages
        l2_bytes = 200_000                       # 2 x 500 keys of 132 bytes: past its half

    class CP:
        uint8, int32, float32 = np.dtype(np.uint8), np.dtype(np.int32), np.dtype(np.float32)

        @staticmethod
        def ndarray(shape, dtype):
            return Arr(shape, dtype, 0x9000)

    fn, cache = Fn(), Cache()
    plan = ("ws", 128, 1, 64, kin.WS_STAGES, 8 * kin.WS_MATH, 1)      # items of <= 8 stages
    monkeypatch.setattr(kin, "paged_plan", lambda *a: ("wgmma", plan, fn))
    monkeypatch.setattr(raw_kernels, "device_facts", lambda: Facts)
    monkeypatch.setattr(raw_kernels, "current_device", lambda: 0)
    q, w = Arr((2, 2, 64, 128), np.uint8), Arr((4, 64), np.float32)
    ctx, table = Arr((2, 2), np.int32), Arr((2, 9), np.int32)
    out = Arr((4, 500), np.float32)
    assert kin._paged_ws(CP, q, cache, w, ctx, table, 500, out, fn, plan[5]) is out
    dev, run = kin.call_launch(CP, q, cache, ctx, table, 500)
    got = run(q, cache.data, w, ctx, table)
    assert dev == 0 and got.shape == (4, 500) and got.data.ptr == 0x9000
    want = ((3,), (kin.WS_THREADS,), kin.WSD_SMEM[False],
            (q, cache.data, w, ctx, 1, table, 9, 40, out, 500, 64, 2, 8, 1, 1))
    assert launches[0] == want
    assert launches[1] == want[:3] + (want[3][:8] + (got,) + want[3][9:],)
    assert run(Arr(q.shape, np.uint8, 0x1001), cache.data, w, ctx, table) is None
    assert len(launches) == 2
    # clean_logits=False: clean 0 on both paths, l2_stream still 1 (each flag its own
    # argument, in its own place)
    kin._paged_ws(CP, q, cache, w, ctx, table, 500, out, fn, plan[5], clean_logits=False)
    _, run = kin.call_launch(CP, q, cache, ctx, table, 500, clean_logits=False)
    got = run(q, cache.data, w, ctx, table)
    assert launches[2] == want[:3] + (want[3][:-2] + (0, 1),)
    assert launches[3] == want[:3] + (want[3][:8] + (got,) + want[3][9:-2] + (0, 1),)
    # an L2 twice the pages: l2_stream 0, clean 1
    Facts.l2_bytes = 2 * 2 * 500 * 132
    kin._paged_ws(CP, q, cache, w, ctx, table, 500, out, fn, plan[5])
    _, run = kin.call_launch(CP, q, cache, ctx, table, 500)
    got = run(q, cache.data, w, ctx, table)
    assert launches[4] == want[:3] + (want[3][:-1] + (0,),)
    assert launches[5] == want[:3] + (want[3][:8] + (got,) + want[3][9:-1] + (0,),)
    # the cache's 40 pages of 64 keys bound the bytes (a padded width reads no more):
    # 2 x 50000 keys over an L2 of 2 x 40 x 64 x 132 bytes stay evict-normal
    Facts.l2_bytes = 2 * 40 * 64 * 132
    kin._paged_ws(CP, q, cache, w, ctx, table, 50000, Arr((4, 50000), np.float32), fn,
                  plan[5])
    assert launches[6][3][-1] == 0 and launches[6][3][9] == 50000


def test_attention_launch_arguments_on_both_paths(monkeypatch):
    """The fp8 attention launch of the checked path (sparse_mla_attention -> _launch) and
    the call memo's prepared one (call_launch) are the same prepared launch (prepare):
    the same kernel arguments in ATTENTION_ARGS order, then the split-KV combine's in
    COMBINE_ARGS order (B=1, H=128: split). The formats of q and out travel as the
    FORMATS codes (a float16 or bfloat16 q, a 16-bit out allocated in its dtype). The
    prepared launch declines queries or a cache off 16 bytes; call_launch declines what
    the checked path converts first (CPU: the kernels, allocations and the device
    faked)."""
    import ml_dtypes
    import numpy as np
    from cpsparse.raw_kernels import attention as katt

    launches = []

    class Fn:
        def __init__(self, name):
            self.name = name

        def launcher(self, grid, block, smem=0):
            return lambda args: launches.append((self.name, grid, block, smem, args))

    Arr = _FakeArray

    class Facts:
        sms = 132

    class CP:
        int32, float16, float32, float64 = (np.dtype(t) for t in
                                            (np.int32, np.float16, np.float32, np.float64))

    monkeypatch.setattr(katt, "_PLANS", {})
    monkeypatch.setattr(katt, "_LAUNCHES", {})
    monkeypatch.setattr(raw_kernels, "kernel", lambda module, name, *a, **k: Fn(name))
    fresh = iter(range(0x10000, 0x20000, 0x100))   # a distinct address an allocation

    def empty(cp, shape, dtype):
        return Arr(shape, dtype, next(fresh))
    monkeypatch.setattr(raw_kernels, "empty", empty)
    monkeypatch.setattr(raw_kernels, "device_facts", lambda: Facts)
    monkeypatch.setattr(raw_kernels, "current_device", lambda: 0)
    q, idx = Arr((1, 128, 576), np.float32), Arr((1, 2048), np.int32, 0x2000)
    data = Arr((40, 64, 656), np.uint8, 0x3000)
    rows = Arr((40 * 64, 656), np.uint8, 0x3000)
    out, lse = katt.sparse_mla_attention(CP, q, rows, idx, 0.1, 512, True)
    f32 = np.dtype(np.float32)
    dev, run = katt.call_launch(CP, q, data, rows, idx, 0.1, 512, f32)
    got = run(q, data, idx)
    assert dev == 0 and [a.shape for a in got] == [(1, 128, 512), (1, 128)]
    assert out.shape == (1, 128, 512) and lse.shape == (1, 128)

    def plain(launch):                           # arrays by address; fresh ones by order
        return launch[:4] + (tuple(a.data.ptr if isinstance(a, Arr) else a
                                   for a in launch[4]),)
    # each call allocates out, lse, then the partials: 0x10000 + 0x100 * (3 call + i)
    assert [a.data.ptr for a in (out, lse)] == [0x10000, 0x10100]
    assert [a.data.ptr for a in got] == [0x10300, 0x10400]
    units, splits = 2, katt.choose_splits(2, 2048 // 64, 132)
    assert splits > 1
    scale_log2 = float(np.float32(0.1 * np.log2(np.e)))

    def want(call):                              # call 0: the checked path, 1: the memo's
        out, lse, part = (0x10000 + 0x100 * (3 * call + i) for i in range(3))
        return [("cps_sparse_mla_fp8", (units * splits,), (katt.DEC_THREADS,), katt.SMEM_BYTES,
                 (0x1000, 0, 0x3000, 0x2000, 2048, 2560, None, None, out, lse, 128, 512,
                  scale_log2, splits, part, None)),
                ("cps_mla_combine_few_rows", (128,), (katt.COMBINE_THREADS,), 0,
                 (part, out, lse, None, splits, 512, 128))]
    assert [plain(x) for x in launches] == want(0) + want(1)
    assert run(Arr(q.shape, np.float32, 0x1004), data, idx) is None
    assert run(q, Arr(data.shape, np.uint8, 0x3008), idx) is None
    assert len(launches) == 4
    for dtype, code in [(np.float16, 1), (ml_dtypes.bfloat16, 2)]:
        q16 = Arr(q.shape, np.dtype(dtype))
        katt.call_launch(CP, q16, data, rows, idx, 0.1, 512, f32)[1](q16, data, idx)
        assert plain(launches[-2])[4][1] == code              # q_fmt
    for dtype, suffix in [(np.float16, "_out_f16"), (ml_dtypes.bfloat16, "_out_bf16")]:
        out16, _ = katt.call_launch(CP, q, data, rows, idx, 0.1, 512,
                                    np.dtype(dtype))[1](q, data, idx)
        assert out16.dtype == np.dtype(dtype)
        # split: the float32 kernel writes the partials, the merge of the out's format
        # the out (a format is a kernel's own, not an argument)
        assert launches[-2][0] == "cps_sparse_mla_fp8"
        assert launches[-1][0] == "cps_mla_combine_few_rows" + suffix
        assert plain(launches[-2])[4][1:3] == (0, 0x3000)     # q_fmt, then kv
        assert len(plain(launches[-1])[4]) == 7
    for q_, data_, rows_, idx_ in [(Arr(q.shape, np.float64), data, rows, idx),
                                   (q, data, rows, Arr(idx.shape, np.int64)),
                                   (q, data, Arr(rows.shape, np.uint8, 0x5000), idx),
                                   (q, data, Arr((40 * 64, 584), np.uint8, 0x3000), idx),
                                   (q, data, Arr((0, 656), np.uint8, 0x3000), idx)]:
        assert katt.call_launch(CP, q_, data_, rows_, idx_, 0.1, 512, f32) is None
