"""The kernel loader: one compile per (device, module) under concurrent first calls,
clean errors without CuPy or on an old GPU. Runs on the CPU with a fake CuPy."""

import threading
import time
import types

import pytest

from cpsparse import _backend, raw_kernels


class FakeRawModule:
    compiles = 0
    lock = threading.Lock()

    def __init__(self, code, options):
        self.code, self.options = code, options

    def compile(self):
        time.sleep(0.05)                         # widen the race window
        with FakeRawModule.lock:
            FakeRawModule.compiles += 1

    def get_function(self, name):
        return (name, self)


def fake_cupy(cc=(9, 0)):
    device = types.SimpleNamespace(id=0, compute_capability=f"{cc[0]}{cc[1]}")
    cuda = types.SimpleNamespace(Device=lambda: device)
    return types.SimpleNamespace(RawModule=FakeRawModule, cuda=cuda)


@pytest.fixture
def loader(monkeypatch):
    FakeRawModule.compiles = 0
    monkeypatch.setattr(raw_kernels, "_COMPILED", {})
    return monkeypatch


def test_concurrent_first_calls_compile_once(loader):
    loader.setattr(_backend, "cupy_module", lambda: fake_cupy())
    results, errors = [], []

    def worker():
        try:
            results.append(raw_kernels.get_function("quant", "cps_quantize_fp8"))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert FakeRawModule.compiles == 1
    assert len({id(mod) for _, mod in results}) == 1


def test_precompile_compiles_every_module_once(loader):
    loader.setattr(_backend, "cupy_module", lambda: fake_cupy())
    names = raw_kernels.precompile()
    assert sorted(names) == sorted(raw_kernels.MODULES)
    assert FakeRawModule.compiles == len(raw_kernels.MODULES)
    raw_kernels.precompile()
    assert FakeRawModule.compiles == len(raw_kernels.MODULES)


def test_sm90_gets_the_arch_specific_target(loader):
    loader.setattr(_backend, "cupy_module", lambda: fake_cupy())
    _, mod = raw_kernels.get_function("quant", "cps_quantize_fp8")
    assert "-arch=sm_90a" in mod.options
    assert mod.code == raw_kernels.module_source("quant")


def test_old_gpu_is_refused_cleanly(loader):
    loader.setattr(_backend, "cupy_module", lambda: fake_cupy((8, 0)))
    with pytest.raises(raw_kernels.KernelUnavailable, match="compute capability >= 9.0"):
        raw_kernels.get_function("quant", "cps_quantize_fp8")


def test_no_cupy_is_refused_cleanly(loader):
    loader.setattr(_backend, "cupy_module", lambda: None)
    with pytest.raises(raw_kernels.KernelUnavailable, match="CuPy is not installed"):
        raw_kernels.precompile()


def test_module_source_concatenates_headers_first():
    src = raw_kernels.module_source("quant")
    assert src.index("cps_e4m3_encode") < src.index("cps_quantize_fp8")
    assert "#include" not in src      # one string: CuPy's cache keys on it
