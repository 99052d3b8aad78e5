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
    ("attention.cu", "cps_sparse_mla_bf16", attention.ATTENTION_ARGS),
    ("attention.cu", "cps_sparse_mla_fp8", attention.ATTENTION_ARGS),
    ("attention.cu", "cps_f32_to_bf16", attention.TO_BF16_ARGS),
    ("attention.cu", "cps_f16_to_bf16", attention.TO_BF16_ARGS),
    ("attention.cu", "cps_local_to_global_slots", attention.SLOTS_ARGS),
    ("attention.cu", "cps_mla_combine", attention.COMBINE_ARGS),
    ("attention.cu", "cps_sparse_mla_model1", attention.MODEL1_ARGS),
    ("indexer.cu", "cps_mqa_logits_mma", indexer.MQA_ARGS),
    ("indexer.cu", "CPS_MQA_WS_KERNEL", indexer.MQA_ARGS),
    ("indexer.cu", "CPS_PAGED_KERNEL", indexer.PAGED_ARGS),
    ("indexer.cu", "CPS_PAGED_WS_KERNEL", indexer.PAGED_WS_ARGS),
    ("quant.cu", "cps_quantize_fp8", quant.QUANTIZE_ARGS),
    ("quant.cu", "cps_indexer_k_quant_and_cache", quant.INSERT_ARGS),
    ("quant.cu", "cps_indexer_k_gather", quant.GATHER_ARGS),
    ("quant.cu", "cps_index_to_i32", quant.INDEX_TO_I32_ARGS),
    ("quant.cu", "cps_scatter_records", quant.SCATTER_ARGS),
    ("topk.cu", "TK_KERNEL", topk.ARGS),
    ("topk.cu", "TK_SROW_KERNEL", topk.ARGS),
]


def _letter(param):
    p = " ".join(param.split())
    if "*" in p:
        return "P"
    if "long long" in p or "int64_t" in p:
        return "q"
    if p.startswith("float") or p.startswith("const float"):
        return "f"
    if re.match(r"(const )?(int|unsigned|int32_t)\b", p):
        return "i"
    raise AssertionError(f"unknown parameter type: {param!r}")


def _declarations(source):
    """{kernel or macro name: letters} of every __global__ function in ``source``."""
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
        found[name] = letters
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

    class Stream:
        ptr = 77

    class Raw:
        class kernel:
            ptr = 1234

    class CP:
        class cuda:
            get_current_stream = staticmethod(lambda: Stream)

    monkeypatch.setattr(raw_kernels, "_param_sizes", lambda fptr: [8, 4])
    monkeypatch.setattr(raw_kernels, "_driver_launch", lambda: lambda *a: calls.append(a))
    fn = raw_kernels.Kernel(Raw(), "k", "Pi").bind(CP)
    launch = fn.launcher((5,), (128, 2), 4096)
    launch((None, 9))
    assert struct.unpack("<Qi4x", fn._buffer.raw) == (0, 9)       # packed by the closure
    fn._buffer.raw = bytes(16)
    fn((5,), (128, 2), (None, 9), shared_mem=4096)
    assert calls[0] == calls[1] == (1234, 5, 1, 1, 128, 2, 1, 4096, 77, fn._params, 0)
    assert launch.kernel is fn
    assert struct.unpack("<Qi4x", fn._buffer.raw) == (0, 9)
