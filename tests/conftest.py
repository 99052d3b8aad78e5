"""Shared test setup: GPU tests skip cleanly without a CUDA device."""

import pytest

import cpsparse


def pytest_collection_modifyitems(config, items):
    if cpsparse.gpu_available():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=[True, False], ids=["kernels", "reference_on_gpu"])
def cupy_kernels(request):
    """Run a GPU test with the CUDA kernels, then with the reference on CuPy arrays."""
    previous = cpsparse.set_kernels_enabled(request.param)
    try:
        yield request.param
    finally:
        cpsparse.set_kernels_enabled(previous)


@pytest.fixture
def count_core_calls(monkeypatch):
    """``count(module, *names)``: replace those functions of ``module`` (an op's cores)
    by wrappers that record each call on a non-NumPy backend, and return the record. A
    recorded call left the op's prepared launch for its checked path (NumPy calls, the
    tests' references, always go there)."""
    import numpy

    def count(module, *names):
        calls = []
        for name in names:
            real = getattr(module, name)

            def counted(xp, *a, _real=real, _name=name, **kw):
                if xp is not numpy:
                    calls.append(_name)
                return _real(xp, *a, **kw)
            monkeypatch.setattr(module, name, counted)
        return calls
    return count


def memo_prepared_elsewhere(memo):
    """Rewrite the one entry of an op's call memo (a CallMemo whose entries end with the
    prepared launch, ``(device, run)``) as if another device than the current one had
    prepared its launch."""
    (key, entry), = memo._seen.items()
    assert entry[-1] is not None, "the entry holds no prepared launch"
    memo._seen[key] = entry[:-1] + ((entry[-1][0] + 1, entry[-1][1]),)


@pytest.fixture
def prepared_elsewhere():
    """:func:`memo_prepared_elsewhere`, for the GPU tests of the prepared launches."""
    return memo_prepared_elsewhere


def patch_numpy_holds(mp, holds):
    """With ``mp`` (a MonkeyPatch): the bench's and profiles' held (GPU time) passes switched
    on for NumPy. ``timing.Probe`` accepts ``hold_ms`` there, and a hold costs nothing but
    is appended to ``holds``. That tests the plumbing, not the figures."""
    from cpsparse import bench, timing

    class NumpyHeldProbe(timing.Probe):
        def __init__(self, xp=None, *, hold_ms=None):
            import numpy
            super().__init__(numpy if xp is None else xp)
            self.hold_ms = hold_ms

    mp.setattr(bench, "_gpu_time_pass", lambda xp: True)
    mp.setattr(timing, "Probe", NumpyHeldProbe)
    mp.setattr(timing, "_hold_stream", lambda xp, ms: holds.append(ms))
