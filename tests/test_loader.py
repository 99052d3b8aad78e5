"""The kernel loader: one compile per (device, module) under concurrent first calls,
clean errors without CuPy, on an old GPU, and on a GPU outside a module's compute
capabilities (refused before any compile). Runs on the CPU with a fake CuPy."""

import functools
import threading
import time
import types

import pytest

import cpsparse
from cpsparse import _backend, raw_kernels


class FakeRawModule:
    compiles = 0
    constructed = 0
    lock = threading.Lock()

    def __init__(self, code, options):
        self.code, self.options = code, options
        with FakeRawModule.lock:
            FakeRawModule.constructed += 1

    def compile(self):
        time.sleep(0.05)                         # widen the race window
        with FakeRawModule.lock:
            FakeRawModule.compiles += 1

    def get_function(self, name):
        return (name, self)


def fake_cupy(cc=(9, 0), name="FakeGPU"):
    # CuPy's Device.compute_capability is f"{major}{minor}": "90", "100", "120".
    device = types.SimpleNamespace(id=0, compute_capability=f"{cc[0]}{cc[1]}")
    runtime = types.SimpleNamespace(
        getDeviceProperties=lambda dev: {"name": name.encode()})
    cuda = types.SimpleNamespace(Device=lambda: device, runtime=runtime)
    return types.SimpleNamespace(RawModule=FakeRawModule, cuda=cuda)


@pytest.fixture
def loader(monkeypatch):
    FakeRawModule.compiles = 0
    FakeRawModule.constructed = 0
    monkeypatch.setattr(raw_kernels, "_COMPILED", {})
    return monkeypatch


def use_device(loader, cc, name="FakeGPU"):
    loader.setattr(_backend, "cupy_module", lambda: fake_cupy(cc, name))


def test_concurrent_first_calls_compile_once(loader):
    use_device(loader, (9, 0))
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
    use_device(loader, (9, 0))
    names = raw_kernels.precompile()
    assert sorted(names) == sorted(raw_kernels.MODULES)
    assert FakeRawModule.compiles == len(raw_kernels.MODULES)
    raw_kernels.precompile()
    assert FakeRawModule.compiles == len(raw_kernels.MODULES)


def test_sm90_gets_the_arch_specific_target(loader):
    use_device(loader, (9, 0))
    _, mod = raw_kernels.get_function("quant", "cps_quantize_fp8")
    assert "-arch=sm_90a" in mod.options
    assert mod.code == raw_kernels.module_source("quant")


# ---- compute capability per module ---------------------------------------------
# Spelled out here (not derived from the registry) so the rule is pinned:
# quant 8.0+, topk 9.0+ (clusters), indexer and attention 9.0 only (wgmma, sm_90a).
ALL = ["quant", "indexer", "topk", "attention"]
RUNS_ON = {
    (7, 5): [],
    (8, 0): ["quant"],
    (8, 9): ["quant"],
    (9, 0): ALL,
    (10, 0): ["quant", "topk"],
    (12, 0): ["quant", "topk"],
}
ARCH = {(7, 5): "sm_75", (8, 0): "sm_80", (8, 9): "sm_89", (9, 0): "sm_90a",
        (10, 0): "sm_100", (12, 0): "sm_120"}
SUPPORTS = {"quant": "8.0 and newer", "topk": "9.0 and newer",
            "indexer": "9.0 only", "attention": "9.0 only"}
CASES = [(cc, name) for cc in RUNS_ON for name in ALL]


def _id(case):
    (major, minor), name = case
    return f"cc{major}{minor}-{name}"


@pytest.mark.parametrize("cc,name", CASES, ids=[_id(c) for c in CASES])
def test_device_runs_or_refuses_each_module(loader, cc, name):
    use_device(loader, cc, name=f"FakeGPU {cc[0]}.{cc[1]}")
    if name in RUNS_ON[cc]:
        mod = raw_kernels.get_module(name)
        assert FakeRawModule.compiles == 1
        assert f"-arch={ARCH[cc]}" in mod.options
        return
    with pytest.raises(raw_kernels.KernelUnavailable) as info:
        raw_kernels.get_module(name)
    assert FakeRawModule.constructed == 0, "refused module must not reach the compiler"
    msg = str(info.value)
    assert f"module '{name}'" in msg
    for op in raw_kernels.MODULES[name].ops:
        assert op in msg
    assert f"compute capability {cc[0]}.{cc[1]}" in msg
    assert f"FakeGPU {cc[0]}.{cc[1]}" in msg                  # the device's name
    assert f"compute capability {SUPPORTS[name]}" in msg      # what it supports
    assert "NumPy arrays" in msg and "cpsparse.set_kernels_enabled(False)" in msg
    with pytest.raises(raw_kernels.KernelUnavailable):   # get_function: same refusal
        raw_kernels.get_function(name, "any")
    assert FakeRawModule.constructed == 0


def test_refusal_names_what_does_run_and_works_without_a_device_name(loader):
    cp = fake_cupy((10, 0))
    del cp.cuda.runtime.getDeviceProperties            # name unknown: still a message
    loader.setattr(_backend, "cupy_module", lambda: cp)
    with pytest.raises(raw_kernels.KernelUnavailable,
                       match=r"compute capability 10\.0.*run on 10\.0: quant, topk"):
        raw_kernels.get_module("attention")
    assert FakeRawModule.constructed == 0


@pytest.mark.parametrize("cc", sorted(RUNS_ON))
def test_supported_modules(cc):
    assert raw_kernels.supported_modules(cc) == RUNS_ON[cc]
    assert raw_kernels.supported_modules(f"{cc[0]}{cc[1]}") == RUNS_ON[cc]    # CuPy's form
    assert raw_kernels.supported_modules(f"{cc[0]}.{cc[1]}") == RUNS_ON[cc]
    assert raw_kernels.supported_ops(cc) == [
        op for name in RUNS_ON[cc] for op in raw_kernels.MODULES[name].ops]


def test_newer_minor_and_major_versions_follow_the_rule():
    assert raw_kernels.supported_modules((10, 3)) == ["quant", "topk"]
    assert raw_kernels.supported_modules((9, 1)) == ["quant", "topk"]   # not 9.0: no sm_90a
    assert raw_kernels.supported_modules((8, 6)) == ["quant"]


def test_every_listed_op_exists():
    for name, spec in raw_kernels.MODULES.items():
        assert spec.ops, f"module {name} lists no ops"
        for op in spec.ops:
            functools.reduce(getattr, op.split("."), cpsparse)   # AttributeError if stale


def test_arch_for():
    assert raw_kernels.arch_for((9, 0)) == "sm_90a"
    assert raw_kernels.arch_for("100") == "sm_100"
    assert raw_kernels.arch_for((12, 0)) == "sm_120"
    assert raw_kernels.arch_for((8, 0)) == "sm_80"


def test_precompile_skips_what_the_device_cannot_run(loader):
    use_device(loader, (10, 0))
    assert raw_kernels.precompile() == ["quant", "topk"]
    assert FakeRawModule.compiles == 2


def test_precompile_refuses_a_named_unsupported_module_before_compiling_any(loader):
    use_device(loader, (10, 0))
    with pytest.raises(raw_kernels.KernelUnavailable, match="'indexer'.*10\\.0"):
        raw_kernels.precompile(["quant", "indexer"])
    assert FakeRawModule.constructed == 0
    assert raw_kernels.precompile(["topk"]) == ["topk"]


def test_precompile_on_a_device_that_runs_nothing(loader):
    use_device(loader, (7, 5))
    assert raw_kernels.precompile() == []
    assert FakeRawModule.constructed == 0
    with pytest.raises(raw_kernels.KernelUnavailable, match="'quant'.*8\\.0 and newer"):
        raw_kernels.precompile(["quant"])


def test_require_device_without_and_with_a_module(loader):
    assert raw_kernels.MIN_COMPUTE_CAPABILITY == (8, 0)
    cp = fake_cupy((10, 0))
    assert raw_kernels.require_device(cp) == (0, (10, 0))
    assert raw_kernels.require_device(cp, "topk") == (0, (10, 0))
    with pytest.raises(raw_kernels.KernelUnavailable, match="'indexer'"):
        raw_kernels.require_device(cp, "indexer")


def test_old_gpu_is_refused_cleanly(loader):
    use_device(loader, (7, 5))
    with pytest.raises(raw_kernels.KernelUnavailable, match="compute capability >= 8.0"):
        raw_kernels.require_device(fake_cupy((7, 5)))
    with pytest.raises(raw_kernels.KernelUnavailable, match="compute capability 7.5"):
        raw_kernels.get_function("quant", "cps_quantize_fp8")
    assert FakeRawModule.constructed == 0


def test_no_cupy_is_refused_cleanly(loader):
    loader.setattr(_backend, "cupy_module", lambda: None)
    with pytest.raises(raw_kernels.KernelUnavailable, match="CuPy is not installed"):
        raw_kernels.precompile()


def test_modules_must_declare_capabilities(monkeypatch):
    monkeypatch.setattr(raw_kernels, "MODULES", dict(raw_kernels.MODULES))
    with pytest.raises(TypeError):
        raw_kernels.register_module("_x", ["common.cuh"])
    with pytest.raises(TypeError):
        raw_kernels.register_module("_x", ["common.cuh"], capabilities=(9, 0))
    with pytest.raises(ValueError):
        raw_kernels.Capabilities()


def test_capability_rules():
    caps = raw_kernels.at_least(9, 0)
    assert (9, 0) in caps and (12, 1) in caps and (8, 9) not in caps
    assert str(caps) == "9.0 and newer"
    hopper = raw_kernels.exactly((9, 0))
    assert (9, 0) in hopper and "90" in hopper and (10, 0) not in hopper and (9, 1) not in hopper
    assert str(hopper) == "9.0 only"
    assert raw_kernels.exactly((10, 0), (9, 0)).lowest == (9, 0)
    assert caps.lowest == (9, 0)
    with pytest.raises(ValueError, match="exactly one"):
        raw_kernels.Capabilities(minimum=(8, 0), only=((9, 0),))


@pytest.mark.parametrize("cc", ["9", "", "x0", "9.x", "-90"])
def test_capability_strings_that_name_no_device_are_refused(cc):
    """CuPy's compute-capability strings are "<major><minor>" with one minor digit: a single
    digit or a non-number is no capability."""
    with pytest.raises(ValueError, match="Invalid compute capability" if "." not in cc
                       else "invalid literal"):
        raw_kernels.parse_capability(cc)


def test_grid_sizes(monkeypatch):
    """blocks_for rounds up (at least one block); a grid-stride loop's grid stops at 16
    CTAs an SM."""
    assert [raw_kernels.blocks_for(n, 256) for n in (0, 1, 256, 257, 512, 513)] == \
        [1, 1, 1, 2, 2, 3]
    monkeypatch.setattr(raw_kernels, "device_facts", lambda: raw_kernels.DeviceFacts(
        0, (9, 0), 132, 233472, 232448))
    assert raw_kernels.grid_stride_blocks(1000, 256) == 4
    assert raw_kernels.grid_stride_blocks(10**9, 256) == 132 * 16


def test_module_source_concatenates_headers_first():
    src = raw_kernels.module_source("quant")
    assert src.index("cps_e4m3_encode") < src.index("cps_quantize_fp8")
    assert "#include" not in src      # one string: CuPy's cache keys on it
